"""Shard a built native model: by a placement (`shard_placed`, the loader's), by a
user's style plan (`parallelize_model`), or by the built-in plan alone (`shard_model`).

Works on the model by its attribute names (`layers[i].attention`, `.feed_forward`,
`args`), so this package never imports `llama_tp.model` (the model imports its layers).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .llama_plan import llama_plan, model_shape_of, plan_for
from .parallelize import Parallelized, parallelize, plan_splits
from .parallelize import Plan as StylePlan
from .partition import Plan, held_bytes
from .placement import ModelShape, Placement, RankPlacement
from .styles import PlanError, Replicate, VocabParallel

__all__ = [
    "builtin_plan",
    "model_shape_of",
    "parallelize_model",
    "plan_for",
    "shard_model",
    "shard_placed",
    "styles_placement",
]


def builtin_plan(
    model: nn.Module, placement: Placement, *, sequence_parallel: bool = False
) -> StylePlan:
    """The built-in style table (`llama_plan`) of `placement`'s partition, for what `model`
    holds: a whole model, or a pipeline stage (its layers; the embedding on the first
    stage, vocabulary-parallel; the norm and head on the last, loss-parallel)."""
    vocab = [placement.at(0, t).vocab for t in range(placement.tp)]
    table = llama_plan(
        model,
        placement.tp,
        vocab_parallel=placement.vocab_parallel,
        sequence_parallel=sequence_parallel,
        plan=placement.plan,
        # explicit rows only for a weighted split (the balanced ones are the default)
        vocab=vocab if placement.vocab_parallel and placement.plan.weights else None,
    )
    table = {k: v for k, v in table.items() if k.split(".")[0] in model}
    if "tok_embeddings" in table and "norm" not in model:  # a first stage: not the head
        rows = None
        if placement.plan.weights:
            rows = tuple((r.start, r.stop) for r in vocab)
        table["tok_embeddings"] = VocabParallel(rows) if placement.vocab_parallel else Replicate()
    return table


def shard_placed(
    model: nn.Module,
    placement: Placement,
    group: mx.distributed.Group,
    *,
    sequence_parallel: bool = False,
) -> Parallelized:
    """Shard `model` (whole, or a stage) over its tensor group `group` as `placement` says."""
    return parallelize(
        model, builtin_plan(model, placement, sequence_parallel=sequence_parallel), group
    )


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
    plan: StylePlan | None = None,
    *,
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
) -> Parallelized:
    """Apply `plan` (default: the built-in `llama_plan`) to `model` over `group`."""
    n = group.size()
    if plan is None:
        plan = llama_plan(
            model,
            n,
            vocab_parallel=vocab_parallel,
            sequence_parallel=sequence_parallel,
            plan=plan_for(model, n),
        )
    elif sequence_parallel:
        raise PlanError(
            "sequence_parallel=True builds on the built-in plan; with your own plan, "
            "state SequenceParallel and the 'sequence' layouts in it"
        )
    _check_vocab(model, plan, n)
    return parallelize(model, plan, group)


def styles_placement(done: Parallelized, shape: ModelShape) -> RankPlacement:
    """This rank's placement under a style plan `done` applied to the whole model: the
    slice of every tensor of `shape` its styles keep."""
    slices = {name: done.tensor_slice(name, stored) for name, (stored, _) in shape.tensors.items()}
    nbytes = sum(held_bytes(*shape.tensors[k], s) for k, s in slices.items())
    layers = range(shape.args.n_layers)
    return RankPlacement(done.rank, 0, done.rank, layers, None, None, slices, nbytes)


def shard_model(model: nn.Module, group: mx.distributed.Group, moe_split: str = "tensor") -> Plan:
    """Split attention and feed-forward (experts: by `moe_split`) by the built-in plan (the
    embedding and head stay whole: see `Transformer.shard_vocab`); returns the partition."""
    partition_ = plan_for(model, group.size(), moe_split)
    table = llama_plan(model, group.size(), plan=partition_)
    parallelize(model, {k: v for k, v in table.items() if k.startswith("layers.")}, group)
    return partition_
