"""Stop strings in streamed text: where one ends the reply, and how much to hold back."""

from __future__ import annotations


def find_stop(text: str, stops: list[str]) -> tuple[int, str | None]:
    """Where the first stop string in `text` begins, and which one it is."""
    best, hit = len(text), None
    for s in stops:
        i = text.find(s)
        if i != -1 and i < best:
            best, hit = i, s
    return best, hit


def partial_stop(text: str, stops: list[str]) -> int:
    """The length of the longest end of `text` that begins some stop string."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n
