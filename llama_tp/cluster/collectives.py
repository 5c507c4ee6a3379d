"""Collectives of a decode step, counted and timed.

`collectives()` wraps mx.distributed's collectives while a block runs. The
layers (mlx's sharded linears, `llama_tp.layers`, `llama_tp.vocab_parallel`,
the samplers) look `mx.distributed.all_sum` and friends up at call time, so
building a step's graph inside the block records every collective it will
run: this is how the benchmark counts them instead of deriving a formula.
With `mode="identity"` the collectives return their input instead: the same
compute without communication, numerically wrong, for timing what the
collectives cost (`decode_share`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from .distributed import barrier, world

_OPS = ("all_sum", "all_gather", "all_max", "all_min")
REDUCES = ("all_sum", "all_max", "all_min")


@contextmanager
def collectives(mode: str = "count") -> Iterator[list[tuple[str, int]]]:
    """Wrap mx.distributed's collectives while the block runs; yields the calls made.

    Each call is recorded as (op, bytes this rank contributes). `mode="count"`
    calls through; `mode="identity"` returns the input instead (all_gather: the
    input repeated group-size times, so that shapes stay right).
    """
    calls: list[tuple[str, int]] = []
    saved = {op: getattr(mx.distributed, op) for op in _OPS}

    def wrap(op: str, fn: Callable) -> Callable:
        def wrapped(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
            calls.append((op, x.nbytes))
            if mode == "count":
                return fn(x, *args, **kwargs)
            if op == "all_gather":
                n = (kwargs.get("group") or world()).size()
                return mx.concatenate([x] * n, axis=0)
            return x

        return wrapped

    for op, fn in saved.items():
        setattr(mx.distributed, op, wrap(op, fn))
    try:
        yield calls
    finally:
        for op, fn in saved.items():
            setattr(mx.distributed, op, fn)


def _summary(calls: list[tuple[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for op, nbytes in calls:
        d = out.setdefault(op, {"calls": 0, "bytes": 0})
        d["calls"] += 1
        d["bytes"] += nbytes
    return out


def count_collectives(model: Any, decode: Callable[[list[Any]], Any]) -> dict[str, Any]:
    """The collectives of one decode step of llama_tp's `model`: total, per layer, elsewhere.

    `decode(cache)` builds one steady-state decode step's graph (with sampling) on
    `cache`. Builds the graphs (never evaluates them) on fresh caches: the whole
    step, then every layer on its own; what the step makes outside the layers is
    the embedding's and the sampler's share.
    """
    from mlx_lm.models.cache import make_prompt_cache

    y = mx.array([[1]], dtype=mx.int32)
    with collectives() as step:
        decode(make_prompt_cache(model))
    cache = make_prompt_cache(model)
    h = model.tok_embeddings(y)  # (1, 1, dim)
    per_layer = []
    for layer, c in zip(model.layers, cache, strict=True):
        with collectives() as calls:
            h = layer(h, None, c)
        per_layer.append(sum(op in REDUCES for op, _ in calls))
    reduces = sum(op in REDUCES for op, _ in step)
    return {
        "all_reduces_per_token": reduces,
        "all_reduces_per_layer": sum(per_layer) / len(per_layer),
        "all_reduces_in_layers": per_layer,
        "all_reduces_outside_layers": reduces - sum(per_layer),
        "other_collectives_per_token": len(step) - reduces,
        "collective_bytes_per_token": sum(b for _, b in step),
        "by_op": _summary(step),
    }


def count_step(step: Callable[[], Any]) -> dict[str, Any]:
    """Collectives made while `step()` builds its graph (for models other than llama_tp's)."""
    with collectives() as calls:
        step()
    reduces = sum(op in REDUCES for op, _ in calls)
    return {
        "all_reduces_per_token": reduces,
        "other_collectives_per_token": len(calls) - reduces,
        "collective_bytes_per_token": sum(b for _, b in calls),
        "by_op": _summary(calls),
    }


def decode_share(step_seconds: Callable[[], float]) -> dict[str, Any]:
    """Decode step time with real collectives and with identity ones (best of two each).

    `step_seconds()` decodes a few tokens (every rank alike) and returns the
    mean seconds per decode step; it runs twice in each mode, alternately.
    """
    real, ident = [], []
    for _ in range(2):
        with collectives("count"):
            real.append(step_seconds())
        barrier()
        with collectives("identity"):
            ident.append(step_seconds())
        barrier()  # without collectives the ranks drift apart
    t_real, t_id = min(real), min(ident)
    return {
        "decode_step_ms": 1e3 * t_real,
        "decode_step_ms_no_collectives": 1e3 * t_id,
        "collective_share": max(0.0, 1 - t_id / t_real),
    }


def count_prefill_collectives(model: Any, length: int) -> dict[str, Any]:
    """The collectives of one prefill of `length` tokens, whole and in the first layer:
    op -> calls and bytes. Builds the graphs, never evaluates them. With sequence
    parallelism a layer shows its all-gathers next to the (reduce-scatter) all_sums."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.zeros((1, length), dtype=mx.int32)
    with collectives() as whole:
        model(tokens, cache=make_prompt_cache(model))
    cache = make_prompt_cache(model)
    h = model.tok_embeddings(tokens)
    with collectives() as layer:
        model.layers[0](h, "causal" if h.shape[1] > 1 else None, cache[0])
    return {"tokens": length, "by_op": _summary(whole), "per_layer": _summary(layer)}
