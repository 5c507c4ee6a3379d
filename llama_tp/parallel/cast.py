"""One dtype for a loaded (and sharded) model: dequantize its quantized layers, cast the rest.

Why: MLX's CPU quantized matrix products are compute-bound, so on a Linux CPU a
float32 model with OpenBLAS preloaded prefills ~20x and decodes ~2x faster than
the same model as 4-bit (docs/benchmarks.md, "The CPU path"). On Metal the
quantized model is the fast one (decode is memory-bound): keep the default there.

Each rank dequantizes only the slice it holds (layers are already sharded), one
layer at a time, so the peak is the quantized model plus one layer's float copy.
Every layer kind llama_tp builds has a float twin with the same forward pass and
collectives: mlx's `nn.QuantizedLinear`/`nn.QuantizedEmbedding`, its quantized
sharded linears, llama_tp's quantized range layers, the vocabulary-parallel
embedding and mlx-lm's stacked experts (`QuantizedSwitchLinear`, split in place).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as dist
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from .layers import (
    QuantizedRangeAllToShardedLinear,
    QuantizedRangeShardedToAllLinear,
    RangeAllToShardedLinear,
    RangeShardedToAllLinear,
)
from .module_swap import swap_modules
from .vocab import VocabParallelEmbedding

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _dequantized(m: nn.Module, dtype: mx.Dtype) -> mx.array:
    w = mx.dequantize(
        m["weight"],
        m["scales"],
        m.get("biases"),  # none in MXFP4 (gpt-oss's experts)
        group_size=m.group_size,
        bits=m.bits,
        mode=getattr(m, "mode", "affine"),
    )
    return w.astype(dtype)  # (out, in) of this rank's slice


def _float_twin(m: nn.Module, dtype: mx.Dtype) -> nn.Module | None:
    """The float layer computing what quantized `m` computes, or None if `m` is not one."""
    bias = m["bias"].astype(dtype) if "bias" in m else None
    if isinstance(m, QuantizedRangeAllToShardedLinear | QuantizedRangeShardedToAllLinear):
        cls = (
            RangeAllToShardedLinear
            if isinstance(m, QuantizedRangeAllToShardedLinear)
            else RangeShardedToAllLinear
        )
        params = {"weight": _dequantized(m, dtype)}
        if bias is not None:
            params["bias"] = bias
        return cls(params, m.input_dims, m.output_dims, m.start, m.stop, m.group)
    if isinstance(m, dist.QuantizedAllToShardedLinear | dist.QuantizedShardedToAllLinear):
        w = _dequantized(m, dtype)
        rows = isinstance(m, dist.QuantizedAllToShardedLinear)
        n = m.group.size()
        in_dims = w.shape[1] if rows else w.shape[1] * n
        out_dims = w.shape[0] * n if rows else w.shape[0]
        cls = dist.AllToShardedLinear if rows else dist.ShardedToAllLinear
        twin = cls(in_dims, out_dims, bias=bias is not None, group=m.group)
    elif isinstance(m, QuantizedSwitchLinear):  # stacked experts (E, out, in), maybe sliced
        w = _dequantized(m, dtype)
        twin = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias=bias is not None)
    elif isinstance(m, nn.QuantizedLinear):
        w = _dequantized(m, dtype)
        twin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None)
    elif isinstance(m, nn.QuantizedEmbedding):
        w = _dequantized(m, dtype)
        twin = nn.Embedding(*w.shape)
    else:
        return None
    twin.weight = w  # replaces the random initialization before it is ever evaluated
    if bias is not None:
        twin.bias = bias
    return twin


def _cast_vocab(m: VocabParallelEmbedding, dtype: mx.Dtype) -> None:
    if m.quantized:
        m.weight = _dequantized(m, dtype)
        del m["scales"], m["biases"]
        m.quantized = False
    else:
        m.weight = m.weight.astype(dtype)


def cast_model(model: nn.Module, dtype: str | mx.Dtype) -> None:
    """Make every parameter of `model` `dtype` (quantized layers are dequantized), in place.

    Evaluates layer by layer, so only one layer's float copy is ever extra.
    """
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype

    def to_float(path: str, m: nn.Module) -> nn.Module | None:
        if isinstance(m, VocabParallelEmbedding):  # cast in place
            _cast_vocab(m, dtype)
            mx.eval(m.parameters())
            return None
        twin = _float_twin(m, dtype)
        if twin is not None:
            mx.eval(twin.parameters())  # in its place next: the quantized arrays go
        return twin

    swap_modules(model, to_float)
    floats = [
        (k, v.astype(dtype))
        for k, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating) and v.dtype != dtype
    ]
    if floats:
        model.load_weights(floats, strict=False)
    mx.eval(model.parameters())


def float32_experts(model: nn.Module) -> int:
    """Make every plain (not quantized) stacked-experts layer float32, in place: MLX's CPU
    backend runs `gather_mm` on float32 only (quantized experts, `gather_qmm`, take any
    dtype). Returns the number of layers cast; call it on the CPU only."""
    cast = 0
    for _, m in model.named_modules():
        if isinstance(m, SwitchLinear) and m.weight.dtype != mx.float32:
            m.weight = m.weight.astype(mx.float32)
            if "bias" in m:
                m.bias = m.bias.astype(mx.float32)
            mx.eval(m.parameters())
            cast += 1
    return cast
