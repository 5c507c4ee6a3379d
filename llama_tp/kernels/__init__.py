"""Native CPU kernels for quantized matrix products: an MLX extension, and its fallback.

`quantized_matmul` is `mx.quantized_matmul` for the layers: on MLX's CPU stream, with the
extension loaded (`native.status()`), MLX affine 4- and 8-bit weights (group size 32,
64, 128) go to the native kernels; anything else (another device, mode or width) to
MLX's. `gguf_matmul` / `gguf_dequantize` compute GGUF blocks as the file stores them
(`GGUF_TYPES`): layers holding those exist only while the native path is on (the
loader converts GGUF to MLX's layout otherwise). The C++ is in `src/` (qmv.h tells the
method); `python -m llama_tp.kernels` builds, checks and reports.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention

from .blocks import GGUF_TYPES
from .native import Status, default_threads, ext, fallback_warning, off, set_threads, status

__all__ = [
    "GGUF_TYPES",
    "Status",
    "default_threads",
    "fallback_warning",
    "gguf_dequantize",
    "gguf_matmul",
    "off",
    "on_cpu",
    "quantized_matmul",
    "scaled_dot_product_attention",
    "set_threads",
    "status",
]

AFFINE_FORMATS = {4: 1004, 8: 1008}  # MLX affine bits -> the kernels' format id
_AFFINE = AFFINE_FORMATS


def on_cpu() -> bool:
    """MLX's default device is the CPU (where the native kernels run)."""
    return mx.default_device() == mx.cpu


_on_cpu = on_cpu


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
) -> mx.array:
    """`mx.quantized_matmul`, through the native kernels where they apply:
    x (..., in) @ W^T -> (..., out) for W (out, in * bits / 32) uint32."""
    e = ext()
    if (
        e is not None
        and transpose
        and mode == "affine"
        and biases is not None
        and bits in _AFFINE
        and group_size in (32, 64, 128)
        and _on_cpu()
    ):
        return e.qmatmul(x, w, scales, biases, format=_AFFINE[bits], group_size=group_size)
    return mx.quantized_matmul(
        x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, mode=mode
    )


# Query positions up to which attention takes the native kernel (decode and small batched
# steps); a prefill's long blocks go to MLX's, whose matrix products use BLAS.
ATTENTION_MAX_QUERIES = 16


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache,
    scale: float,
    mask,
    sinks: mx.array | None = None,
    merged: bool = False,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, through the native kernel (one primitive
    instead of MLX's composed one) for a few query positions on the CPU with no mask or a
    causal one: queries (B, Hq, L, D), keys and values (B, Hkv, S, D) -> (B, Hq, L, D), or
    with `merged` (B, L, Hq * D), the heads side by side as the output projection takes
    them (the native kernel writes them so: no transpose and reshape).

    A cache with `key_range` ((B, 2) int32: the compiled step's caches, engine/step.py)
    hands over its whole buffer: row b attends to keys [start, stop) of it only."""
    from .layers import fusing

    e = ext()
    ranges = getattr(cache, "key_range", None)
    fuse = merged and fusing()  # written merged by the kernel
    if ranges is not None:
        if (
            e is not None
            and sinks is None
            and queries.shape[2] <= ATTENTION_MAX_QUERIES
            and _on_cpu()
        ):
            causal = mask is not None
            out = e.attention(
                queries, keys, values, scale=scale, causal=causal, ranges=ranges, merged=fuse
            )
            return merge_heads(out) if merged and not fuse else out
        mask = _range_mask(ranges, queries.shape[2], keys.shape[2], mask is not None)
        out = mlx_lm_attention(queries, keys, values, None, scale=scale, mask=mask, sinks=sinks)
        return merge_heads(out) if merged else out
    if (
        e is not None
        and (mask is None or (isinstance(mask, str) and mask == "causal"))
        and sinks is None
        and not hasattr(cache, "bits")  # a quantized KV cache
        and isinstance(keys, mx.array)
        and queries.ndim == 4
        and queries.shape[2] <= ATTENTION_MAX_QUERIES
        and _on_cpu()
    ):
        causal = mask is not None
        out = e.attention(queries, keys, values, scale=scale, causal=causal, merged=fuse)
        return merge_heads(out) if merged and not fuse else out
    out = mlx_lm_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    return merge_heads(out) if merged else out


def merge_heads(x: mx.array) -> mx.array:
    """(B, H, L, D) -> (B, L, H * D)."""
    B, _, L, _ = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, L, -1)


def _range_mask(ranges: mx.array, L: int, S: int, causal: bool) -> mx.array:
    """The boolean mask (B, 1, L, S) of keys [start, stop) of each row (`ranges` (B, 2)),
    causal aligned to stop when `causal`: what the native kernel's ranges mean."""
    pos = mx.arange(S)[None, None, None]
    start, stop = ranges[:, 0, None, None, None], ranges[:, 1, None, None, None]
    end = stop - L + 1 + mx.arange(L)[None, None, :, None] if causal else stop
    return (pos >= start) & (pos < end)


def gguf_matmul(x: mx.array, w: mx.array, type_name: str, lead: int = 0) -> mx.array:
    """x (..., n) @ W^T -> (..., rows) for GGUF blocks w (rows, blocks * bytes) uint8, x's
    values at columns [lead, lead + n) of the blocks (a column slice of the tensor)."""
    code = GGUF_TYPES[type_name][0]
    return _native("gguf_matmul").qmatmul(x, w, format=code, lead=lead, stream=mx.cpu)


def gguf_dequantize(
    w: mx.array, type_name: str, lead: int, n: int, dtype: mx.Dtype = mx.float16
) -> mx.array:
    """Rows of GGUF blocks (..., blocks * bytes) uint8 -> their values [lead, lead + n)."""
    code = GGUF_TYPES[type_name][0]
    e = _native("gguf_dequantize")
    return e.dequantize(w, format=code, lead=lead, n=n, dtype=dtype, stream=mx.cpu)


def _native(what: str):
    from . import native

    if native._ext is None:  # GGUF blocks as stored exist only where the module loaded
        raise RuntimeError(f"{what} needs the native kernels: {status().reason}")
    return native._ext
