"""A sequence's logits processors from its settings, on this rank's vocabulary columns.

`processors_for(params, ...)` is the list `Sequence.processors` runs before every
draw: OpenAI's `logit_bias`, mlx-lm's presence / frequency / repetition penalties
(mlx-lm's own processors, `mlx_lm.sample_utils`, over the last `penalty_context`
tokens), and the grammar mask of a constrained reply (`grammar.GrammarMask`). Each
takes (the tokens the logits follow, this rank's logits (1, V_local), its
`VocabShard`): the token ids are moved into the shard's columns, so a
vocabulary-parallel head processes its own slice and every rank the same tokens.
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
from .settings import SamplingParams


def processors_for(
    params: SamplingParams, tokenizer: Any, vocab_size: int, eos: frozenset[int]
) -> list:
    """The logits processors `params` asks for (empty for most requests)."""
    out: list = []
    if params.logit_bias:
        out.append(_bias(dict(params.logit_bias)))
    n = params.penalty_context
    for make, value in (
        (make_repetition_penalty, params.repetition_penalty),
        (make_presence_penalty, params.presence_penalty),
        (make_frequency_penalty, params.frequency_penalty),
    ):
        if value:
            out.append(_on_shard(make(value, n), n))
    if params.grammar is not None:
        out.append(GrammarMask(params.grammar, tokenizer, vocab_size, eos))
    return out


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
        recent = [
            t - shard.start for t in tokens[-context:].tolist() if shard.start <= t < shard.stop
        ]
        return penalty(mx.array(recent, mx.int32), logits) if recent else logits

    return processor
