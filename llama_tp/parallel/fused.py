"""q/k/v as one product and gate/up as one product, per rank, when they share a format.

After loading (and sharding), `fuse_products(model)` concatenates the weights of each
attention's `wq`, `wk`, `wv` and each feed-forward's `w1`, `w3` along their output rows
into one array per parameter (the GGUF blocks, MLX's packed words, scales and biases, or
the float weights, as held) and gives every module back its rows as a view of it: the
modules stay what `shard` made them (and what the checkpoint names, saves and counts),
the memory is held once, and `fused(module, names, x)` computes their outputs with one
product. The product is the modules' own (`kernels.quantized_matmul`,
`kernels.gguf_matmul`, a matmul): each output row is computed as the separate product
computes it (the native kernels quantize the activations once per product, the same for
any row count), so only float weights on BLAS may round differently.

Fused only when every module computes y = x W^T (+ b) with the same format: the plain and
all-to-sharded linears (mlx's, llama_tp's range and block layers, the native twins),
the same dtype / bits / group size / GGUF type, biases on all or none. A module whose
weights were replaced after fusing (its array is no longer the view) makes `fused`
return None: the caller computes the products one by one.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as dist

from ..kernels import AFFINE_FORMATS, GGUF_TYPES, gguf_matmul, on_cpu, quantized_matmul
from ..kernels import ext as native_ext
from ..kernels import layers as native_layers
from ..kernels.float_products import float_matmul
from . import layers as range_layers

QKV = ("wq", "wk", "wv")
GATE_UP = ("w1", "w3")

_LINEAR = (
    nn.Linear,
    nn.QuantizedLinear,
    dist.AllToShardedLinear,
    dist.QuantizedAllToShardedLinear,
    native_layers.GGUFLinear,
    range_layers.RangeAllToShardedLinear,
    range_layers.QuantizedRangeAllToShardedLinear,
    range_layers.BlockRangeAllToShardedLinear,
)
_NAMES = ("weight", "scales", "biases", "bias")


class Fused:
    """The concatenated parameters of some linears and how to multiply by them."""

    def __init__(self, kind: tuple, params: dict[str, mx.array], rows: list[int]):
        self.kind, self.params, self.rows = kind, params, rows
        self.views: list[dict[str, mx.array]] = []

    def __call__(self, x: mx.array) -> list[mx.array]:
        """Each module's output: x (..., in) -> [(..., rows_i)]."""
        y = self.product(x)
        out, a = [], 0
        for n in self.rows[:-1]:
            out.append(y[..., a : a + n])
            a += n
        out.append(y[..., a:])
        return out

    def native_args(self) -> dict | None:
        """The native product's arguments (the weights, format, group size, lead) when
        this product is one of its formats without a bias, else None: then a product
        can end in its next operation (SwiGLU, the heads' split) as one primitive."""
        p, kind = self.params, self.kind
        if "bias" in p or native_ext() is None or not on_cpu():
            return None
        if kind[0] == "gguf":
            return dict(w=p["weight"], format=GGUF_TYPES[kind[1]][0], lead=kind[2])
        affine = kind[0] == "affine" and kind[3] == "affine" and "biases" in p
        if affine and kind[1] in AFFINE_FORMATS and kind[2] in (32, 64, 128):
            kw = dict(w=p["weight"], scales=p["scales"], biases=p["biases"])
            return kw | dict(format=AFFINE_FORMATS[kind[1]], group_size=kind[2])
        return None

    def product(self, x: mx.array) -> mx.array:
        """The one product: x (..., in) -> (..., sum of rows), the modules' outputs side
        by side."""
        p, kind = self.params, self.kind
        if kind[0] == "gguf":
            y = gguf_matmul(x, p["weight"], kind[1], kind[2])
        elif kind[0] == "affine":
            y = quantized_matmul(
                x, p["weight"], p["scales"], p["biases"], transpose=True,
                group_size=kind[2], bits=kind[1], mode=kind[3],
            )  # fmt: skip
        else:  # as the separate linears compute it (mx.addmm's bias), streams side by side
            return float_matmul(x, p["weight"], p.get("bias"))
        if "bias" in p:
            y = y + p["bias"]
        return y


def _kind(m: nn.Module) -> tuple | None:
    """What product `m` computes (its format), or None if it is not a plain linear."""
    if not isinstance(m, _LINEAR) or "weight" not in m:
        return None
    bias = "bias" in m
    if isinstance(m, (native_layers.GGUFLinear, range_layers.BlockRangeAllToShardedLinear)):
        return ("gguf", m.type_name, m.lead, m.input_dims, bias)
    if "scales" in m:
        mode = getattr(m, "mode", "affine")
        biases = "biases" in m
        return ("affine", m.bits, m.group_size, mode, m["scales"].dtype, biases, bias)
    return ("float", m["weight"].dtype, m["weight"].shape[1], bias)


def _fuse(parent: nn.Module, names: tuple[str, ...]) -> Fused | None:
    mods = [parent.get(n) for n in names]
    if any(not isinstance(m, nn.Module) for m in mods):
        return None
    kinds = [_kind(m) for m in mods]
    if kinds[0] is None or any(k != kinds[0] for k in kinds):
        return None
    held = [k for k in _NAMES if k in mods[0]]
    rows = [m["weight"].shape[0] for m in mods]
    params = {k: mx.concatenate([m[k] for m in mods], axis=0) for k in held}
    mx.eval(params)
    fused = Fused(kinds[0], params, rows)
    a = 0
    for m, n in zip(mods, rows, strict=True):
        view = {k: params[k][a : a + n] for k in held}  # a view: no copy once evaluated
        mx.eval(view)
        for k, v in view.items():
            m[k] = v
        fused.views.append(view)
        a += n
    return fused


