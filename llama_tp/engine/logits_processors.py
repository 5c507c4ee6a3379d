"""A sequence's logits processors from its settings, on this rank's vocabulary columns.

`processors_for(params, ...)` is the list `Sequence.processors` runs before every
draw: OpenAI's `logit_bias`, mlx-lm's presence / frequency / repetition penalties
(mlx-lm's own processors, `mlx_lm.sample_utils`, over the last `penalty_context`
tokens), and the grammar mask of a constrained reply (`grammar.GrammarMask`). Each
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
from .settings import SamplingParams


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
