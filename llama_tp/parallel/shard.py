"""Shard a built model: by a placement (`shard_placed`, the loader's), by the built-in
partition alone (`shard_layers`, `shard_vocab`: the doctor's), or by a user's style plan
(`parallelize_model`).

The built-in way is the kinds' own: every layer's kinds split themselves by
`shard(group, part)` (their split tables, `kind_shard.py`), then the embedding and head
by vocabulary rows (`llama_plan.vocab_table`); the norms stay whole. `builtin_plan` is
the same split as one style table, for `plan` to print. Works on the model by its
attribute names (`layers[i].mixers()`, `tok_embeddings`, `args`), so this package never
imports `llama_tp.model` (the model's kinds import these layers).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .kind_shard import PlanPart
from .llama_plan import layers_table, model_shape_of, plan_for, vocab_table
from .parallelize import Parallelized, parallelize, plan_splits
from .parallelize import Plan as StylePlan
from .partition import Plan, held_bytes
from .placement import ModelShape, Placement, RankPlacement
from .sequence import SequenceContext
from .styles import LossParallel, PlanError, Replicate, VocabParallel

__all__ = [
    "builtin_plan",
    "model_shape_of",
    "parallelize_model",
    "plan_for",
    "shard_layers",
    "shard_model",
    "shard_placed",
    "shard_vocab",
    "styles_placement",
]


def _placed_vocab(model: nn.Module, placement: Placement, sequence_parallel: bool) -> StylePlan:
    """`vocab_table` for what `model` holds: a whole model, or a pipeline stage (the
    embedding on the first stage, vocabulary-parallel; the head on the last,
    loss-parallel). Explicit rows only for a weighted split (the balanced ones are the
    default)."""
    vocab = [placement.at(0, t).vocab for t in range(placement.tp)]
    weighted = placement.vocab_parallel and placement.plan.weights
    table = vocab_table(
        model,
        vocab_parallel=placement.vocab_parallel,
        sequence_parallel=sequence_parallel,
        vocab=vocab if weighted else None,
    )
    table = {k: v for k, v in table.items() if k in model}
    if "tok_embeddings" in table and "norm" not in model:  # a first stage: not the head
        rows = tuple((r.start, r.stop) for r in vocab) if weighted else None
        table["tok_embeddings"] = VocabParallel(rows) if placement.vocab_parallel else Replicate()
    return table


def builtin_plan(
    model: nn.Module, placement: Placement, *, sequence_parallel: bool = False
) -> StylePlan:
    """The built-in split of `placement`'s partition as one style table (`llama_plan`'s),
    for what `model` holds: a whole model or a pipeline stage. What `shard_placed` does,
    as `plan` prints it."""
    table = layers_table(model, placement.plan, sequence_parallel)
    table = {k: v for k, v in table.items() if k.split(".")[0] in model}
    return table | _placed_vocab(model, placement, sequence_parallel)


def shard_layers(
    model: nn.Module,
    plan: Plan,
    group: mx.distributed.Group,
    sequence: SequenceContext | None = None,
) -> None:
    """Split every layer's kinds over `group` by their own `shard(group, part)`, this
    rank's part of the partition `plan` (`sequence`: the model's sequence-parallel
    context, None without)."""
    part = PlanPart(plan, sequence)
    for layer in model.layers:
        for mixer in layer.mixers().values():
            mixer.shard(group, part)


def shard_placed(
    model: nn.Module,
    placement: Placement,
    group: mx.distributed.Group,
    *,
    sequence_parallel: bool = False,
) -> None:
    """Shard `model` (whole, or a stage) over its tensor group `group` as `placement`
    says: its kinds by their `shard`, then the embedding and head by vocabulary rows."""
    sequence = SequenceContext(group) if sequence_parallel else None
    shard_layers(model, placement.plan, group, sequence)
    parallelize(model, _placed_vocab(model, placement, sequence_parallel), group, sequence)


def shard_vocab(model: nn.Module, group: mx.distributed.Group, start: int, stop: int) -> None:
    """Keep vocabulary rows [start, stop) of `model`'s embedding and output head: the
    embedding then completes its vectors with one all-reduce, and the model returns this
    rank's logits only, (B, L, stop - start)."""
    rows = {group.rank(): (start, stop)}
    plan: StylePlan = {"tok_embeddings": VocabParallel(rows)}
    if not model.args.tie_word_embeddings:
        plan["output"] = LossParallel(rows)
    parallelize(model, plan, group)


def _check_vocab(model: nn.Module, plan: StylePlan, n: int) -> None:
    """Sampling reads the vocabulary range of the logits from the embedding: a
    vocabulary-parallel head needs a vocabulary-parallel embedding with the same rows."""
    splits = {
        path: (style, split) for path, (_, style, split) in plan_splits(model, plan, n).items()
    }
    emb = splits.get("tok_embeddings", (None, None))
    out = splits.get("output", (None, None))
    emb_vp, out_vp = isinstance(emb[0], VocabParallel), isinstance(out[0], VocabParallel)
    tied = model.args.tie_word_embeddings
    if out_vp and not emb_vp:
        raise PlanError(
            "output: a vocabulary-parallel head needs tok_embeddings: VocabParallel "
            "with the same ranges (sampling reads the logits' range from the embedding)"
        )
    if (
        emb_vp
        and not tied
        and not (
            out_vp
            and [emb[1].describe(r) for r in range(n)] == [out[1].describe(r) for r in range(n)]
        )
    ):
        raise PlanError(
            "tok_embeddings: a vocabulary-parallel embedding of an untied model needs "
            "output: LossParallel (or VocabParallel) with the same ranges"
        )


def parallelize_model(
    model: nn.Module,
    group: mx.distributed.Group,
    plan: StylePlan,
    *,
    sequence_parallel: bool = False,
) -> Parallelized:
    """Apply a user's style `plan` to `model` over `group` (the embedding and head as it
    states them, checked: `_check_vocab`)."""
    if sequence_parallel:
        raise PlanError(
            "sequence_parallel=True builds on the built-in plan; with your own plan, "
            "state SequenceParallel and the 'sequence' layouts in it"
        )
    _check_vocab(model, plan, group.size())
    return parallelize(model, plan, group)


def styles_placement(done: Parallelized, shape: ModelShape) -> RankPlacement:
    """This rank's placement under a style plan `done` applied to the whole model: the
    slice of every tensor of `shape` its styles keep."""
    slices = {name: done.tensor_slice(name, stored) for name, (stored, _) in shape.tensors.items()}
    nbytes = sum(held_bytes(*shape.tensors[k], s) for k, s in slices.items())
    layers = range(shape.args.n_layers)
    return RankPlacement(done.rank, 0, done.rank, layers, None, None, slices, nbytes)


def shard_model(model: nn.Module, group: mx.distributed.Group, moe_split: str = "tensor") -> Plan:
    """Split every layer's kinds (experts: by `moe_split`) by the built-in partition (the
    embedding and head stay whole: see `shard_vocab`); returns the partition."""
    partition_ = plan_for(model, group.size(), moe_split)
    shard_layers(model, partition_, group)
    return partition_
