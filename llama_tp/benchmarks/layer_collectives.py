"""The collectives of one decode step and one prefill of a model, and of each of its
layers: the benchmark's counts (`bench`), built as graphs inside
`cluster.collectives.collectives()` and never evaluated. Each layer runs on its own
cache (`models/caches.per_layer`: none for a KV-shared layer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..cluster.collectives import REDUCES, collectives, summary, traffic
from ..models import caches as layer_cache


def _layer_input(model: Any, tokens: mx.array) -> mx.array:
    """What the first layer of `model` takes: the embedded tokens, or (a later pipeline
    stage) zeros in the dtype it receives: (1, L, dim)."""
    if "tok_embeddings" in model and getattr(getattr(model, "mesh", None), "first", True):
        return model.tok_embeddings(tokens)
    dtype = getattr(model, "in_dtype", None) or mx.float32
    return mx.zeros((*tokens.shape, model.args.dim), dtype)


def count_collectives(
    model: Any, decode: Callable[[list[Any]], Any], mode: str = "count"
) -> dict[str, Any]:
    """The collectives of one decode step of llama_tp's `model`: total, per layer, elsewhere.

    `decode(cache)` builds one steady-state decode step's graph (with sampling) on
    `cache`. Builds the graphs (never evaluates them) on fresh caches: the whole
    step, then every layer on its own; what the step makes outside the layers is
    the embedding's and the sampler's share (and a pipeline stage's send, receive
    and logits all-reduce). `mode="identity"` for a pipeline stage (`cluster.collectives`).
    """
    from mlx_lm.models.cache import make_prompt_cache

    y = mx.array([[1]], dtype=mx.int32)
    with collectives(mode) as step:
        decode(make_prompt_cache(model))
    h = _layer_input(model, y)  # (1, 1, dim)
    per_layer = []
    # mlx-lm's classes (generic/): layers take what their model gives them, not (h, mask,
    # cache): only the whole step is counted
    layers = [] if hasattr(model, "structure") else model.layers
    cache = layer_cache.per_layer(layers, make_prompt_cache(model)) if layers else []
    for layer, kv in zip(layers, cache, strict=True):
        with collectives(mode) as calls:
            h = layer(h, None, kv)
        per_layer.append(sum(c.op in REDUCES for c in calls))
    reduces = sum(c.op in REDUCES for c in step)
    pipeline_group = getattr(getattr(model, "mesh", None), "pp_group", None)
    return {
        "all_reduces_per_token": reduces,
        "all_reduces_per_layer": sum(per_layer) / len(per_layer) if per_layer else None,
        "all_reduces_in_layers": per_layer,
        "all_reduces_outside_layers": reduces - sum(per_layer),
        "other_collectives_per_token": len(step) - reduces,
        "collective_bytes_per_token": sum(c.nbytes for c in step),
        "by_op": summary(step),
        "traffic": traffic(step, pipeline_group),
    }


def count_prefill_collectives(model: Any, length: int, mode: str = "count") -> dict[str, Any]:
    """The collectives of one prefill of `length` tokens, whole and in the first layer:
    op -> calls and bytes. Builds the graphs, never evaluates them (a pipeline stage:
    `mode="identity"`). With sequence parallelism a layer shows its all-gathers next to
    the (reduce-scatter) all_sums. Sequence-parallel attention evaluates each of its
    query blocks as it builds them: call this inside `models.attention.lazy_query_blocks()` (as
    bench does) so that nothing runs."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.zeros((1, length), dtype=mx.int32)
    with collectives(mode) as whole:
        model(tokens, cache=make_prompt_cache(model))
    cache = make_prompt_cache(model)
    h = _layer_input(model, tokens)
    spec = getattr(getattr(model.layers[0], "spec", None), "cache", None)
    recurrent = spec is not None and spec.mask == "ssm"  # one sequence: no padding mask
    mask = "causal" if h.shape[1] > 1 and not recurrent else None
    with collectives(mode) as layer:
        if not hasattr(model, "structure"):  # (mlx-lm's classes: see count_collectives)
            model.layers[0](h, mask, cache[0])
    return {"tokens": length, "by_op": summary(whole), "per_layer": summary(layer)}