fusing = native_layers.fusing
ENV = native_layers.FUSED_ENV  # "0": keep the products apart (to measure what fusing brings)


def fuse_products(model: nn.Module) -> int:
    """Fuse every attention's q/k/v and feed-forward's gate/up products of `model` (in
    place, unless $LLAMA_TP_FUSED is 0); the number of fused products."""
    if os.environ.get(ENV, "1") == "0":
        return 0
    count = 0
    for _, module in model.named_modules():
        for names in (QKV, GATE_UP):
            if all(n in module for n in names) and getattr(module, "_fused", {}).get(names) is None:
                f = _fuse(module, names)
                if f is not None:
                    d = dict(getattr(module, "_fused", {}))
                    d[names] = f
                    object.__setattr__(module, "_fused", d)  # not a parameter or child
                    count += 1
    return count


def _live(module: nn.Module, names: tuple[str, ...]) -> Fused | None:
    """`module`'s fused product of `names`, if any and its modules still hold its views."""
    f = getattr(module, "_fused", {}).get(names)
    if f is None:
        return None
    for n, view in zip(names, f.views, strict=True):
        m = module[n]
        if any(m.get(k) is not v for k, v in view.items()):
            return None  # the weights changed since: the separate products are right
    return f


def fused(module: nn.Module, names: tuple[str, ...], x: mx.array) -> list[mx.array] | None:
    """The outputs of `module`'s linears `names` for x, as one product, or None when they
    are not fused (then call them one by one)."""
    f = _live(module, names)
    return None if f is None else f(x)


def fused_heads(
    module: nn.Module, x: mx.array, head_dim: int
) -> tuple[mx.array, mx.array, mx.array] | None:
    """An attention's q, k, v (B, heads, L, head_dim) for x (B, L, dim) from its fused
    q/k/v product, split into heads (one native op on the CPU; else one reshape, one
    transpose and three slices), or None when not fused."""
    f = _live(module, QKV)
    if f is None:
        return None
    y = f.product(x)
    B, L, _ = y.shape
    nq, nk, nv = (r // head_dim for r in f.rows)
    e = native_ext()
    if e is not None and on_cpu():  # one native op
        q, k, v = e.split_heads(y, nq, nk, nv, head_dim)
        return q, k, v
    t = y.reshape(B, L, -1, head_dim).transpose(0, 2, 1, 3)
    return t[:, :nq], t[:, nq : nq + nk], t[:, nq + nk :]


_PLAIN_ROPE = (nn.RoPE, native_layers.RoPE)
_INTS = (mx.int32, mx.int64, mx.uint32)


def fused_heads_rotated(
    module: nn.Module, x: mx.array, head_dim: int, rope: nn.Module, offset: Any
) -> tuple[mx.array, mx.array, mx.array] | None:
    """`fused_heads` with q and k rotated by `rope` from position `offset` (an int or an
    int32 array: one, or one per row), in the one native operation that splits the heads
    (the native RoPE's code: the same values as rotating after the split), or None when
    not fused, not native, or `rope` is not plain RoPE (scaled variants)."""
    e = native_ext()
    if e is None or not on_cpu() or type(rope) not in _PLAIN_ROPE:
        return None
    if not isinstance(offset, int) and not (isinstance(offset, mx.array) and offset.dtype in _INTS):
        return None
    f = _live(module, QKV)
    if f is None:
        return None
    nq, nk, nv = (r // head_dim for r in f.rows)
    kw = dict(rope_dims=rope.dims, traditional=rope.traditional, base=float(rope.base))
    kw["scale"] = float(rope.scale)
    if isinstance(offset, int):
        kw["offset"] = offset
    else:
        kw["offsets"] = offset
    args = f.native_args()
    if args is not None and fusing():  # the product, split and rotated: one operation
        w = args.pop("w")
        q, k, v = e.qmatmul_heads(x, w, a=nq, b=nk, c=nv, d=head_dim, **args, **kw)
        return q, k, v
    q, k, v = e.split_heads(f.product(x), nq, nk, nv, head_dim, **kw)
    return q, k, v


def fused_glu(module: nn.Module, x: mx.array) -> mx.array | None:
    """A feed-forward's silu(w1 x) * (w3 x) from its fused gate/up product (one native
    operation on the CPU; else MLX's silu, as the unfused path computes it), or None when
    not fused."""
    f = _live(module, GATE_UP)
    if f is None:
        return None
    e, n = native_ext(), f.rows[0]
    args = f.native_args() if f.rows[1] == n and fusing() else None
    if args is not None:  # the product and SwiGLU: one operation
        return e.qmatmul_swiglu(x, args.pop("w"), **args)
    y = f.product(x)
    if e is not None and on_cpu() and f.rows[1] == n and fusing():
        return e.swiglu(y)
    return nn.silu(y[..., :n]) * y[..., n:]


def fused_count(model: nn.Module) -> dict[str, Any]:
    """How many q/k/v and gate/up products of `model` are fused (for --verbose)."""
    out = {"qkv": 0, "gate_up": 0}
    for _, module in model.named_modules():
        d = getattr(module, "_fused", {})
        out["qkv"] += QKV in d
        out["gate_up"] += GATE_UP in d
    return out
