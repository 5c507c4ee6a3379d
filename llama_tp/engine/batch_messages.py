"""What the server's scheduler and the batch engine exchange: a sequence to admit,
an embedding request to work through (`Embed`), rank 0's per-step decision (broadcast
to every rank), a sequence's progress after a step (`Event`, with the settings
`SamplingParams`, from the core) and an embedding request's vectors (`Embedded`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Event
from .settings import SamplingParams

__all__ = ["Decision", "Embed", "Embedded", "Event", "Join", "SamplingParams"]


@dataclass
class Join:
    """A sequence to admit: its id, prompt token ids and settings (the engine's one
    internal request, whichever API asked)."""

    uid: int
    prompt: list[int]
    params: SamplingParams
    # Counts of prompt tokens at which a recurrent state is kept in the prompt cache
    # (the end of a chat prompt before its generation prompt), beside the prompt's end
    marks: tuple[int, ...] = ()


@dataclass
class Embed:
    """An embedding request: its id, its inputs' token ids and how their hidden states
    pool into one vector each ("mean", "cls" or "last": engine/embeddings.py)."""

    uid: int
    inputs: list[list[int]]
    pooling: str


@dataclass
class Embedded:
    """An embedding request's end: its vectors (float32 values, one per input, in order;
    not normalized), or why it has none (finish_reason "cancelled" or "error")."""

    uid: int
    vectors: list[list[float]] | None
    prompt_tokens: int
    finish_reason: str = "stop"
    error: str | None = None


@dataclass
class Decision:
    """What every rank does before the next step (rank 0 decides, all apply)."""

    joins: list[Join] = field(default_factory=list)
    embeds: list[Embed] = field(default_factory=list)  # embedding requests to queue
    cancels: list[int] = field(default_factory=list)
    stop: bool = False
    idle: float = 0.0  # nothing to do: sleep this long before the next decision
    report: bool = False  # every rank sends rank 0 its status (server/status.py) first
    # Grammars every rank compiles ahead, off its step loop (grammar.Prefetch), by request
    # id, before rank 0 lets the requests join; and the requests it still waits for.
    prepare: dict[int, str] = field(default_factory=dict)
    awaited: list[int] = field(default_factory=list)
