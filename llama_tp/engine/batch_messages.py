"""What the server's scheduler and the batch engine exchange: a sequence's settings, a
sequence to admit, rank 0's per-step decision (broadcast to every rank) and a
sequence's progress after a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """One sequence's settings (OpenAI's names where they exist)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: no log-probabilities; k: the token's and the k best
    num_draft_tokens: int = 0  # prompt-lookup drafts per step when the row decodes alone (greedy)


@dataclass
class Join:
    """A sequence to admit: its id, prompt token ids and settings."""

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
    draft: int = 0  # the batch holds one row that asked for drafts: draft up to this many


@dataclass
class Event:
    """One sequence's progress after a step: new text and, at the end, why it ended."""

    uid: int
    text: str
    token: int | None
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None  # "stop", "length", "cancelled" or None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose keys and values came from the prompt cache
    completion_tokens: int
    drafted: int = 0  # prompt-lookup tokens proposed for this sequence so far
    accepted: int = 0  # tokens generated without a forward of their own (accepted drafts)
