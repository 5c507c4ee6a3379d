"""One request being generated, and the rule for each token it gets.

`Sequence.advance(token)` is the one per-token rule of every driver: an
end-of-sequence token ends the reply ("stop", no text), `max_tokens` ends it
("length"), text is decoded with the tokenizer's streaming detokenizer
(finalized at the end), and text that may be the start of a stop string is
held back until it is known not to be one (a stop string ends the reply
"stop", itself not shown). What comes out is an `Event`: the new text, the
token and its log-probabilities, and why the reply ended.

A `guarded` sequence (the server's) fails alone: an exception raised by its own
processing (its logits processors in `process`, its detokenizer or stop strings in
`advance`) ends its reply with finish_reason "error" and the reason, at its next
token, and the other rows and the server go on. Unguarded (`generate`, `Chat`), the
exception reaches the caller. Every rank runs the same processing on the same tokens,
so every rank ends the same sequence at the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..cluster.distributed import first_line
from .settings import SamplingParams
from .speculative import SpecStats
from .stops import find_stop, partial_stop

# A per-request logits processor: (the tokens the logits follow, prompt included, (T,);
# this rank's logits (1, V_local); the `VocabShard` they cover) -> processed logits. It
# runs on every rank, on that rank's columns (`shard.start`..`shard.stop`).
LogitsProcessor = Callable[[mx.array, mx.array, object], mx.array]


@dataclass
class Event:
    """One sequence's progress after a step: new text and, at the end, why it ended."""

    uid: int
    text: str
    token: int | None
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None  # "stop", "length", "cancelled", "interrupted", "error" or None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose keys and values came from a prompt cache
    completion_tokens: int
    drafted: int = 0  # tokens proposed by a drafter for this sequence so far
    accepted: int = 0  # of those, kept: generated without a forward of their own
    eos: bool = False  # `token` is an end-of-sequence token (not part of the text)
    stop_string: str | None = None  # the stop string that ended the reply, if one did
    error: str | None = None  # finish_reason "error": why (one line)
    error_setting: str | None = None  # the setting whose processing failed, if known


@dataclass
class Sequence:
    """A request's prompt, settings and progress (`tokens`: prompt and reply so far)."""

    uid: int
    prompt: list[int]
    params: SamplingParams
    detokenizer: object
    eos: frozenset[int]
    cached: int = 0  # prompt tokens that came from a prompt cache
    processors: list[LogitsProcessor] = field(default_factory=list)
    context: list[int] = field(default_factory=list)  # earlier tokens a reused cache holds
    tokens: list[int] = field(default_factory=list)
    fed: int = 0  # how many of `tokens` the KV cache holds
    n: int = 0  # tokens generated
    spec: SpecStats = field(default_factory=SpecStats)  # its speculative steps
    finished: str | None = None
    held: str = ""  # decoded, not yet sent: it may start a stop string
    guarded: bool = False  # a failure of its own processing ends it, not the caller
    fault: tuple[str | None, str] | None = None  # (setting, why) once it failed

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("the prompt is empty")
        self.tokens = list(self.prompt)

    def process(self, tokens: mx.array, logits: mx.array, shard) -> mx.array:
        """Its logits processors on its row of logits (1, V_local), which follow `tokens`.
        Guarded, a processor that raises leaves the row as it came and ends the reply
        with an error at its next token."""
        row = logits
        if self.fault is not None:
            return row
        for p in self.processors:
            try:
                row = p(tokens, row, shard)
            except Exception as e:
                if not self.guarded:
                    raise
                self.fault = (getattr(p, "setting", None), first_line(e))
                return logits
        return row

    def advance(self, token: int, logprob: float | None = None, top=None) -> Event:
        """The event of generating `token` (with its log-probabilities, if asked); a
        guarded sequence that failed ends here with finish_reason "error"."""
        if self.guarded:
            if self.fault is None:
                try:
                    return self._advance(token, logprob, top)
                except Exception as e:
                    self.fault = (None, first_line(e))
            return self.fail()
        return self._advance(token, logprob, top)

    def fail(self) -> Event:
        """The event that ends the reply for its fault (the text held back is dropped)."""
        self.finished, self.held = "error", ""
        setting, why = self.fault or (None, "failed")
        e = self.event("", None, None, None, "error")
        e.error, e.error_setting = why, setting
        return e

    def _advance(self, token: int, logprob: float | None, top) -> Event:
        self.n += 1
        self.tokens.append(token)
        finish, eos = None, token in self.eos
        if eos:
            finish = "stop"
        else:
            self.detokenizer.add_token(token)
            if self.n >= self.params.max_tokens:
                finish = "length"
        if finish:
            self.detokenizer.finalize()
        self.held += self.detokenizer.last_segment
        at, stop = find_stop(self.held, self.params.stop)
        if stop is not None:
            text, self.held, finish = self.held[:at], "", "stop"
        elif finish:
            text, self.held = self.held, ""
        else:
            cut = len(self.held) - partial_stop(self.held, self.params.stop)
            text, self.held = self.held[:cut], self.held[cut:]
        self.finished = finish
        return self.event(text, token, logprob, top, finish, eos, stop)

    def end(self, reason: str) -> str:
        """End the reply for `reason` ("interrupted", "cancelled"): the text held back."""
        self.detokenizer.finalize()
        text, self.held = self.held + self.detokenizer.last_segment, ""
        self.finished = reason
        return text

    def event(self, text, token, logprob, top, finish, eos=False, stop=None) -> Event:
        return Event(
            self.uid, text, token, logprob, top, finish, len(self.prompt), self.cached, self.n,
            self.spec.drafted, self.spec.accepted, eos, stop,
        )  # fmt: skip

    @property
    def history(self) -> list[int]:
        """Every token the sequence follows: a reused cache's, the prompt and the reply."""
        return self.context + self.tokens if self.context else self.tokens
