"""Run under mlx.launch: einshard and sharded_einsum on real ranks; rank 0 prints JSON.

    mlx.launch -n 4 -- python tests/mp_einshard.py

Checks: every rank's part, reassembled, equals the array and replicas are equal; the
seed's MLP equals one process; a Llama feed-forward written with sharded_einsum equals
`FeedForward.shard`; not naturally sharded einsums are refused.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, "examples")
from einshard_mlp import forward, init_params  # noqa: E402

from llama_tp.model_args import ModelArgs  # noqa: E402
from llama_tp.models.feed_forward import FeedForward  # noqa: E402
from llama_tp.parallel.einshard import (  # noqa: E402
    EinshardError,
    einshard,
    layout,
    shard,
    sharded_einsum,
)

EXPRS = [
    ((8, 16), "a b -> a* b"),
    ((8, 16), "a b -> a b*"),
    ((8, 16), "a b -> * a b"),
    ((4, 16, 8), "a b c -> a2* b c*"),
    ((8, 16), "a b -> 2 a b*"),
    ((8, 16), "a b -> b* a2"),
    ((2, 3, 8), "... c -> * ... c2"),
    ((16, 8), "a b -> a* b*"),
]


def checks(g: mx.distributed.Group) -> dict[str, object]:
    """Every check's result (the same on every rank)."""
    n = g.size()
    out: dict[str, object] = {"n": n}
    x = mx.arange(4 * 16 * 8, dtype=mx.float32)
    parts_ok, replicas_ok, tried = True, True, 0
    for shape, expr in EXPRS:
        try:
            lay = layout(expr, shape, n)
        except EinshardError:
            continue  # not valid on this many ranks (the same on every rank)
        tried += 1
        a = x[: int(mx.prod(mx.array(shape)).item())].reshape(shape)
        s = shard(a, expr, g)
        parts_ok &= bool(mx.array_equal(s.full(), a).item())
        parts_ok &= s.local.shape == lay.local_shape()
        every = mx.distributed.all_gather(einshard(a, expr, g)[None], group=g)
        for r in range(n):
            for q in range(r):
                if lay.index(q) == lay.index(r):
                    replicas_ok &= bool(mx.array_equal(every[q], every[r]).item())
    out |= {"layouts": tried, "parts": parts_ok, "replicas": replicas_ok}

    W1, W2 = init_params()
    X = mx.random.normal((8, 128), key=mx.random.key(0))
    if 256 % n == 0:  # the seed's MLP: 256 columns of W1 and rows of W2 split N ways
        Xr = shard(X, "... -> * ...", g)
        Z = forward(shard(W1, "x y -> x y*", g), shard(W2, "y z -> y* z", g), Xr)
        ref = mx.maximum(X @ W1, 0) @ W2
        out["mlp"] = float(mx.max(mx.abs(Z.local - ref)).item())

    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, hidden_dim=32 * n, vocab_size=8)
    mx.random.seed(3)
    ff = FeedForward(args)
    sharded = FeedForward(args)
    sharded.update(ff.parameters())
    sharded.shard(g)
    h = mx.random.normal((1, 5, 64), key=mx.random.key(1))
    H = shard(h, "... -> * ...", g)
    a = sharded_einsum("bld,hd->blh", H, shard(ff.w1.weight, "h d -> h* d", g))
    c = sharded_einsum("bld,hd->blh", H, shard(ff.w3.weight, "h d -> h* d", g))
    y = sharded_einsum(
        "blh,dh->bld",
        a.combine(c, lambda u, v: nn.silu(u) * v),
        shard(ff.w2.weight, "d h -> d h*", g),
    )
    out["ffn_vs_shard"] = float(mx.max(mx.abs(y.local - sharded(h))).item())
    out["ffn_vs_whole"] = float(mx.max(mx.abs(y.local - ff(h))).item())

    refused = []
    Xb = shard(X, "b x -> b* x", g)  # data parallel on b ...
    try:
        sharded_einsum("bx,xy->by", Xb, shard(W1, "x y -> x* y", g))  # ... and x reduced
    except EinshardError as e:
        refused.append(str(e))
    if n % 4 == 0:
        try:  # x split 4 ways in one operand and 2 ways in the other
            sharded_einsum("bx,xy->by", shard(X, "b x -> b x*", g), shard(W1, "x y -> 2 x* y", g))
        except EinshardError as e:
            refused.append(str(e))
    out["refused"] = refused
    return out


def main() -> int:
    g = mx.distributed.init()
    out = checks(g)
    if g.rank() == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
