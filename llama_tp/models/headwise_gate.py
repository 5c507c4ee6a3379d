"""Step-3.5's attention: sliding and global layers, each with its own head counts and RoPE,
their outputs gated per head; the family's clamped feed-forward and config fields.

mlx-lm's own `step3p5` is the oracle. Every layer normalises each query and key head
(RMSNorm; Step's "zero-centred" norms, whose weights mlx-lm stores with the 1 added), then
rotates the first `partial_rotary_factors[i]` of each head (0.5 on the global layers, all
on the sliding ones) with the layer's own base (`rope_theta` a list) and YaRN only on the
`yarn_only_types`; the attention output of each head is scaled by sigmoid(g_proj(x))
(`use_head_wise_attn_gate`: one gate per head). Layers whose `layer_types` entry is
"sliding_attention" attend to the last `sliding_window` positions through a
RotatingKVCache (as Gemma's and gpt-oss's) over heads of their own count
(`attention_other_setting`: Step-3.5-Flash's 96 query heads over 8 KV heads beside the
global layers' 64 over 8). The feed-forward: a dense SwiGLU in the first layers, then
experts (sigmoid scores plus `router_bias` pick the top-k, their scores renormalised and
times `moe_router_scaling_factor`: `models/moe.py`'s "sigmoid_bias") beside an ungated
shared expert; each layer's SwiGLU clamped where `swiglu_limits` (experts) and
`swiglu_limits_shared` (shared expert, dense layers) say (mlx-lm's `clamped_swiglu`).

Split by heads: the global layers' as the core attention's, the sliding layers' by units
of their own (`swa_heads`, balanced or weighted like any unit; `swa_kv`, the KV heads
those query heads need, shared by neighbours where a group straddles two ranks, as Gemma
4's global KV heads), `g_proj`'s rows with their heads. Each rank caches its KV heads.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope
from mlx_lm.models.step3p5 import clamped_swiglu

from ..model_args import ModelArgs, layer_values
from ..parallel.splits import COLUMNS, ROWS, CacheSpec, SplitTable, TensorSplit, Unit
from .attention import Attention
from .feed_forward import FeedForward


def _own_heads(args: ModelArgs) -> bool:
    """Whether the sliding layers have head counts of their own (units of their own)."""
    return tuple(args.swa_heads) != (args.n_heads, args.n_kv_heads)


class GatedHeadsAttention(Attention):
    """x (B, L, dim) -> (B, L, dim): a global layer of a Step-3.5 model (the module
    docstring): q/k norms per head, partial RoPE of its own, its heads' outputs gated."""

    hf_names = (("self_attn.g_proj", "attention.g_proj"),)  # and the core's, qk-norm's
    gguf_names = ()
    sliding = False

    @classmethod
    def units_of(cls, args: ModelArgs) -> tuple[str, str]:
        """(query unit, KV unit) of this kind's heads."""
        if cls.sliding and _own_heads(args):
            return "swa_heads", "swa_kv"
        return "q_heads", "kv_heads"

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        q, kv = cls.units_of(args)
        hd = args.head_dim
        tensors = {
            "wq": TensorSplit(q, ROWS, hd),
            "wk": TensorSplit(kv, ROWS, hd),
            "wv": TensorSplit(kv, ROWS, hd),
            "wo": TensorSplit(q, COLUMNS, hd),
        }
        if args.headwise_gate:
            tensors["g_proj"] = TensorSplit(q, ROWS, 1)
        units = ()
        if q == "swa_heads":
            nh, nkv = args.swa_heads
            units = (
                Unit("swa_heads", nh, "sliding-window query heads"),
                Unit("swa_kv", nkv, "sliding-window KV heads", follows="swa_heads"),
            )
        return SplitTable("attention", tensors, module="heads", units=units)

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        per_token = ((cls.units_of(args)[1], 2 * args.head_dim),)
        window = args.window(layer)
        if window is None:
            return CacheSpec("kv", per_token)
        return CacheSpec("rotating", per_token, window=window, mask="window")

    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        object.__setattr__(self, "args", args)  # (not a parameter) its split table's
        sliding = args.window(layer) is not None
        nh, nkv = args.swa_heads if sliding else (args.n_heads, args.n_kv_heads)
        hd = args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = nh, nkv, hd
        self.scale = hd**-0.5
        self.wq = nn.Linear(args.dim, nh * hd, bias=False)
        self.wk = nn.Linear(args.dim, nkv * hd, bias=False)
        self.wv = nn.Linear(args.dim, nkv * hd, bias=False)
        self.wo = nn.Linear(nh * hd, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=args.norm_eps)
        if args.headwise_gate:
            self.g_proj = nn.Linear(args.dim, nh, bias=False)
        kind = "sliding_attention" if sliding else "full_attention"
        yarn = not args.yarn_only_types or kind in args.yarn_only_types
        self.rope = initialize_rope(
            int(hd * args.rope_factors[layer]),
            args.rope_thetas[layer],
            False,
            args.rope_scaling if yarn else None,
            max_position_embeddings=args.max_position_embeddings,
        )
        q_unit, kv_unit = self.units_of(args)
        object.__setattr__(self, "q_unit", q_unit)
        object.__setattr__(self, "kv_unit", kv_unit)
        object.__setattr__(self, "_kv_index", None)
        object.__setattr__(self, "query_chunk", None)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        hd = self.head_dim
        q = self.q_norm(self.wq(x).reshape(B, L, -1, hd)).transpose(0, 2, 1, 3)
        k = self.k_norm(self.wk(x).reshape(B, L, -1, hd)).transpose(0, 2, 1, 3)
        v = self.wv(x).reshape(B, L, -1, hd).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset=offset)
        k = self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self._kv_index is not None:  # irregular local grouping (see `Attention`)
            k = mx.take(k, self._kv_index, axis=1)
            v = mx.take(v, self._kv_index, axis=1)
        out = self._attend(q, k, v, mask, cache).transpose(0, 2, 1, 3)  # (B, L, nh, hd)
        if "g_proj" in self:
            out = out * mx.sigmoid(self.g_proj(x))[..., None]
        return self.wo(out.reshape(B, L, -1))


