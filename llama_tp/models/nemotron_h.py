"""Nemotron-H (`nemotron_h`: Nemotron-H 8B/47B/56B, Nemotron 3 Nano and Super): a layer
pattern of one mixer per layer, each a pre-norm `MixerBlock` (x + mixer(norm(x))):

    "M"  Mamba-2 (`mamba.py`: split by heads, groups kept whole; an ArraysCache)
    "*"  attention without RoPE (`NoRopeAttention`: the core attention's heads and KV
         cache, positions known from the Mamba layers only)
    "-"  a dense relu2 feed-forward (`Relu2FeedForward`: mlx-lm's `NemotronHMLP`,
         up_proj rows and down_proj columns by the feed-forward's columns)
    "E"  experts (`Relu2Experts`: mlx-lm's `NemotronHMoE`: sigmoid scores plus a
         correction bias pick the top-k in groups (`group_expert_select`), relu2
         experts (`SwitchMLP`, fc1 / fc2) and a relu2 shared expert; split by every
         expert's columns or by whole experts, summed once)

The pattern comes from `hybrid_override_pattern` (or transformers' `layers_block_type`
/ `layer_types` names, mlx-lm's mapping). A layer of "-" or "E" caches nothing (no cache
of its own, as mlx-lm's `make_cache`); the attention layers take the causal mask, the
Mamba layers the padding mask. Names are mlx-lm's under `backbone.layers.N.mixer`
(`hf_names`); the checkpoint reader maps `backbone.` (`checkpoints/hf.py`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.nemotron_h import ModelArgs as MlxArgs
from mlx_lm.models.nemotron_h import NemotronHMLP, NemotronHMoE

from ..model_args import ModelArgs
from ..parallel.kind_shard import ShardedByTable
from ..parallel.splits import COLUMNS, ROWS, CacheSpec, SplitTable, TensorSplit
from .attention import Attention
from .mamba import Mamba2Mixer, mlx_lm_args


class _Identity(nn.Module):
    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return x


class NoRopeAttention(Attention):
    """The core attention with no rotation (mlx-lm's `NemotronHAttention`)."""

    hf_names = (
        ("mixer.q_proj", "mixer.wq"),
        ("mixer.k_proj", "mixer.wk"),
        ("mixer.v_proj", "mixer.wv"),
        ("mixer.o_proj", "mixer.wo"),
    )
    gguf_names = (
        ("attn_q", "mixer.wq"),
        ("attn_k", "mixer.wk"),
        ("attn_v", "mixer.wv"),
        ("attn_output", "mixer.wo"),
    )

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.rope = _Identity()


class Relu2FeedForward(ShardedByTable, NemotronHMLP):
    """x (B, L, dim) -> (B, L, dim): down_proj(relu(up_proj(x))^2), split by its columns."""

    gguf_names = (("ffn_up", "mixer.up_proj"), ("ffn_down", "mixer.down_proj"))

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        tensors = {"up_proj": TensorSplit("ffn", ROWS), "down_proj": TensorSplit("ffn", COLUMNS)}
        return SplitTable("feed-forward", tensors)

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        return None

    def __init__(self, args: ModelArgs):
        super().__init__(mlx_lm_args(args))
        object.__setattr__(self, "args", args)  # (not a parameter) its split table's


class Relu2Experts(ShardedByTable, NemotronHMoE):
    """x (B, L, dim) -> (B, L, dim): mlx-lm's `NemotronHMoE` (its gate replicated), the
    experts' and shared expert's partial outputs summed once when split."""

    # llama.cpp's (gguf-py's NEMOTRON_H_MOE tensors: the experts stacked)
    gguf_names = (
        ("ffn_gate_inp", "mixer.gate"),
        ("exp_probs_b.bias$", "mixer.gate.e_score_correction_bias"),
        ("ffn_up_exps", "mixer.switch_mlp.fc1"),
        ("ffn_down_exps", "mixer.switch_mlp.fc2"),
        ("ffn_up_shexp", "mixer.shared_experts.up_proj"),
        ("ffn_down_shexp", "mixer.shared_experts.down_proj"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        def part(unit: str, dim: str, stacked: bool = True) -> TensorSplit:
            return TensorSplit(unit, dim, stacked=stacked, in_place=True)

        tensors = {
            "switch_mlp.fc1": part("expert_ffn", ROWS),
            "switch_mlp.fc2": part("expert_ffn", COLUMNS),
        }
        if args.shared_expert_dim:
            tensors |= {
                "shared_experts.up_proj": part("shared_ffn", ROWS, False),
                "shared_experts.down_proj": part("shared_ffn", COLUMNS, False),
            }
        return SplitTable("experts", tensors, module="summed", plain_when_even=False)

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        return None

    counts_routes = True  # `moe.record_expert_load` counts its routes in `expert_load`

    def __init__(self, args: ModelArgs):
        super().__init__(mlx_lm_args(args))
        object.__setattr__(self, "args", args)  # (not a parameter) its split table's
        self.n_experts = args.n_experts
        object.__setattr__(self, "expert_load", None)

    def __call__(self, x: mx.array) -> mx.array:
        """mlx-lm's forward (no latent projections), counting routes when asked."""
        inds, scores = self.gate(x)
        if self.expert_load is not None:
            counts = mx.zeros((self.n_experts,), mx.int32).at[inds.flatten()].add(1)
            object.__setattr__(self, "expert_load", self.expert_load + counts)
        y = self.switch_mlp(x, inds)
        y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


KINDS = {"M": Mamba2Mixer, "*": NoRopeAttention, "-": Relu2FeedForward, "E": Relu2Experts}


def layer_kinds(args: ModelArgs, i: int) -> dict[str, type[nn.Module]]:
    """Layer i's one mixer, by its pattern character."""
    return {"mixer": KINDS[args.pattern[i]]}


def nemotron_h_fields(config: dict) -> dict:
    """Nemotron-H's fields from its config.json (mlx-lm's reading: the pattern from
    `hybrid_override_pattern` or the block types' names, its defaults)."""
    pattern = MlxArgs.from_dict({**_DEFAULTS, **config}).hybrid_override_pattern
    pattern = "".join(pattern)
    bad = sorted(set(pattern) - set(KINDS))
    if bad:
        raise ValueError(f"model config: layer kind {bad[0]!r} (supported: M, *, -, E)")
    if config.get("moe_latent_size"):
        raise ValueError("model config: moe_latent_size (latent experts) is not supported")
    nh, ng = config["mamba_num_heads"], config["n_groups"]
    if "M" in pattern and (min(nh, ng) < 1 or nh % ng):
        raise ValueError(f"model config: {nh} Mamba heads are not a multiple of {ng} groups")
    experts = config.get("n_routed_experts") or 0
    # mlx-lm's: a shared expert whenever n_shared_experts is given (0 included), as wide as
    # moe_shared_expert_intermediate_size or else intermediate_size
    shared = config.get("moe_shared_expert_intermediate_size") or config["intermediate_size"]
    out = {
        "n_layers": len(pattern),
        "norm_eps": config.get("layer_norm_epsilon", 1e-5),
        "qkv_bias": bool(config.get("attention_bias", False)),
        "o_bias": bool(config.get("attention_bias", False)),
        "mlp_bias": bool(config.get("mlp_bias", False)),
        "head_dim": config.get("head_dim") or 0,
        "extra": {
            "pattern": pattern,
            "mamba_num_heads": nh,
            "mamba_head_dim": config["mamba_head_dim"],
            "mamba_proj_bias": bool(config.get("mamba_proj_bias", False)),
            "ssm_state": config["ssm_state_size"],
            "conv_kernel": config["conv_kernel"],
            "n_groups": ng,
            "use_conv_bias": bool(config.get("use_conv_bias", True)),
            "time_step_limit": list(config.get("time_step_limit") or (0.0, float("inf"))),
        },
    }
    if experts and "E" in pattern:
        out |= {
            "n_experts": experts,
            "n_experts_per_tok": config["num_experts_per_tok"],
            "moe_hidden_dim": config["moe_intermediate_size"],
            "shared_expert_dim": shared if config.get("n_shared_experts") is not None else 0,
            "shared_expert_gated": False,
            "norm_topk_prob": bool(config.get("norm_topk_prob")),  # mlx-lm's None: not
            "router": "sigmoid_group",
            "n_group": config.get("n_group") or 1,
            "topk_group": config.get("topk_group") or 1,
            "routed_scaling_factor": float(config.get("routed_scaling_factor") or 1.0),
            "sparse_layers": [i for i, c in enumerate(pattern) if c == "E"],
        }
    return out


def nemotron_h_gguf_fields(get) -> dict:
    """The same fields from a GGUF file's `nemotron_h.*` / `nemotron_h_moe.*` metadata
    (llama.cpp's converter): the pattern from the per-layer arrays (a KV head count: "*";
    a feed-forward width: "-", or "E" with experts; neither: "M"; the reader checks it
    against the tensors, `checkpoints/gguf_mamba.py`), the Mamba sizes from `ssm.*`
    (time_step_rank heads of inner_size / heads), the experts' count, widths, scale and
    groups."""
    n = (get("block_count") or 0) - (get("nextn_predict_layers") or 0)  # less the MTP's
    kv, ff = get("attention.head_count_kv"), get("feed_forward_length")
    kv = [int(k) for k in kv[:n]] if hasattr(kv, "__len__") else [int(kv or 0)] * n
    ff = [int(f) for f in ff[:n]] if hasattr(ff, "__len__") else [int(ff or 0)] * n
    if len(kv) < n or len(ff) < n:
        raise ValueError(f"attention.head_count_kv / feed_forward_length: not one per layer of {n}")
    experts = get("expert_count") or 0
    pattern = "".join(
        "*" if kv[i] else ("E" if experts else "-") if ff[i] else "M" for i in range(n)
    )
    nh, inner = get("ssm.time_step_rank") or 0, get("ssm.inner_size") or 0
    ng = get("ssm.group_count") or 1
    if "M" in pattern and (nh < 1 or inner % nh or nh % ng):
        raise ValueError(f"ssm: {inner} values in {nh} Mamba heads in {ng} groups")
    out = {
        # the converter writes the config's layer_norm_epsilon as the plain norm's epsilon
        "norm_eps": get("attention.layer_norm_rms_epsilon")
        or get("attention.layer_norm_epsilon")
        or 1e-5,
        # the dense feed-forward's width (the reader takes it from a "-" layer's tensors);
        # with no feed-forward at all, the model's width (unused)
        "hidden_dim": max(ff) or get("embedding_length") or 0,
        "extra": {
            "pattern": pattern,
            "mamba_num_heads": nh,
            "mamba_head_dim": inner // max(nh, 1),
            "mamba_proj_bias": False,
            "ssm_state": get("ssm.state_size") or 0,
            "conv_kernel": get("ssm.conv_kernel") or 0,
            "n_groups": ng,
            "use_conv_bias": True,
            "time_step_limit": [0.0, float("inf")],  # llama.cpp clamps none
        },
    }
    if experts:
        shared = get("expert_shared_feed_forward_length") or 0
        out |= {
            "n_experts": experts,
            "n_experts_per_tok": _one(get, "expert_used_count", pattern),
            "moe_hidden_dim": _one(get, "expert_feed_forward_length", pattern),
            "shared_expert_dim": shared if get("expert_shared_count") else 0,
            "shared_expert_gated": False,
            "norm_topk_prob": bool(get("expert_weights_norm", True)),
            "router": "sigmoid_group",
            "n_group": get("expert_group_count") or 1,
            "topk_group": get("expert_group_used_count") or 1,
            "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
            "sparse_layers": [i for i, c in enumerate(pattern) if c == "E"],
        }
    return out


def _one(get, key: str, pattern: str) -> int:
    """A count the experts' layers share: a number, or a per-layer array's (Nemotron 3
    Puzzle's, one per layer: refused when the experts' layers differ)."""
    value = get(key) or 0
    if not hasattr(value, "__len__"):
        return int(value)
    found = {int(v) for v, c in zip(value[: len(pattern)], pattern, strict=True) if c == "E"}
    if len(found) > 1:
        raise ValueError(f"{key} {sorted(found)}: experts of different sizes per layer")
    return found.pop() if found else 0


# the keys mlx-lm's ModelArgs requires that Nemotron-H configs may leave to their defaults
_DEFAULTS = dict(
    vocab_size=0, hidden_size=0, intermediate_size=0, max_position_embeddings=0,
    num_attention_heads=0, num_key_value_heads=0, attention_bias=False, mamba_num_heads=0,
    mamba_head_dim=0, mamba_proj_bias=False, ssm_state_size=0, conv_kernel=0, n_groups=1,
    mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
)  # fmt: skip


def nemotron_h_config(a: ModelArgs) -> dict:
    """Nemotron-H's config.json keys (mlx-lm's nemotron_h reads them)."""
    out = {
        "hybrid_override_pattern": list(a.pattern),
        "mamba_num_heads": a.mamba_num_heads,
        "mamba_head_dim": a.mamba_head_dim,
        "mamba_proj_bias": a.mamba_proj_bias,
        "ssm_state_size": a.ssm_state,
        "conv_kernel": a.conv_kernel,
        "n_groups": a.n_groups,
        "use_conv_bias": a.use_conv_bias,
        "time_step_limit": list(a.time_step_limit),
        "layer_norm_epsilon": a.norm_eps,
        "attention_bias": a.qkv_bias,
        "mlp_bias": a.mlp_bias,
        "use_bias": False,
    }
    if a.n_experts:
        out |= {
            "n_routed_experts": a.n_experts,
            "num_experts_per_tok": a.n_experts_per_tok,
            "moe_intermediate_size": a.moe_hidden_dim,
            "moe_shared_expert_intermediate_size": a.shared_expert_dim,
            "n_shared_experts": 1 if a.shared_expert_dim else None,
            "norm_topk_prob": a.norm_topk_prob,
            "n_group": a.n_group,
            "topk_group": a.topk_group,
            "routed_scaling_factor": a.routed_scaling_factor,
        }
    return out
