"""What the server's scheduler and the batch engine exchange: a sequence to admit,
rank 0's per-step decision (broadcast to every rank) and a sequence's progress
after a step (`Event`, with the settings `SamplingParams`, from the core)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Event
from .settings import SamplingParams

__all__ = ["Decision", "Event", "Join", "SamplingParams"]


@dataclass
class Join:
    """A sequence to admit: its id, prompt token ids and settings (the engine's one
    internal request, whichever API asked)."""

    uid: int
    prompt: list[int]
    params: SamplingParams


@dataclass
class Decision:
    """What every rank does before the next step (rank 0 decides, all apply)."""

    joins: list[Join] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)
    stop: bool = False
    idle: float = 0.0  # nothing to do: sleep this long before the next decision
    report: bool = False  # every rank sends rank 0 its status (server/status.py) first
    # Grammars every rank compiles ahead, off its step loop (grammar.Prefetch), by request
    # id, before rank 0 lets the requests join; and the requests it still waits for.
    prepare: dict[int, str] = field(default_factory=dict)
    awaited: list[int] = field(default_factory=list)