class SlidingGatedHeadsAttention(GatedHeadsAttention):
    """A sliding-window layer of a Step-3.5 model: the last `sliding_window` positions,
    over heads of their own count (`swa_heads`)."""

    sliding = True


class ClampedFeedForward(FeedForward):
    """The SwiGLU feed-forward with Step's clamps: silu(gate) at most `limit`, up within
    +-`limit` (mlx-lm's `clamped_swiglu`); the core's split."""

    def __init__(self, args: ModelArgs, hidden_dim: int | None = None, limit: float = 0.0):
        super().__init__(args, hidden_dim)
        self.limit = limit

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(clamped_swiglu(self.w3(x), self.w1(x), self.limit))


def feed_forward(args: ModelArgs, layer: int, shared_limit: float) -> FeedForward:
    """A dense layer's (or a shared expert's) SwiGLU, clamped where `shared_limit` > 0."""
    width = args.shared_expert_dim if args.is_sparse(layer) else args.hidden_dim
    if shared_limit > 0:
        return ClampedFeedForward(args, width, shared_limit)
    return FeedForward(args, width)


def limits(args: ModelArgs, layer: int) -> tuple[float, float]:
    """(experts', shared expert's or dense layer's) SwiGLU limit of layer `layer` (0: none)."""

    def at(values: list | None) -> float:
        return float((values[layer] if values and layer < len(values) else 0) or 0)

    return at(args.swiglu_limits), at(args.swiglu_limits_shared)


class StepLayer:
    """The names of Step-3.5's feed-forward in mlx-lm's folders (`mlp.gate.gate`: the
    router, `mlp.gate.router_bias`, `mlp.share_expert`), which only this family reads;
    in llama.cpp's `step35` files the heads' gate and the routing bias (the feed-forward's
    own, mlx-lm's, not DeepSeek's router's)."""

    hf_names = (
        ("mlp.gate.gate", "feed_forward.router"),
        ("mlp.gate.router_bias$", "feed_forward.e_score_correction_bias"),
        ("mlp.share_expert.gate_proj", "feed_forward.shared_expert.w1"),
        ("mlp.share_expert.down_proj", "feed_forward.shared_expert.w2"),
        ("mlp.share_expert.up_proj", "feed_forward.shared_expert.w3"),
    )
    gguf_names = (
        ("attn_gate", "attention.g_proj"),
        ("exp_probs_b.bias$", "feed_forward.e_score_correction_bias"),
    )


def step3p5_fields(config: dict) -> dict:
    """Step-3.5's fields from its config.json (mlx-lm's defaults for the keys it leaves
    out): the layer types and their heads, per-layer RoPE, the experts and clamps."""
    n = config["num_hidden_layers"]
    types = list(config.get("layer_types") or [])[:n]
    if not types:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    other = config.get("attention_other_setting") or {}
    n_heads, n_kv = config["num_attention_heads"], config["num_attention_groups"]
    theta = config.get("rope_theta", 10000.0)
    thetas = [float(t) for t in theta[:n]] if isinstance(theta, list) else [float(theta)] * n
    factors = list(config.get("partial_rotary_factors") or [])[:n]
    factors += [1.0] * (n - len(factors))
    enum = config.get("moe_layers_enum")
    sparse = sorted({int(i) for i in enum.split(",")}) if enum else list(range(1, n))
    yarn_only, scaling = list(config.get("yarn_only_types") or []), {}
    if not config.get("layer_types") and yarn_only:
        # mlx-lm takes every layer for "full_attention" in this choice when the types are
        # left out: YaRN in all of them, or in none
        yarn_only = []
        if "full_attention" not in config["yarn_only_types"]:
            scaling = {"rope_scaling": None}
    return scaling | {
        "n_kv_heads": n_kv,
        "norm_eps": config.get("rms_norm_eps", 1e-5),  # mlx-lm's step3p5 default
        "rope_theta": thetas[0],
        "layer_types": types,
        "sliding_window": config.get("sliding_window", 512),
        "max_position_embeddings": config.get("max_position_embeddings", 262144),
        "n_experts": config.get("moe_num_experts", 288),
        "n_experts_per_tok": config.get("moe_top_k", 8),
        "moe_hidden_dim": config.get("moe_intermediate_size", 1280),
        "shared_expert_dim": config.get("share_expert_dim", 1280),
        "shared_expert_gated": False,
        "router": "sigmoid_bias",
        "norm_topk_prob": bool(config.get("norm_expert_weight", True)),
        "routed_scaling_factor": float(config.get("moe_router_scaling_factor", 3.0)),
        "sparse_layers": sparse,
        "extra": {
            "swa_heads": (
                other.get("num_attention_heads", n_heads),
                other.get("num_attention_groups", n_kv),
            ),
            "rope_thetas": thetas,
            "rope_factors": [float(f) for f in factors],
            "yarn_only_types": yarn_only,
            "headwise_gate": bool(config.get("use_head_wise_attn_gate", True)),
            "swiglu_limits": list(config.get("swiglu_limits") or []),
            "swiglu_limits_shared": list(config.get("swiglu_limits_shared") or []),
        },
    }


