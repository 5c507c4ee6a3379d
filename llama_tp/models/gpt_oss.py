"""gpt-oss's attention: attention sinks, and sliding-window layers.

Every query head has a learned logit `sinks[h]` that joins the softmax's denominator
(a position nothing attends to: the weights over the real keys may sum to less than
1); mlx-lm's `scaled_dot_product_attention` takes it as `sinks`. Layers whose
`layer_types` entry is "sliding_attention" attend to the last `sliding_window`
positions only: their cache spec (`SinkAttention.cache_spec`) makes the model build
them a windowed mask (`masks.layer_masks`) and a RotatingKVCache of the window
(`caches.layer_caches`), as mlx-lm's gpt_oss does; the others attend to everything
through a KVCache.

The rest of gpt-oss is the Llama core with biases on q/k/v/o (`qkv_bias`, `o_bias`), YaRN
RoPE (`rope_scaling`, mlx-lm's `initialize_rope`), and a mixture of experts with a
biased router (top-k of its logits, softmax over those k) and biased experts behind
the clamped SwiGLU (`models/moe.py`).

Split by heads like any attention (its split table: the core attention's, and the sinks
by query heads); each rank keeps the sinks of its query heads (`AttentionHeads`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from ..kernels import scaled_dot_product_attention
from ..model_args import ModelArgs
from ..parallel.splits import VECTOR, CacheSpec, SplitTable, TensorSplit
from .attention import Attention


class SinkAttention(Attention):
    """x (B, L, dim) -> (B, L, dim): the core attention with a sink logit per query head
    (`sinks`, (n_heads,)), attending to the last `window` positions (None: all)."""

    hf_names = ()  # the core attention's names; the sinks are `self_attn.sinks`
    gguf_names = (("attn_sinks.weight$", "attention.sinks"),)  # a vector: the name exactly

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        table = super().split_table(args)
        sinks = {"sinks": TensorSplit("q_heads", VECTOR)}
        return replace(table, tensors={**table.tensors, **sinks})

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        spec = super().cache_spec(args, layer)
        w = args.window(layer)
        return spec if w is None else replace(spec, kind="rotating", window=w, mask="window")

    def __init__(self, args: ModelArgs, window: int | None = None):
        super().__init__(args)
        self.sinks = mx.zeros((args.n_heads,))
        object.__setattr__(self, "window", window)

    def _attend(
        self, q: mx.array, k: mx.array, v: mx.array, mask: Any, cache: Any, merged: bool = False
    ) -> mx.array:
        return scaled_dot_product_attention(
            q, k, v, cache=cache, scale=self.scale, mask=mask, sinks=self.sinks, merged=merged
        )


def gpt_oss_fields(config: dict) -> dict:
    """gpt-oss's experts, sinks and sliding-window layers (mlx-lm's defaults: layers
    alternating sliding and full attention, a window of 128)."""
    n_layers = config["num_hidden_layers"]
    types = config.get("layer_types") or ["sliding_attention", "full_attention"] * (n_layers // 2)
    return {
        "n_experts": config.get("num_local_experts", 128),
        "n_experts_per_tok": config.get("num_experts_per_tok", 4),
        "moe_hidden_dim": config["intermediate_size"],
        "router": "topk_softmax",
        "expert_bias": True,
        "activation": "swiglu_oai",
        "swiglu_limit": float(config.get("swiglu_limit", 7.0)),
        "attention_sinks": True,
        "sliding_window": config.get("sliding_window", 128),
        "layer_types": list(types),
    }
