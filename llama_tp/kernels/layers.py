"""Layers whose products go through the native kernels (no ranks here: `parallel/`
shards them).

- `GGUFLinear`, `GGUFEmbedding`: GGUF blocks as the file stores them, uint8
  (rows, blocks * bytes): a K-quant file is held at its size and computes its exact
  weights. The loader builds them only while the native path is on.
- `use_native(model)`: mlx's affine quantized layers (`nn.QuantizedLinear` and its
  sharded twins in `mlx.nn.layers.distributed`) turned, in place, into subclasses whose
  forward calls `kernels.quantized_matmul` (the project's own range and vocabulary
  layers call it directly), and `nn.RoPE` and `nn.RMSNorm` into ones that are a single
  native primitive on the CPU; float linears and embeddings into ones whose float16 /
  bfloat16 products run on several CPU streams (`float_products`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as dist

from . import AFFINE_FORMATS, _on_cpu, ext, fusing, gguf_dequantize, gguf_matmul, quantized_matmul
from .blocks import GGUF_TYPES, row_bytes
from .float_products import float_matmul


class GGUFLinear(nn.Module):
    """y = x W^T (+ bias) for W in GGUF blocks: weight (output_dims, blocks * bytes) uint8.

    `lead` values of the first block precede the layer's `input_dims` columns (0 unless
    the layer is a column slice that starts inside a block). Frozen, like MLX's
    quantized layers.
    """

    def __init__(
        self, input_dims: int, output_dims: int, type_name: str, bias: bool = False, lead: int = 0
    ):
        super().__init__()
        self.input_dims, self.output_dims = input_dims, output_dims
        self.type_name, self.lead = type_name, lead
        _, per, _ = GGUF_TYPES[type_name]
        width = row_bytes(-(-(lead + input_dims) // per) * per, type_name)
        self.weight = mx.zeros((output_dims, width), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((output_dims,))
        self.freeze()

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
            f"type={self.type_name}, bias={'bias' in self}"
        )

    def __call__(self, x: mx.array) -> mx.array:
        y = gguf_matmul(x, self["weight"], self.type_name, self.lead)
        return y + self["bias"] if "bias" in self else y


class GGUFEmbedding(nn.Module):
    """An embedding table in GGUF blocks: weight (num_embeddings, blocks * bytes) uint8.
    Rows come out dequantized as `dtype` (float16, as the converted tables give); as a
    tied head (`as_linear`) it is a `GGUFLinear` product."""

    def __init__(self, num_embeddings: int, dims: int, type_name: str, dtype=mx.float16):
        super().__init__()
        self.num_embeddings, self.dims, self.type_name = num_embeddings, dims, type_name
        self.dtype = dtype
        self.weight = mx.zeros((num_embeddings, row_bytes(dims, type_name)), dtype=mx.uint8)
        self.freeze()

    def _extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dims}, type={self.type_name}"

    def __call__(self, ids: mx.array) -> mx.array:
        return gguf_dequantize(self["weight"][ids], self.type_name, 0, self.dims, self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return gguf_matmul(x, self["weight"], self.type_name)


def _affine(m: nn.Module, x: mx.array) -> mx.array:
    return quantized_matmul(
        x,
        m["weight"],
        m["scales"],
        m.get("biases"),
        transpose=True,
        group_size=m.group_size,
        bits=m.bits,
        mode=m.mode,
    )


class QuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` with its product through `kernels.quantized_matmul`."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _affine(self, x)
        return y + self["bias"] if "bias" in self else y


class QuantizedAllToShardedLinear(dist.QuantizedAllToShardedLinear):
    """mlx's all-to-sharded quantized linear, product through `kernels.quantized_matmul`."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _affine(self, dist.sum_gradients(self.group)(x))
        return y + self["bias"] if "bias" in self else y


