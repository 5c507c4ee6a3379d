"""Output-gated attention (Qwen3-Next, Qwen3.5 / 3.6 full-attention layers): mlx-lm's
`Qwen3NextAttention` under the model's names.

`wq` (q_proj) gives each query head its queries and, after them, a gate of the same
width: [q_0 | g_0 | q_1 | g_1 ...]; the attention output is multiplied by
sigmoid(gate) before `wo`. Queries and keys are RMS-normalised per head (q_norm, k_norm,
as Qwen3), and RoPE turns only the first `rope_dims` values of each head (partial
rotary: a quarter), on the halves (not interleaved).

Split by heads like any attention (its split table: the core attention's with wq's rows
two head widths per query head, a head's queries and gate together); its cache is the
core attention's KV cache.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..model_args import ModelArgs
from ..parallel.splits import ROWS, SplitTable, TensorSplit
from .qk_norm import QKNormAttention


class GatedAttention(QKNormAttention):
    """x (B, L, dim) -> (B, L, dim): grouped-query attention with q/k norms, partial RoPE
    and a sigmoid gate per query value (see the module docstring)."""

    hf_names = ()  # the core attention's and q/k norms' names
    gguf_names = ()

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        table = super().split_table(args)
        wq = {"wq": TensorSplit("q_heads", ROWS, 2 * args.head_dim)}  # queries and gate
        return replace(table, tensors={**table.tensors, **wq})

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.wq = nn.Linear(args.dim, 2 * args.n_heads * args.head_dim, bias=args.qkv_bias)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        hd = self.head_dim
        q, gate = mx.split(self.wq(x).reshape(B, L, -1, 2 * hd), 2, axis=-1)
        gate = gate.reshape(B, L, -1)  # (B, L, nh * hd)
        k = self.wk(x).reshape(B, L, -1, hd)
        v = self.wv(x).reshape(B, L, -1, hd).transpose(0, 2, 1, 3)
        q = self.q_norm(q).transpose(0, 2, 1, 3)  # (B, nh, L, hd)
        k = self.k_norm(k).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self._kv_index is not None:  # irregular local grouping (AttentionHeads)
            k = mx.take(k, self._kv_index, axis=1)
            v = mx.take(v, self._kv_index, axis=1)
        out = self._attend(q, k, v, mask, cache).transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.wo(out * mx.sigmoid(gate))
