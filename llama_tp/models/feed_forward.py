"""The core feed-forward kind: SwiGLU, `layers.{i}.feed_forward.{w1,w2,w3}` (gate, down,
up), split by its intermediate columns (`splits.llama_feed_forward`; `shard(group,
part)`, `ShardedByTable`: w1 and w3 by rows, w2 by columns, one all-reduce)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..model_args import ModelArgs
from ..parallel.fused import fused_glu
from ..parallel.kind_shard import ShardedByTable
from ..parallel.splits import CacheSpec, SplitTable, llama_feed_forward


class FeedForward(ShardedByTable, nn.Module):
    """x (B, L, dim) -> (B, L, dim): the SwiGLU feed-forward, split by its intermediate
    columns (`splits.llama_feed_forward`; `shard(group)`: w1/w3 all-to-sharded, w2
    sharded-to-all); it caches nothing."""

    hf_names = (
        ("mlp.gate_proj", "feed_forward.w1"),
        ("mlp.down_proj", "feed_forward.w2"),
        ("mlp.up_proj", "feed_forward.w3"),
    )
    gguf_names = (
        ("ffn_gate", "feed_forward.w1"),
        ("ffn_down", "feed_forward.w2"),
        ("ffn_up", "feed_forward.w3"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        return llama_feed_forward()

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        return None

    def __init__(self, args: ModelArgs, hidden_dim: int | None = None):
        """SwiGLU of `hidden_dim` columns (default `args.hidden_dim`)."""
        super().__init__()
        object.__setattr__(self, "args", args)  # (not a parameter) its split table's
        hidden = hidden_dim or args.hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=args.mlp_bias)  # gate
        self.w2 = nn.Linear(hidden, args.dim, bias=args.mlp_bias)  # down
        self.w3 = nn.Linear(args.dim, hidden, bias=args.mlp_bias)  # up

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(self.glu(x))

    def glu(self, x: mx.array) -> mx.array:
        """silu(w1 x) * w3 x, before `w2`: x (B, L, dim) -> (B, L, hidden)."""
        glu = fused_glu(self, x)  # one product (parallel/fused.py)
        if glu is None:
            glu = nn.silu(self.w1(x)) * self.w3(x)
        return glu