class QuantizedShardedToAllLinear(dist.QuantizedShardedToAllLinear):
    """mlx's sharded-to-all quantized linear, product through `kernels.quantized_matmul`."""

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(_affine(self, x), group=self.group)
        return y + self["bias"] if "bias" in self else y


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose tied-head product goes through the native kernels."""

    def as_linear(self, x: mx.array) -> mx.array:
        return _affine(self, x)


class Linear(nn.Linear):
    """`nn.Linear` whose float16 / bfloat16 product runs on the CPU streams side by side
    (`float_products`; bit-equal)."""

    def __call__(self, x: mx.array) -> mx.array:
        return float_matmul(x, self["weight"], self.get("bias"))


class AllToShardedLinear(dist.AllToShardedLinear):
    """mlx's all-to-sharded linear, its float product as `Linear`'s."""

    def __call__(self, x: mx.array) -> mx.array:
        return float_matmul(dist.sum_gradients(self.group)(x), self["weight"], self.get("bias"))


class ShardedToAllLinear(dist.ShardedToAllLinear):
    """mlx's sharded-to-all linear, its float product as `Linear`'s (the bias added after
    the all-reduce, as mlx's)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(float_matmul(x, self["weight"]), group=self.group)
        return y + self["bias"] if "bias" in self else y


class Embedding(nn.Embedding):
    """`nn.Embedding` whose tied-head product is `Linear`'s."""

    def as_linear(self, x: mx.array) -> mx.array:
        return float_matmul(x, self["weight"])


class RoPE(nn.RoPE):
    """`nn.RoPE` as one native primitive on the CPU (MLX composes it of a dozen there).
    The offset is an int, or an int32 array (one, or one per row): the compiled decode
    step passes the position as an array, so that its graph is the same at every token."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        e = ext()
        if e is not None and x.ndim == 4 and _on_cpu():
            kw = dict(dims=self.dims, traditional=self.traditional, base=float(self.base))
            kw["scale"] = float(self.scale)
            if isinstance(offset, int):
                return e.rope(x, offset=offset, **kw)
            if isinstance(offset, mx.array) and offset.dtype in _INTS:
                return e.rope(x, offsets=offset, **kw)
        return super().__call__(x, offset)


_INTS = (mx.int32, mx.int64, mx.uint32)


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` as one native primitive on the CPU (MLX composes it of about eight)."""

    def __call__(self, x: mx.array) -> mx.array:
        e = ext()
        if e is not None and _on_cpu():
            return e.rms_norm(x, self["weight"], eps=self.eps)
        return super().__call__(x)


def add_norm(x: mx.array, r: mx.array, norm: nn.Module) -> tuple[mx.array, mx.array]:
    """(x + r, norm(x + r)) for x, r (..., dim): one native operation when `norm` is a
    plain RMSNorm on the CPU (the sum in x's type, as MLX's add; the norm as the native
    RMSNorm's), else an add and the norm."""
    e = ext()
    if (
        e is not None
        and fusing()
        and type(norm) in (nn.RMSNorm, RMSNorm)
        and r.dtype == x.dtype
        and r.shape == x.shape
        and _on_cpu()
    ):
        h, n = e.add_rms_norm(x, r, norm["weight"], eps=norm.eps)
        return h, n
    h = x + r
    return h, norm(h)


def _product_args(linear: nn.Module) -> dict | None:
    """The native product's arguments of a whole (unsharded) quantized linear without a
    bias, or None: a sharded one's product is followed by its all-reduce."""
    if "bias" in linear:
        return None
    if type(linear) is GGUFLinear:
        return dict(w=linear["weight"], format=GGUF_TYPES[linear.type_name][0], lead=linear.lead)
    if (
        type(linear) is QuantizedLinear
        and linear.mode == "affine"
        and linear.bits in AFFINE_FORMATS
        and linear.group_size in (32, 64, 128)
        and "biases" in linear
    ):
        kw = dict(w=linear["weight"], scales=linear["scales"], biases=linear["biases"])
        return kw | dict(format=AFFINE_FORMATS[linear.bits], group_size=linear.group_size)
    return None


def product_add_norm(
    linear: nn.Module, y: mx.array, x: mx.array, norm: nn.Module
) -> tuple[mx.array, mx.array]:
    """`add_norm(x, linear(y), norm)` for y (..., in), x (..., dim): the product, the
    residual sum and the norm in one native operation (the same values) when `linear`
    is a whole native quantized linear without a bias and `norm` a plain RMSNorm."""
    e = ext()
    if e is not None and fusing() and type(norm) in (nn.RMSNorm, RMSNorm) and _on_cpu():
        args = _product_args(linear)
        same = y.dtype == x.dtype and x.shape[:-1] == y.shape[:-1]
        if args is not None and same and x.shape[-1] == linear["weight"].shape[0]:
            w = args.pop("w")
            h, n = e.qmatmul_add_norm(y, w, **args, r=x, weight=norm["weight"], eps=norm.eps)
            return h, n
    return add_norm(x, linear(y), norm)


# A block's output not yet added to the residual stream: an array, or (linear, y) for
# linear(y), a product not yet computed (`TransformerBlock.parts`)
Pending = mx.array | tuple[nn.Module, mx.array]


def settle(p: Pending) -> mx.array:
    """The array a `Pending` stands for."""
    return p[0](p[1]) if isinstance(p, tuple) else p


def settle_add_norm(x: mx.array, p: Pending, norm: nn.Module) -> tuple[mx.array, mx.array]:
    """(x + p, norm(x + p)) for a `Pending` p: `product_add_norm` or `add_norm`."""
    if isinstance(p, tuple):
        return product_add_norm(p[0], p[1], x, norm)
    return add_norm(x, p, norm)


_NATIVE = {
    nn.Linear: Linear,
    nn.Embedding: Embedding,
    dist.AllToShardedLinear: AllToShardedLinear,
    dist.ShardedToAllLinear: ShardedToAllLinear,
    nn.RoPE: RoPE,
    nn.RMSNorm: RMSNorm,
    nn.QuantizedLinear: QuantizedLinear,
    nn.QuantizedEmbedding: QuantizedEmbedding,
    dist.QuantizedAllToShardedLinear: QuantizedAllToShardedLinear,
    dist.QuantizedShardedToAllLinear: QuantizedShardedToAllLinear,
}


def use_native(model: nn.Module) -> int:
    """Turn, in place, every mlx affine quantized linear of `model` (and the others
    `_NATIVE` names) into its native subclass, whose forward calls
    `kernels.quantized_matmul`: the same object, arrays and settings under the subclass
    (no module is swapped, so none of its parents is touched); the number turned."""
    count = 0
    for _, m in model.named_modules():
        cls = _NATIVE.get(type(m))
        if cls is not None:
            object.__setattr__(m, "__class__", cls)
            count += 1
    return count
