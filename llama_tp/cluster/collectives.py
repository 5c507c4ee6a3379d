"""Collectives of a decode step, counted and timed.

`collectives()` wraps mx.distributed's collectives while a block runs. The
layers (mlx's sharded linears, `llama_tp.layers`, `llama_tp.vocab_parallel`,
the samplers) look `mx.distributed.all_sum` and friends up at call time, so
building a step's graph inside the block records every collective it will
run: this is how the benchmark counts them instead of deriving a formula.
With `mode="identity"` the collectives return their input instead: the same
compute without communication, numerically wrong, for timing what the
collectives cost (`decode_share`). A llama_tp model's step counted layer by layer:
`benchmarks/layer_collectives.py`.

The pipeline's point-to-point `send`/`recv` (loading/pipeline.py) are wrapped too
(identity: `send` returns its input, `recv` zeros of the shape it expects). A
pipeline stage evaluates its send while its graph is built, so a mesh's step is
counted in identity mode: nothing crosses a link, every call is still recorded.
Each call records the group it was made on, so a mesh's traffic splits into the
tensor group's and the pipeline group's (`traffic`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import mlx.core as mx

from .distributed import barrier, world

_OPS = ("all_sum", "all_gather", "all_max", "all_min", "send", "recv")
REDUCES = ("all_sum", "all_max", "all_min")


class Call(NamedTuple):
    """One collective call: its op, this rank's message (the bytes it contributes,
    sends or receives) and the group it was made on (None: the world)."""

    op: str
    nbytes: int
    group: Any = None


@contextmanager
def collectives(mode: str = "count") -> Iterator[list[Call]]:
    """Wrap mx.distributed's collectives while the block runs; yields the calls made.

    `mode="count"` calls through; `mode="identity"` returns the input instead
    (all_gather: the input repeated group-size times, so that shapes stay right;
    recv: zeros of the expected shape).
    """
    calls: list[Call] = []
    saved = {op: getattr(mx.distributed, op) for op in _OPS}

    def wrap(op: str, fn: Callable) -> Callable:
        def wrapped(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
            calls.append(Call(op, x.nbytes, kwargs.get("group")))
            if mode == "count":
                return fn(x, *args, **kwargs)
            if op == "all_gather":
                n = (kwargs.get("group") or world()).size()
                return mx.concatenate([x] * n, axis=0)
            return x

        return wrapped

    def wrap_recv(fn: Callable) -> Callable:
        def recv(shape: Any, dtype: mx.Dtype, *args: Any, **kwargs: Any) -> mx.array:
            calls.append(Call("recv", math.prod(shape) * dtype.size, kwargs.get("group")))
            if mode == "count":
                return fn(shape, dtype, *args, **kwargs)
            return mx.zeros(shape, dtype)

        return recv

    for op, fn in saved.items():
        setattr(mx.distributed, op, wrap_recv(fn) if op == "recv" else wrap(op, fn))
    try:
        yield calls
    finally:
        for op, fn in saved.items():
            setattr(mx.distributed, op, fn)


def summary(calls: list[Call]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for op, nbytes, _ in calls:
        d = out.setdefault(op, {"calls": 0, "bytes": 0})
        d["calls"] += 1
        d["bytes"] += nbytes
    return out


def traffic(calls: list[Call], pipeline_group: Any = None) -> dict[str, Any]:
    """This rank's messages, by group ("tensor", or "pipeline": calls made on
    `pipeline_group`), op and message size: [{group, op, calls, bytes}] with `bytes`
    one message's; what it sends (every message but those it receives); its rounds
    (every call it takes part in, a recv included); and its tensor-group rounds before
    and after the first pipeline-group collective (the logits' all-reduce), which
    tell the stages' sequential rounds from those they run side by side."""
    kinds = [
        "pipeline" if pipeline_group is not None and c.group is pipeline_group else "tensor"
        for c in calls
    ]
    rows: dict[tuple[str, str, int], int] = {}
    for kind, (op, nbytes, _) in zip(kinds, calls, strict=True):
        rows[kind, op, nbytes] = rows.get((kind, op, nbytes), 0) + 1
    messages = [
        {"group": g, "op": op, "calls": n, "bytes": b}
        for (g, op, b), n in sorted(rows.items(), key=lambda kv: (kv[0][0] != "tensor", kv[0]))
    ]
    shared = [
        i
        for i, (k, c) in enumerate(zip(kinds, calls, strict=True))
        if k == "pipeline" and c.op not in ("send", "recv")
    ]
    cut = shared[0] if shared else len(calls)
    return {
        "messages": messages,
        "bytes_sent": sum(c.nbytes for c in calls if c.op != "recv"),
        "rounds": len(calls),
        "tensor_rounds": [kinds[:cut].count("tensor"), kinds[cut:].count("tensor")],
    }


def count_step(step: Callable[[], Any]) -> dict[str, Any]:
    """Collectives made while `step()` builds its graph (for models other than llama_tp's)."""
    with collectives() as calls:
        step()
    reduces = sum(c.op in REDUCES for c in calls)
    return {
        "all_reduces_per_token": reduces,
        "other_collectives_per_token": len(calls) - reduces,
        "collective_bytes_per_token": sum(c.nbytes for c in calls),
        "by_op": summary(calls),
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