def step3p5_gguf_fields(get) -> dict:
    """The same fields from a GGUF file's `step35.*` metadata (llama.cpp's converter,
    conversion/step3.py): per-layer head and KV head counts (the global layers' as
    n_heads / n_kv_heads, the sliding ones' as `swa_heads`), the sliding layers from
    `attention.sliding_window_pattern`, their base `rope.freq_base_swa`; llama.cpp's
    partial RoPE (the global layers rotate half of each head, the sliding ones all: the
    converter checks the config says so), YaRN on the global layers (Step's
    `yarn_only_types`); the experts (sigmoid + exp_probs_b, renormalised as
    expert_weights_norm says, times expert_weights_scale) and the per-layer SwiGLU clamps
    (swiglu_clamp_exp / swiglu_clamp_shexp); the heads gated (attn_gate)."""
    n = get("block_count") - (get("nextn_predict_layers") or 0)  # less the MTP layers
    heads, kv = get("attention.head_count"), get("attention.head_count_kv")
    heads, kv = layer_values(heads, n), layer_values(kv, n)
    pattern = get("attention.sliding_window_pattern")
    sliding = [bool(s) for s in (() if pattern is None else pattern)][:n]
    if len(sliding) != n or len(heads) < n or len(kv) < n:
        raise ValueError(f"per-layer head counts / sliding_window_pattern short of {n} layers")
    gating = get("expert_gating_func")
    if gating not in (None, 0, 2):  # none (llama.cpp's default for step35: sigmoid), sigmoid
        raise ValueError(f"expert_gating_func {gating} (Step-3.5's is 2, sigmoid)")
    g = next((i for i in range(n) if not sliding[i]), 0)  # a global layer's heads
    s = next((i for i in range(n) if sliding[i]), g)  # a sliding one's
    hd = get("attention.key_length")
    rot = get("rope.dimension_count") or hd
    rot_swa = get("rope.dimension_count_swa") or rot
    base, base_swa = get("rope.freq_base", 10000.0), get("rope.freq_base_swa")
    scaling = None
    if get("rope.scaling.type") == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": get("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0),
        }
    elif get("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"rope.scaling.type {get('rope.scaling.type')!r} (Step-3.5's: yarn)")

    def per_layer(key: str) -> list[float]:
        values = get(key)
        values = [0.0] if values is None else values  # no clamps
        values = list(values) if hasattr(values, "__len__") else [values] * n
        return [float(f"{v:.7g}") for v in values[:n]]  # float32 stored

    return {
        "n_heads": heads[g],
        "n_kv_heads": kv[g],
        "rope_scaling": scaling,
        "layer_types": ["sliding_attention" if x else "full_attention" for x in sliding],
        "sliding_window": get("attention.sliding_window"),
        "n_experts": get("expert_count"),
        "n_experts_per_tok": get("expert_used_count"),
        "moe_hidden_dim": get("expert_feed_forward_length"),
        "shared_expert_dim": get("expert_shared_feed_forward_length"),
        "shared_expert_gated": False,
        "router": "sigmoid_bias",
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "routed_scaling_factor": float(f"{get('expert_weights_scale', 1.0):.7g}"),
        "extra": {
            "swa_heads": (heads[s], kv[s]),
            "rope_thetas": [float(base_swa or base) if x else float(base) for x in sliding],
            "rope_factors": [rot_swa / hd if x else rot / 2 / hd for x in sliding],
            "yarn_only_types": ["full_attention"],
            "headwise_gate": True,
            "swiglu_limits": per_layer("swiglu_clamp_exp"),
            "swiglu_limits_shared": per_layer("swiglu_clamp_shexp"),
        },
    }
