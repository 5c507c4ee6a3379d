"""The core attention kind: grouped-query attention with RoPE over a KV cache.

Names follow Meta's reference implementation (and the MLX Llama example):
`layers.{i}.attention.{wq,wk,wv,wo}`; the readers map their own names onto these
(`hf_names`, `gguf_names`). Its split table is the core one (`splits.llama_attention`:
whole heads), and `shard(group, part)` (`ShardedByTable`) splits it by that table: wq,
wk and wv by their heads' rows, wo by the same heads' columns, one all-reduce.

Long causal prefills may take their queries in blocks (`query_chunk`): MLX's CPU
attention is not fused, and the blocks bound the scores it holds. Each block is
evaluated as it is built, except inside `lazy_query_blocks()` (the benchmarks build a
forward pass's graph without running it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from ..kernels import merge_heads, scaled_dot_product_attention  # mlx-lm's, native on CPU
from ..model_args import ModelArgs
from ..parallel.fused import fused_heads, fused_heads_rotated
from ..parallel.kind_shard import ShardedByTable
from ..parallel.splits import CacheSpec, SplitTable, llama_attention

# Chunked attention evaluates each query block before building the next (see
# `Attention._attend`); off inside `lazy_query_blocks()`.
_eval_query_blocks = True


@contextmanager
def lazy_query_blocks() -> Iterator[None]:
    """Chunked attention only builds its query blocks' graphs, evaluating nothing:
    for building a forward pass without running it (counting its collectives)."""
    global _eval_query_blocks
    saved, _eval_query_blocks = _eval_query_blocks, False
    try:
        yield
    finally:
        _eval_query_blocks = saved


class Attention(ShardedByTable, nn.Module):
    """x (B, L, dim) -> (B, L, dim): grouped-query attention with RoPE over a KV cache.

    The attention kind: split by whole heads (`splits.llama_attention`; `shard(group)`:
    wq/wk/wv all-to-sharded, wo sharded-to-all), a KVCache of its KV heads' keys and
    values. `hf_names` / `gguf_names`: its tensors in Hugging Face
    and GGUF checkpoints (checkpoint module path under the layer -> the model's), which
    the readers map (`checkpoints/hf.py`, `checkpoints/gguf.py`)."""

    hf_names = (
        ("self_attn.q_proj", "attention.wq"),
        ("self_attn.k_proj", "attention.wk"),
        ("self_attn.v_proj", "attention.wv"),
        ("self_attn.o_proj", "attention.wo"),
    )
    gguf_names = (
        ("attn_q", "attention.wq"),
        ("attn_k", "attention.wk"),
        ("attn_v", "attention.wv"),
        ("attn_output", "attention.wo"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        return llama_attention(args.head_dim)

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        return CacheSpec("kv", (("kv_heads", 2 * args.head_dim),))

    def __init__(self, args: ModelArgs):
        super().__init__()
        object.__setattr__(self, "args", args)  # (not a parameter) its split table's
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd**-0.5
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=args.o_bias)
        self.rope = initialize_rope(
            args.rope_dims or hd,
            args.rope_theta,
            args.rope_traditional,
            args.rope_scaling,
            args.max_position_embeddings,
        )
        # Local KV head of each local query head, when a rank's query heads do
        # not map onto its KV heads as plain GQA (see plan.RankPart.kv_map).
        # Set with object.__setattr__ so that it is not a parameter.
        object.__setattr__(self, "_kv_index", None)
        # Queries per block of a causal prefill (None: all at once); see `_attend`.
        object.__setattr__(self, "query_chunk", None)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x (B, L, dim) -> q (B, nh, L, hd), k and v (B, nkv, L, hd), before RoPE. Head
        counts follow the (maybe sharded) projections."""
        heads = fused_heads(self, x, self.head_dim)  # one product (parallel/fused.py)
        if heads is not None:
            return heads
        B, L, _ = x.shape
        hd = self.head_dim
        q = self.wq(x).reshape(B, L, -1, hd).transpose(0, 2, 1, 3)
        k = self.wk(x).reshape(B, L, -1, hd).transpose(0, 2, 1, 3)
        v = self.wv(x).reshape(B, L, -1, hd).transpose(0, 2, 1, 3)
        return q, k, v

    def project_rotated(self, x: mx.array, offset: Any) -> tuple[mx.array, mx.array, mx.array]:
        """`project`, then RoPE on q and k from position `offset` (an int or an int32
        array): in one native operation when fused and the RoPE is plain."""
        if type(self).project is Attention.project:
            heads = fused_heads_rotated(self, x, self.head_dim, self.rope, offset)
            if heads is not None:
                return heads
        q, k, v = self.project(x)
        return self.rope(q, offset=offset), self.rope(k, offset=offset), v

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        return self.wo(self.mixed(x, mask, cache))

    def mixed(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        """The heads' outputs side by side before `wo`: x (B, L, dim) -> (B, L, nh * hd)."""
        offset = cache.offset if cache is not None else 0
        q, k, v = self.project_rotated(x, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self._kv_index is not None:
            # Irregular local grouping: give every query head its own copy of
            # its KV head and attend as plain multi-head attention.
            k = mx.take(k, self._kv_index, axis=1)
            v = mx.take(v, self._kv_index, axis=1)
        return self._attend(q, k, v, mask, cache, merged=True)

    def _attend(
        self, q: mx.array, k: mx.array, v: mx.array, mask: Any, cache: Any, merged: bool = False
    ) -> mx.array:
        """Attention of q (B, nh, L, hd) over k, v (B, nkv, S, hd), S = offset + L ->
        (B, nh, L, hd), or (B, L, nh * hd) when `merged`.

        With `query_chunk` set and a causal mask, the queries go in blocks of that
        many positions: block [a, b) attends to keys [0, offset + b) under a causal
        mask (mlx aligns it to the lower right, so that is exactly its rows of the
        whole mask). MLX's CPU attention is not fused: it builds (B, nh, L, S) scores
        and probabilities, and blocks shrink them to (B, nh, chunk, S). Each block is
        evaluated as soon as it is built (outside `lazy_query_blocks`): evaluated
        together, the CPU backend allocates an op's output when it queues the op, so
        the next block's scores (or the rest of the layer's buffers) would be
        allocated while a block's scores are still alive. Other masks (an array:
        batched left padding) and quantized caches keep the single call.
        """
        c, L = self.query_chunk, q.shape[2]
        if c is None or L <= c or not isinstance(mask, str) or not isinstance(k, mx.array):
            return scaled_dot_product_attention(
                q, k, v, cache=cache, scale=self.scale, mask=mask, merged=merged
            )
        offset = k.shape[2] - L
        blocks = []
        for a in range(0, L, c):
            b = min(a + c, L)
            keys, values = k[:, :, : offset + b], v[:, :, : offset + b]
            out = scaled_dot_product_attention(
                q[:, :, a:b], keys, values, cache=cache, scale=self.scale, mask=mask
            )
            if _eval_query_blocks:
                mx.eval(out)
            blocks.append(out)
        out = mx.concatenate(blocks, axis=2)
        return merge_heads(out) if merged else out
