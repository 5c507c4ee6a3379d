"""Qwen3's attention: the Llama attention with an RMSNorm on every query and key head.

`q_norm` and `k_norm` (weights of `head_dim`) normalise each head of the queries and
keys before RoPE. They are the same for every head, so a rank applies them to its own
heads and the weights are replicated: the core `Attention.shard` splits the rest.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..model_args import ModelArgs
from .attention import Attention


class QKNormAttention(Attention):
    """x (B, L, dim) -> (B, L, dim), as `Attention`, with q/k RMS-normalised per head
    (its split table and cache: the core attention's; the norms whole)."""

    hf_names = (
        ("self_attn.q_norm", "attention.q_norm"),
        ("self_attn.k_norm", "attention.k_norm"),
    )
    gguf_names = (
        ("attn_q_norm", "attention.q_norm"),
        ("attn_k_norm", "attention.k_norm"),
    )

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project(x)  # (B, heads, L, head_dim): normalised over head_dim
        return self.q_norm(q), self.k_norm(k), v
