"""Float16 and bfloat16 products on several of MLX's CPU streams at once.

MLX 0.32's CPU product for float16 and bfloat16 operands (`simd_gemm`) runs on the one
thread of the stream it is on, and on x86 its vectors are a lane wide: a 0.5B float16
model decodes at 0.5-0.7 tokens/s on this 2-core machine in mlx-lm and in llama_tp alike,
the products taking 99% of the step. `float_matmul(x, w)` cuts the weight's output rows
into one part per kernel thread (`status().threads`, the native kernels' count: the
machine's cores over the ranks on it) and computes each part with MLX's own product on a
CPU stream of its own, so the parts run side by side, then joins them. Each output
element is the same kernel over the same row and vector, so the result is bit-equal to
the single product (`x @ w.T`). `python bench/float_products.py` times both side by side
(docs/cpu-kernels.md, "Float products").

Only while the native path is on (LLAMA_TP_KERNELS=mlx keeps MLX's products as MLX runs
them), on the CPU, for float16 / bfloat16 weights: float32 goes to BLAS, which has
threads of its own.
"""

from __future__ import annotations

import mlx.core as mx

from . import native

SPLIT_DTYPES = (mx.float16, mx.bfloat16)
MIN_ROWS = 64  # a part smaller than this is not worth its own dispatch
_streams: list[mx.Stream] = []


def parts_for(w: mx.array) -> int:
    """How many parts `w` (out, in)'s product is cut into here (1: not cut)."""
    if w.dtype not in SPLIT_DTYPES or mx.default_device() != mx.cpu:
        return 1
    st = native.status()
    if not st.native:
        return 1
    return max(1, min(st.threads, w.shape[0] // MIN_ROWS))


def _stream(i: int) -> mx.Stream:
    while len(_streams) <= i:
        _streams.append(mx.new_stream(mx.cpu))  # each with a thread of its own
    return _streams[i]


def float_matmul(x: mx.array, w: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (..., in) @ w.T (+ bias, as `mx.addmm` adds it) for w (out, in): (..., out), its
    rows' parts side by side on CPU streams where `parts_for(w)` > 1 (the last part on
    the default stream, which then joins them), else the one product."""
    parts = parts_for(w)
    if parts == 1:
        return x @ w.T if bias is None else mx.addmm(bias, x, w.T)
    n = w.shape[0]
    step = -(-n // parts)
    outs = []
    for i, a in enumerate(range(0, n, step)):
        s = _stream(i) if a + step < n else None  # None: the default stream
        part = w[a : a + step].T
        if bias is None:
            outs.append(mx.matmul(x, part, stream=s))
        else:
            outs.append(mx.addmm(bias[a : a + step], x, part, stream=s))
    return mx.concatenate(outs, axis=-1)
