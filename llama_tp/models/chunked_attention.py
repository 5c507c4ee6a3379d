"""Llama 4's attention: chunked local attention on its RoPE layers, global attention
without RoPE (NoPE) on the others, and the family's config fields.

Two of mlx-lm's classes are the oracle, and differ:

    llama4       (the wrapper's text model, mlx-lm's `llama4`): the layers in
                 `no_rope_layers` (every fourth by default) attend to everything without
                 RoPE, their queries scaled by log(floor((pos + 1) / floor_scale) + 1) *
                 attn_scale + 1 (attention temperature tuning: 1 below floor_scale); the
                 others rotate q and k (interleaved pairs, Llama 3's scaling), then with
                 `use_qk_norm` RMS-normalise each head without weights (eps 1e-6), and
                 attend within their chunk of `attention_chunk_size` positions only (a
                 `ChunkedCache` holding the current chunk, its mask "chunked":
                 `masks.chunk_mask`). The feed-forward of every `interleave_moe_layer_step`-
                 th layer is experts beside a shared expert, top-1 by sigmoid scores that
                 scale the expert's input (`models/moe.py`'s "sigmoid_input" router).
    llama4_text  (mlx-lm's `llama4_text`, MobileLLM-R1): dense, every layer global; the
                 layers whose `no_rope_layers` entry is 0 without RoPE, `use_qk_norm` on
                 every layer before RoPE (eps rms_norm_eps), no temperature tuning.

Split by heads as the core attention (its split table: the norms have no weights, the
temperature is per position): nothing beyond `Attention`'s. Each rank's chunked cache
holds its KV heads' keys of the current chunk.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..model_args import ModelArgs
from ..parallel.splits import CacheSpec
from .attention import Attention


class ChunkedAttention(Attention):
    """x (B, L, dim) -> (B, L, dim): layer `layer` of a Llama 4 model (see the module
    docstring): with RoPE or not, q/k norms before or after it, chunked or global."""

    hf_names = ()  # the core attention's names
    gguf_names = ()

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        chunk = args.attention_chunk_size if args.rope_layers[layer] else 0
        per_token = (("kv_heads", 2 * args.head_dim),)
        if not chunk:
            return CacheSpec("kv", per_token)
        return CacheSpec("chunked", per_token, window=chunk, mask="chunked")

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args)
        self.use_rope = bool(args.rope_layers[layer])
        # "before" / "after" RoPE (llama4_text / llama4), None: none in this layer
        where = args.qk_l2_norm
        self.qk_norm = where if (self.use_rope or where == "before") else None
        self.qk_eps = args.norm_eps if where == "before" else 1e-6
        tuning = args.attn_temperature
        self.temperature = tuple(tuning) if tuning and not self.use_rope else None

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.project(x)  # (B, heads, L, hd)
        if self.qk_norm == "before":
            q, k = self._norm(q), self._norm(k)
        offset = cache.offset if cache is not None else 0
        if self.use_rope:
            q = self.rope(q, offset=offset)
            k = self.rope(k, offset=offset)
        if self.qk_norm == "after":
            q, k = self._norm(q), self._norm(k)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            pos = mx.arange(offset + 1, offset + L + 1)
            scales = mx.log(mx.floor(pos / floor_scale) + 1.0) * attn_scale + 1.0
            q = (q * scales[:, None]).astype(q.dtype)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self._kv_index is not None:  # irregular local grouping (see `Attention`)
            k = mx.take(k, self._kv_index, axis=1)
            v = mx.take(v, self._kv_index, axis=1)
        out = self._attend(q, k, v, mask, cache)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _norm(self, t: mx.array) -> mx.array:
        return mx.fast.rms_norm(t, None, self.qk_eps)


class Llama4Layer:
    """The names of a Llama 4 layer's feed-forward in mlx-lm's folders (`feed_forward.`:
    the router, the stacked experts, the shared expert, a dense layer's SwiGLU), which
    only this family reads."""

    hf_names = (
        ("feed_forward.router", "feed_forward.router"),
        ("feed_forward.experts", "feed_forward.switch_mlp"),
        ("feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.w1"),
        ("feed_forward.shared_expert.down_proj", "feed_forward.shared_expert.w2"),
        ("feed_forward.shared_expert.up_proj", "feed_forward.shared_expert.w3"),
        ("feed_forward.gate_proj", "feed_forward.w1"),
        ("feed_forward.down_proj", "feed_forward.w2"),
        ("feed_forward.up_proj", "feed_forward.w3"),
    )
    gguf_names = ()


def _rope_layers(config: dict, default_interval: int | None) -> list[int]:
    n = config["num_hidden_layers"]
    given = config.get("no_rope_layers")
    if isinstance(given, list) and len(given) == n:
        return [int(bool(v)) for v in given]  # 1: the layer rotates (Hugging Face's sense)
    if default_interval is None:
        raise ValueError(f"model config: no_rope_layers needs {n} entries, got {given!r}")
    return [int((i + 1) % default_interval != 0) for i in range(n)]


def llama4_fields(config: dict) -> dict:
    """The wrapper's text model (mlx-lm's `llama4`): chunked RoPE layers, NoPE global layers
    with temperature tuning, q/k norms after RoPE, experts in every
    `interleave_moe_layer_step`-th layer (top-1, sigmoid, the input scaled) beside a
    shared expert of `intermediate_size`; the dense layers' `intermediate_size_mlp`."""
    n = config["num_hidden_layers"]
    k = config.get("num_experts_per_tok", 1)
    if k != 1:
        raise ValueError(f"model config: Llama 4 routes 1 expert per token, not {k}")
    step = config.get("interleave_moe_layer_step", 1) or 1
    sparse = [i for i in range(n) if i % step == step - 1]
    tuning = config.get("attn_temperature_tuning", 4)
    return {
        "rope_traditional": True,
        "hidden_dim": config.get("intermediate_size_mlp") or config["intermediate_size"],
        "n_experts": config["num_local_experts"],
        "n_experts_per_tok": 1,
        "moe_hidden_dim": config["intermediate_size"],
        "shared_expert_dim": config["intermediate_size"],
        "shared_expert_gated": False,
        "router": "sigmoid_input",
        "sparse_layers": None if len(sparse) == n else sparse,
        "extra": {
            "rope_layers": _rope_layers(config, config.get("no_rope_layer_interval") or 4),
            "attention_chunk_size": int(config.get("attention_chunk_size") or 0),
            "qk_l2_norm": "after" if config.get("use_qk_norm", False) else None,
            "attn_temperature": (
                (float(config.get("floor_scale", 8192)), float(config.get("attn_scale", 0.1)))
                if tuning
                else None
            ),
        },
    }


