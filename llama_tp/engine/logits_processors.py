"""A sequence's logits processors from its settings, on this rank's vocabulary columns.

`processors_for(params, ...)` is the list `Sequence.processors` runs before every
draw: OpenAI's `logit_bias`, mlx-lm's presence / frequency / repetition penalties
(mlx-lm's own processors, `mlx_lm.sample_utils`, over the last `penalty_context`
tokens), the grammar mask of a constrained reply (`grammar.GrammarMask`) and the
reasoning budget, which closes a think block after so many tokens (`BudgetMask`). Each
takes (the tokens the logits follow, this rank's logits (1, V_local), its
`VocabShard`): the token ids are moved into the shard's columns, so a
vocabulary-parallel head processes its own slice and every rank the same tokens.
Each carries the name of the setting it applies (`setting`), so that a failure can be
told as that setting's (`Sequence.process`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    make_frequency_penalty,
    make_presence_penalty,
    make_repetition_penalty,
)

from .grammar import GrammarMask
from .settings import ReasoningBudget, SamplingParams


def processors_for(
    params: SamplingParams, tokenizer: Any, vocab_size: int, eos: frozenset[int]
) -> list:
    """The logits processors `params` asks for (empty for most requests)."""
    out: list = []
    if params.logit_bias:
        out.append(_named(_bias(dict(params.logit_bias)), "logit_bias"))
    n = params.penalty_context
    for make, setting in (
        (make_repetition_penalty, "repetition_penalty"),
        (make_presence_penalty, "presence_penalty"),
        (make_frequency_penalty, "frequency_penalty"),
    ):
        value = getattr(params, setting)
        if value:
            out.append(_named(_on_shard(make(value, n), n), setting))
    if params.reasoning_budget is not None:
        out.append(_named(BudgetMask(params.reasoning_budget, tokenizer), "reasoning_budget"))
    if params.grammar is not None:
        out.append(_named(GrammarMask(params.grammar, tokenizer, vocab_size, eos), "grammar"))
    return out


def _named(processor, setting: str):
    processor.setting = setting
    return processor


def _bias(bias: dict[int, float]):
    def processor(tokens: mx.array, logits: mx.array, shard) -> mx.array:
        mine = {t - shard.start: b for t, b in bias.items() if shard.start <= t < shard.stop}
        if not mine:
            return logits
        return logits.at[:, mx.array(list(mine))].add(mx.array(list(mine.values())))

    return processor


def _on_shard(penalty, context: int):
    """mlx-lm's penalty on the columns [shard.start, shard.stop) of the vocabulary."""

    def processor(tokens: mx.array, logits: mx.array, shard) -> mx.array:
        # Never a slice bound past MLX's 32-bit indices, whatever the setting says.
        last = tokens[-min(context, tokens.shape[0]) :].tolist()
        recent = [t - shard.start for t in last if shard.start <= t < shard.stop]
        return penalty(mx.array(recent, mx.int32), logits) if recent else logits

    return processor


class BudgetMask:
    """The reasoning budget (`ReasoningBudget`): once the reply has reasoned for its
    tokens, and its text ends on a whole character (a token may hold part of one, and a
    grammar refuses a marker inside one), only the next id of the end marker is allowed,
    until the marker is written.

    Read from the tokens alone at every call (the first call, the prompt's last forward,
    fixes where the reply starts), so rejected drafts need no rollback. llama.cpp's
    reasoning budget does the same (`common/reasoning-budget.cpp`), as a state machine.
    """

    WAIT = 4  # tokens at most a character's bytes take past the budget

    def __init__(self, budget: ReasoningBudget, tokenizer: Any = None):
        self.budget, self.tokenizer, self.start = budget, tokenizer, None

    def __call__(self, tokens: mx.array, logits: mx.array, shard) -> mx.array:
        if self.start is None:
            self.start = tokens.shape[0]
        forced = self.forced(tokens[self.start :].tolist())
        if forced is None:
            return logits
        col = forced - shard.start
        if not 0 <= col < shard.stop - shard.start:  # another rank's column: none here
            return mx.full(logits.shape, -mx.inf, logits.dtype)
        keep = mx.arange(logits.shape[-1]) == col
        return mx.where(keep[None], logits, -mx.inf)

    def forced(self, reply: list[int]) -> int | None:
        """The id the reply must go on with (None: any)."""
        b = self.budget
        at = 0 if b.opened else _find(reply, b.start)
        if at < 0:
            return None  # the block is not open (yet)
        inside = reply[at + (0 if b.opened else len(b.start)) :]
        closed = _find(inside, b.end)
        if 0 <= closed < b.tokens or len(inside) < b.tokens:
            return None  # closed by the model, or still within the budget
        cut = b.tokens  # where the forcing starts: past a character's last byte
        while cut < min(len(inside), b.tokens + self.WAIT) and self._midway(inside[:cut]):
            cut += 1
        if cut == len(inside) and self._midway(inside) and cut < b.tokens + self.WAIT:
            return None  # the character's next byte comes first
        written = inside[cut:]
        if len(written) >= len(b.end) or written != list(b.end[: len(written)]):
            return None
        return b.end[len(written)]

    def _midway(self, ids: list[int]) -> bool:
        """Whether the text of `ids` ends inside a character (a byte token's part of it)."""
        if self.tokenizer is None or not ids:
            return False
        return self.tokenizer.decode(ids[-self.WAIT :]).endswith("\ufffd")


def _find(seq: list[int], part: tuple[int, ...]) -> int:
    """Where `part` first occurs in `seq` (-1: nowhere; an empty part: nowhere)."""
    n = len(part)
    if not n:
        return -1
    first = part[0]
    for i, t in enumerate(seq):
        if t == first and tuple(seq[i : i + n]) == part:
            return i
    return -1
