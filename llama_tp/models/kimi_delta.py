"""Kimi Delta Attention (KDA, Kimi-Linear): mlx-lm's `KimiDeltaAttention` under the model's
names, with its split table and its recurrent-state cache; Kimi-Linear's latent attention
(no RoPE) and the family's config fields.

Per token, `wq`, `wk`, `wv` give H heads of `d` values each; each of q, k, v goes
through its own causal depthwise convolution of `K` taps (mlx-lm's `ShortConv1d`: its
last K - 1 inputs are its state) and SiLU. Unlike Qwen3.5's Gated DeltaNet, the decay
is per channel, not per head: `f_b_proj(f_a_proj(x))` gives H x d gate logits (a
low-rank projection through d values), `b_proj` one write strength per head, and each
head runs the gated delta rule over a (d, d) float32 state (mlx-lm's
`gated_delta_update` with a per-channel `a`: `S <- diag(g) S + k (beta (v - S k))^T`).
The output is RMS-normed per head (`o_norm`), gated by `sigmoid(g_b_proj(g_a_proj(x)))`
and projected back by `wo`. The state is fixed-size: 3 (K - 1) H d conv values and
H d d float32 delta-rule values per sequence (an `ArraysCache` of four: the q, k and v
conv states, the delta-rule state).

Split by heads (`KimiDeltaAttention.split_table`, unit "kda_heads", any count per rank):
the rows of wq / wk / wv, f_b_proj, g_b_proj and b_proj of a rank's heads, the same
heads' conv channels, `A_log` and `dt_bias`, wo's columns (one all-reduce per layer).
The low-rank inputs f_a_proj and g_a_proj (dim -> d) and the per-head norm are whole on
every rank. A rank's conv and delta-rule state hold only its heads.

Kimi-Linear's other layers are latent attention (`LatentAttention`) without RoPE: its
queries' and shared key's "RoPE" parts are scored as they are (mlx-lm's
`KimiMLAAttention`, `mla_use_nope`), the latent normed at the model's eps.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.models.kimi_linear import ShortConv1d

from ..model_args import ModelArgs
from ..parallel.kind_shard import ShardedByTable
from ..parallel.splits import (
    CHANNELS,
    COLUMNS,
    ROWS,
    VECTOR,
    CacheSpec,
    SplitTable,
    TensorSplit,
    Unit,
)
from .latent_attention import LatentAttention

_CONVS = ("q_conv", "k_conv", "v_conv")


class KimiDeltaAttention(ShardedByTable, nn.Module):
    """x (B, L, dim) -> (B, L, dim), over an ArraysCache [q, k, v conv states (B, K - 1,
    H d) each, delta-rule state (B, H, d, d) float32] (see the module docstring)."""

    # Names under the attention slot's (`self_attn.` -> `attention.`), q/k/v/o every
    # attention's (wq, ...); a release's convs `q_conv1d` (C, 1, K) are renamed and turned
    # by the readers (`checkpoints/gated_delta.kda_tensors`). The release's experts block:
    # its routing bias beside the gate (not DeepSeek's in it; its shared experts and the
    # per-expert w1/w2/w3, stacked as Mixtral's, are the experts' names).
    hf_names = (
        ("block_sparse_moe.gate.e_score_correction_bias$", "feed_forward.e_score_correction_bias"),
    )
    # llama.cpp's names (gguf-py's KIMI_LINEAR tensors; q/k/v/o as every attention's); the
    # readers turn the conv (1, C, 1, K) and ssm_a (-exp(A_log)) back (`kda_gguf`)
    gguf_names = (
        *((f"ssm_conv1d_{c[0]}", f"attention.{c}.conv") for c in _CONVS),
        ("ssm_f_a", "attention.f_a_proj"),
        ("ssm_f_b", "attention.f_b_proj"),
        ("ssm_beta", "attention.b_proj"),
        ("ssm_g_a", "attention.g_a_proj"),
        ("ssm_g_b", "attention.g_b_proj"),
        ("ssm_norm", "attention.o_norm"),
        ("ssm_dt.bias$", "attention.dt_bias"),
        ("ssm_a$", "attention.A_log"),
        ("exp_probs_b.bias$", "feed_forward.e_score_correction_bias"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        d = args.kda_head_dim
        heads = TensorSplit("kda_heads", ROWS, d)
        tensors = {p: heads for p in ("wq", "wk", "wv", "f_b_proj", "g_b_proj")}
        tensors |= {f"{c}.conv": TensorSplit("kda_heads", CHANNELS, d) for c in _CONVS}
        tensors |= {
            "b_proj": TensorSplit("kda_heads", ROWS),
            "A_log": TensorSplit("kda_heads", VECTOR),
            "dt_bias": TensorSplit("kda_heads", VECTOR, d),
            "wo": TensorSplit("kda_heads", COLUMNS, d),
        }
        local = {"num_heads": (("kda_heads", 1),), "projection_dim": (("kda_heads", d),)}
        local |= {f"{c}.conv.groups": (("kda_heads", d),) for c in _CONVS}
        return SplitTable(
            "Kimi delta attention",
            tensors,
            module="units",
            units=(Unit("kda_heads", args.kda_heads, "Kimi delta attention heads"),),
            local=local,
        )

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        d, taps = args.kda_head_dim, args.kda_conv_kernel - 1
        return CacheSpec(
            "arrays",
            fixed=(("kda_heads", 3 * d * taps),),
            fixed32=(("kda_heads", d * d),),
            size=4,
            mask="ssm",
            what="Kimi delta attention",
        )

    def __init__(self, args: ModelArgs):
        super().__init__()
        object.__setattr__(self, "args", args)  # (not a parameter) its split table's
        dim = args.dim
        self.num_heads, self.head_dim = h, d = args.kda_heads, args.kda_head_dim
        self.projection_dim = p = h * d
        self.conv_kernel = args.kda_conv_kernel
        self.wq = nn.Linear(dim, p, bias=False)
        self.wk = nn.Linear(dim, p, bias=False)
        self.wv = nn.Linear(dim, p, bias=False)
        self.q_conv = ShortConv1d(p, self.conv_kernel)
        self.k_conv = ShortConv1d(p, self.conv_kernel)
        self.v_conv = ShortConv1d(p, self.conv_kernel)
        self.f_a_proj = nn.Linear(dim, d, bias=False)
        self.f_b_proj = nn.Linear(d, p, bias=False)
        self.b_proj = nn.Linear(dim, h, bias=False)
        self.g_a_proj = nn.Linear(dim, d, bias=False)
        self.g_b_proj = nn.Linear(d, p, bias=False)
        self.A_log = mx.zeros((h,))  # mlx-lm holds it (1, 1, H, 1): the readers flatten it
        self.dt_bias = mx.zeros((p,))
        self.o_norm = nn.RMSNorm(d, eps=args.norm_eps)
        self.wo = nn.Linear(p, dim, bias=False)

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        B, T, _ = x.shape
        h, d = self.num_heads, self.head_dim
        lengths = cache.lengths if cache is not None else None
        heads = []
        for i, (proj, conv) in enumerate(
            ((self.wq, self.q_conv), (self.wk, self.k_conv), (self.wv, self.v_conv))
        ):
            state = cache[i] if cache is not None else None
            if state is None:
                state = mx.zeros((B, self.conv_kernel - 1, self.projection_dim), x.dtype)
            out, state = conv(proj(x), state, mask, lengths)
            if cache is not None:
                cache[i] = state
            heads.append(out.reshape(B, T, h, d))
        q, k, v = heads
        q, k = normalize_qk(q, k, inv_scale=d**-0.5, eps=1e-6)
        a = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, h, d)
        b = self.b_proj(x)
        out, state = gated_delta_update(
            q,
            k,
            v,
            a,
            b,
            self.A_log.reshape(h, 1),
            self.dt_bias.reshape(h, d),
            state=cache[3] if cache is not None else None,
            mask=mask,
            use_kernel=not self.training,
        )
        if cache is not None:
            cache[3] = state
            cache.advance(T)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, T, h, d)
        out = (self.o_norm(out.reshape(B, T, h, d)) * mx.sigmoid(gate)).reshape(B, T, -1)
        return self.wo(out)


class _NoRope(nn.Module):
    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        return x


class NopeLatentAttention(LatentAttention):
    """Kimi-Linear's latent attention: `LatentAttention` with its "RoPE" parts unrotated
    and the latent normed at the model's eps (mlx-lm's `KimiMLAAttention`)."""

    hf_names = ()
    gguf_names = ()

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.rope = _NoRope()
        self.kv_a_layernorm.eps = args.norm_eps


# -- config fields (the family's registry row reads them) --------------------------


def kimi_linear_fields(config: dict) -> dict:
    """Kimi-Linear's fields from its config.json (mlx-lm's kimi_linear defaults): the KDA
    layers (`linear_attn_config.kda_layers`, counted from 1), their heads, the latent
    attention of the others, the experts (sigmoid scores plus a correction bias behind a
    linear gate, groups, shared experts) after `first_k_dense_replace` dense layers."""
    lin = config.get("linear_attn_config") or {}
    n = config["num_hidden_layers"]
    kda = sorted(i - 1 for i in lin.get("kda_layers") or ())
    h, d, kernel = (
        lin.get("num_heads", 0),
        lin.get("head_dim", 0),
        lin.get("short_conv_kernel_size", 4),
    )
    if min(h, d, kernel) < 1 or not kda or not 0 <= kda[0] <= kda[-1] < n:
        raise ValueError(
            f"model config: linear_attn_config needs positive num_heads, head_dim and "
            f"short_conv_kernel_size and kda_layers from 1 to {n}, got {h} heads of {d}, "
            f"kernel {kernel}, kda_layers {lin.get('kda_layers')}"
        )
    act = config.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise ValueError(f"model config: moe_router_activation_func {act!r} (Kimi's is 'sigmoid')")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    experts = config.get("num_experts") or 0
    first, freq = config.get("first_k_dense_replace", 0), config.get("moe_layer_freq", 1) or 1
    sparse = [i for i in range(n) if experts and i >= first and i % freq == 0]
    moe = config.get("moe_intermediate_size") or 0
    return {
        "rope_scaling": None,  # no RoPE at all (mlx-lm's KimiMLAAttention)
        "kv_lora_rank": config["kv_lora_rank"],
        "q_lora_rank": 0,
        "qk_nope_head_dim": config.get("qk_nope_head_dim") or head_dim,
        "qk_rope_head_dim": config.get("qk_rope_head_dim") or 0,
        "v_head_dim": config.get("v_head_dim") or head_dim,
        "n_experts": experts,
        "n_experts_per_tok": config.get("num_experts_per_token", 1) if experts else 0,
        "moe_hidden_dim": moe,
        "shared_expert_dim": (config.get("num_shared_experts") or 0) * moe,
        "shared_expert_gated": False,
        "norm_topk_prob": bool(config.get("moe_renormalize", True)),
        "router": "sigmoid_linear",
        "n_group": config.get("num_expert_group", 1) or 1,
        "topk_group": config.get("topk_group", 1) or 1,
        "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        "sparse_layers": None if len(sparse) == n else sparse,
        "extra": {"kda_layers": kda, "kda_heads": h, "kda_head_dim": d, "kda_conv_kernel": kernel},
    }


def kimi_linear_gguf_fields(get: Any) -> dict:
    """The same fields from a GGUF file's `kimi-linear.*` metadata (llama.cpp's converter:
    a KV head count per layer, 0 for a KDA layer; KDA heads as many as the attention's
    until the reader counts ssm_beta's rows; kda.head_dim, ssm.conv_kernel; the latent's
    kv_lora_rank, key_length_mla (nope + rope), value_length_mla, rope.dimension_count;
    the experts' count, width, shared count, scale and leading dense layers)."""
    kv = get("attention.head_count_kv")
    kv = [int(k) for k in kv] if hasattr(kv, "__len__") else None
    n = (get("block_count") or 0) - (get("nextn_predict_layers") or 0)
    if kv is None or len(kv) < n:
        raise ValueError(f"attention.head_count_kv {kv!r}: expected one count per layer")
    kda = [i for i in range(n) if not kv[i]]
    h, d, kernel = (
        get("attention.head_count") or 0,
        get("kda.head_dim") or 0,
        get("ssm.conv_kernel") or 0,
    )
    rope, k_mla = get("rope.dimension_count") or 0, get("attention.key_length_mla") or 0
    experts, first = get("expert_count") or 0, get("leading_dense_block_count") or 0
    moe = get("expert_feed_forward_length") or 0
    sparse = [i for i in range(n) if experts and i >= first]
    if min(h, d, kernel) < 1 or not kda:
        raise ValueError(f"KDA layers {kda} of {h} heads of {d}, conv kernel {kernel}")
    return {
        "rope_scaling": None,
        "kv_lora_rank": get("attention.kv_lora_rank") or 0,
        "q_lora_rank": get("attention.q_lora_rank") or 0,
        "qk_nope_head_dim": k_mla - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": get("attention.value_length_mla") or 0,
        "n_experts": experts,
        "n_experts_per_tok": get("expert_used_count") or 0,
        "moe_hidden_dim": moe,
        "shared_expert_dim": (get("expert_shared_count") or 0) * moe,
        "shared_expert_gated": False,
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "router": "sigmoid_linear",
        "n_group": get("expert_group_count") or 1,
        "topk_group": get("expert_group_used_count") or 1,
        "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
        "sparse_layers": None if len(sparse) == n else sparse,
        "extra": {"kda_layers": kda, "kda_heads": h, "kda_head_dim": d, "kda_conv_kernel": kernel},
    }


def kimi_linear_config(a: ModelArgs) -> dict:
    """Kimi-Linear's config.json keys (what `convert` writes; mlx-lm's kimi_linear reads them)."""
    n, kda = a.n_layers, a.kda_layers
    sparse = [i for i in range(n) if a.is_sparse(i)]
    return {
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in kda],
            "full_attn_layers": [i + 1 for i in range(n) if i not in kda],
            "num_heads": a.kda_heads,
            "head_dim": a.kda_head_dim,
            "short_conv_kernel_size": a.kda_conv_kernel,
        },
        "model_max_length": a.max_position_embeddings,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "mla_use_nope": True,
        "num_experts": a.n_experts,
        "num_experts_per_token": a.n_experts_per_tok,
        "moe_intermediate_size": a.moe_hidden_dim,
        "num_shared_experts": a.shared_expert_dim // a.moe_hidden_dim if a.moe_hidden_dim else 0,
        "moe_renormalize": a.norm_topk_prob,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": a.routed_scaling_factor,
        "num_expert_group": a.n_group,
        "topk_group": a.topk_group,
        "first_k_dense_replace": sparse[0] if sparse else n,
        "moe_layer_freq": 1,
    }