def llama4_gguf_fields(get) -> dict:
    """The wrapper's text model's fields from a GGUF file's `llama4.*` metadata, as llama.cpp
    reads them (`src/models/llama4.cpp`): chunked RoPE layers by the sliding-window pattern
    (every fourth layer global and without RoPE unless `attention.sliding_window_pattern`
    says otherwise), chunks of 8192 and temperature tuning (floor_scale 8192, attn_scale
    0.1) unless `attention.sliding_window` / `attention.temperature_length` /
    `attention.temperature_scale` say otherwise (llama.cpp itself takes the constants);
    q/k norms but with 128 experts (Maverick's `use_qk_norm` false); the experts in every
    `interleave_moe_layer_step`-th layer (the tensors say which), top-1, sigmoid, the
    input scaled, beside a shared expert of the experts' width. The q/k rows are the
    checkpoint's (the converter does not permute them: interleaved pairs already)."""
    n = get("block_count")
    if get("expert_used_count") not in (None, 1):
        raise ValueError(f"expert_used_count {get('expert_used_count')} (Llama 4 routes 1)")
    chunk = get("attention.sliding_window", 8192)
    if not chunk:  # llama.cpp's MobileLLM switch: every layer global, with RoPE
        raise ValueError("attention.sliding_window 0 (MobileLLM's layout) is not read")
    pattern = get("attention.sliding_window_pattern", 4)
    if hasattr(pattern, "__len__"):  # per layer: True where chunked (with RoPE)
        rope = [int(bool(v)) for v in pattern]
    else:
        rope = [int((i + 1) % pattern != 0) for i in range(n)]
    if len(rope) != n:
        raise ValueError(f"attention.sliding_window_pattern has {len(rope)} layers, not {n}")
    width = get("expert_feed_forward_length") or 0
    return {
        "n_experts_per_tok": 1,
        "moe_hidden_dim": width,
        "shared_expert_dim": width,
        "shared_expert_gated": False,
        "norm_topk_prob": False,
        "router": "sigmoid_input",
        "extra": {
            "rope_layers": rope,
            "attention_chunk_size": int(chunk),
            "qk_l2_norm": None if get("expert_count") == 128 else "after",
            "attn_temperature": (
                float(get("attention.temperature_length", 8192)),
                float(f"{get('attention.temperature_scale', 0.1):.7g}"),  # float32 stored
            ),
        },
    }


def llama4_text_fields(config: dict) -> dict:
    """mlx-lm's `llama4_text` (MobileLLM-R1): dense (`intermediate_size_mlp`), global
    attention, RoPE on the layers `no_rope_layers` marks 1, q/k norms before RoPE."""
    return {
        "rope_traditional": True,
        "rope_scaling": None,  # mlx-lm's llama4_text rotates with plain RoPE
        "hidden_dim": config["intermediate_size_mlp"],
        "extra": {
            "rope_layers": _rope_layers(config, None),
            "attention_chunk_size": 0,
            "qk_l2_norm": "before" if config.get("use_qk_norm", False) else None,
            "attn_temperature": None,
        },
    }
