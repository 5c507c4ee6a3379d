"""Reading a reply as it arrives: the steps every format's parser is made of.

A format's parser is a generator over a `Reader`: it reads from `r.buf` at `r.pos` and
`yield`s whenever the text so far does not decide what comes next (more is on its way,
unless `r.eof`). The steps here are generators too, used with `yield from`: each waits
exactly as long as the text is undecided and then moves `r.pos` past what it read, so a
reply gives the same result however it is cut into pieces. A parser keeps no position
across a `yield` but `r.pos` and `r.mark` (where the call it is reading began, while that
call may still turn out to be text): the driver drops the text before both between pieces.

    ok = yield from literal(r, "<tool_call>")       # True, or False at the first mismatch
    text, stop = yield from until(r, ("</x>",), out) # text up to the first stop (consumed)
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from typing import Any

Step = Generator[None, None, Any]  # a parser's step: yields while it waits for text


class Reader:
    """The reply's text: `buf` holds what has arrived from `pos` on (and, from `mark`,
    the start of a call not yet certain); `eof` once the reply is complete."""

    def __init__(self) -> None:
        self.buf, self.pos, self.eof = "", 0, False
        self.mark: int | None = None

    def add(self, text: str) -> None:
        """Append `text`, dropping what no step can read again."""
        cut = self.pos if self.mark is None else min(self.pos, self.mark)
        if cut > 4096:  # now and then: the copy is of what is still needed
            self.buf, self.pos = self.buf[cut:], self.pos - cut
            if self.mark is not None:
                self.mark -= cut
        self.buf += text

    def rest(self) -> str:
        return self.buf[self.pos :]


def wait(r: Reader, n: int = 1) -> Step:
    """Until `n` characters are unread (True) or the reply ended short of them (False)."""
    while len(r.buf) - r.pos < n and not r.eof:
        yield
    return len(r.buf) - r.pos >= n


def literal(r: Reader, s: str) -> Step:
    """Read `s` (True), or stay put at the first character that differs (False)."""
    while True:
        got = r.buf[r.pos : r.pos + len(s)]
        if not s.startswith(got):
            return False
        if len(got) == len(s):
            r.pos += len(s)
            return True
        if r.eof:
            return False
        yield


def one_of(r: Reader, options: Iterable[str]) -> Step:
    """Read the option the text spells (the longest when one begins another), or None
    (nothing read) once none can be."""
    options = sorted(options, key=len, reverse=True)
    while True:
        got = r.buf[r.pos : r.pos + len(options[0])]
        full = [o for o in options if got.startswith(o)]
        open_ = [o for o in options if len(got) < len(o) and o.startswith(got)]
        if full and (r.eof or not any(len(o) > len(full[0]) for o in open_)):
            r.pos += len(full[0])
            return full[0]
        if not open_ or r.eof:
            return None
        yield


def spaces(r: Reader) -> Step:
    """Read whitespace; return it."""
    read = []
    while True:
        start = r.pos
        while r.pos < len(r.buf) and r.buf[r.pos].isspace():
            r.pos += 1
        read.append(r.buf[start : r.pos])
        if r.pos < len(r.buf) or r.eof:
            return "".join(read)
        yield


def first(text: str, start: int, stops: Iterable[str]) -> tuple[int, str | None]:
    """(where, which) of the first of `stops` in `text` from `start` ((-1, None): none)."""
    best, which = -1, None
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best < 0 or i < best or (i == best and len(s) > len(which))):
            best, which = i, s
    return best, which


def partial(text: str, stops: Iterable[str]) -> int:
    """The length of the longest end of `text` that begins one of `stops`."""
    longest = 0
    for s in stops:
        for n in range(min(len(text), len(s) - 1), longest, -1):
            if s.startswith(text[-n:]):
                longest = n
                break
    return longest


def until(
    r: Reader, stops: tuple[str, ...], out: Callable[[str], None] | None = None, limit: int = 0
) -> Step:
    """Read up to the first of `stops` and past it: (text before it, the stop), or (all
    the rest, None) at the reply's end. `out` gets the text as soon as it cannot be the
    start of a stop. With `limit`, (None, None) once the text runs past that many
    characters (read up to the limit)."""
    pieces: list[str] = []
    while True:
        at, stop = first(r.buf, r.pos, stops)
        end = at if stop is not None else len(r.buf)
        if stop is None and not r.eof:
            end -= partial(r.buf[r.pos :], stops)
        if limit and sum(map(len, pieces)) + end - r.pos > limit:
            r.pos += limit - sum(map(len, pieces))  # read to the limit, however it arrived
            return None, None
        piece = r.buf[r.pos : end]
        if piece:
            pieces.append(piece)
            if out is not None:
                out(piece)
        r.pos = end
        if stop is not None:
            r.pos += len(stop)
            return "".join(pieces), stop
        if r.eof:
            return "".join(pieces), None
        yield
