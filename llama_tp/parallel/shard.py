"""Apply a plan to a built Llama model: `parallelize_model` (the loader's), `shard_model`.

Works on the model by its attribute names (`layers[i].attention`, `.feed_forward`,
`args`), so this package never imports `llama_tp.model` (the model imports its layers).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .llama_plan import check_quantized_heads, llama_plan, plan_for
from .parallelize import Parallelized, parallelize, plan_splits
from .parallelize import Plan as StylePlan
from .partition import Plan
from .styles import PlanError, VocabParallel

__all__ = ["check_quantized_heads", "parallelize_model", "plan_for", "shard_model"]


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
        partition = plan_for(model, n)
        check_quantized_heads(model, partition)
        plan = llama_plan(
            model,
            n,
            vocab_parallel=vocab_parallel,
            sequence_parallel=sequence_parallel,
            plan=partition,
        )
    elif sequence_parallel:
        raise PlanError(
            "sequence_parallel=True builds on the built-in plan; with your own plan, "
            "state SequenceParallel and the 'sequence' layouts in it"
        )
    _check_vocab(model, plan, n)
    return parallelize(model, plan, group)


def shard_model(model: nn.Module, group: mx.distributed.Group) -> Plan:
    """Split attention and feed-forward by the built-in plan (the embedding and head
    stay whole: see `Transformer.shard_vocab`); returns the partition plan."""
    partition = plan_for(model, group.size())
    check_quantized_heads(model, partition)
    table = llama_plan(model, group.size(), plan=partition)
    parallelize(model, {k: v for k, v in table.items() if k.startswith("layers.")}, group)
    return partition
