"""GGUF files of the DeepSeek-V3 (`deepseek2`) and GLM-4.5 (`glm4moe`) architectures,
and of the sparse-attention ones built on deepseek2, GLM-5 (`glm-dsa`) and DeepSeek-V3.2
(`deepseek32`): their tensor names and metadata, as llama.cpp's converter writes them.

Both route as DeepSeek-V3 (sigmoid scores, `exp_probs_b.bias` the score-correction bias,
`{arch}.expert_group_count` / `expert_group_used_count` groups, `expert_weights_scale`,
`expert_weights_norm`), have ungated shared experts (`ffn_*_shexp`) and
`leading_dense_block_count` dense layers first, and may carry multi-token prediction
layers after the last (`{arch}.nextn_predict_layers`, counted in `block_count`), which
are dropped as mlx-lm drops them.

deepseek2's latent attention: older conversions store `attn_kv_b` (each head's key then
value rows over the latent: read per head by `latent.py`); newer ones split it into
`attn_k_b` (H, kv_lora_rank, qk_nope_head_dim) and `attn_v_b` (H, v_head_dim,
kv_lora_rank): exactly mlx-lm's `embed_q` and `unembed_out`. Their metadata then says
the latent sizes (`key_length` = kv_lora_rank + rope, `value_length` = kv_lora_rank,
`head_count_kv` 1) and the per-head ones in `key_length_mla` / `value_length_mla`.
glm-dsa / deepseek32: deepseek2's (the newer conversion) plus the lightning indexer's
four tensors per layer, `blk.N.indexer.{attn_q_b,attn_k,k_norm,proj}` (mlx-lm's wq_b, wk,
the LayerNorm k_norm's weight and bias, weights_proj: as stored, no permutation) and
`{arch}.attention.indexer.{head_count,key_length,top_k}`. llama.cpp rotates the indexer's
keys on pairs (NORM) in glm-dsa and on halves (NEOX) in deepseek32: mlx-lm's
`indexer_rope_interleave` True and False, the families' defaults. Files whose layers
share an earlier layer's top-k (GLM-5.2's `attention.indexer.types`) are refused.
glm4moe: attention as Qwen's (q/k/v biases, q/k norms), `rope.dimension_count` of each
head rotated on its halves (NEOX), `post_attention_norm` the feed-forward's norm.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .base import CheckpointError

ARCHITECTURES = {"deepseek2": "deepseek_v3", "glm4moe": "glm4_moe"}
ARCHITECTURES |= {"glm-dsa": "glm_moe_dsa", "deepseek32": "deepseek_v32"}
# the sparse ones: latent attention as deepseek2's, and whether llama.cpp rotates the
# indexer's keys on interleaved pairs (glm-dsa: LLAMA_ROPE_TYPE_NORM) or halves (NEOX)
_INDEXER_INTERLEAVED = {"glm-dsa": True, "deepseek32": False}
_LATENT = ("deepseek2", *_INDEXER_INTERLEAVED)
_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax, DeepSeek-V2)


def main_layers(arch: str, get: Callable[..., Any]) -> int:
    """The model's layers: `block_count` less the multi-token prediction layers."""
    return get("block_count") - (get("nextn_predict_layers") or 0)


def drop_extra_layers(weights: dict, sources: dict, n_layers: int) -> None:
    """Remove, in place, the tensors of layers `n_layers` and after (multi-token
    prediction: `blk.N.nextn.*` and that layer's attention and experts)."""
    for name in list(weights):
        m = re.match(r"^(?:layers|blk)\.(\d+)\.", name)
        if m and int(m.group(1)) >= n_layers:
            del weights[name], sources[name]


def routing_fields(arch: str, get: Callable[..., Any], path: Path) -> dict:
    """DeepSeek-V3's routing from the `{arch}.*` metadata (llama.cpp's defaults: no
    renormalisation, scale 1, one group)."""
    # llama.cpp takes glm-dsa's as sigmoid when the file does not say
    gating = get("expert_gating_func", _SIGMOID if arch == "glm-dsa" else None)
    if gating != _SIGMOID:
        raise CheckpointError(
            f"{path}: {arch}.expert_gating_func is {gating} (softmax routing, DeepSeek-V2's, "
            f"when missing or 1): only sigmoid routing ({_SIGMOID}) is read"
        )
    return {
        "router": "sigmoid_group",
        "shared_expert_gated": False,
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
        "n_group": get("expert_group_count") or 1,
        "topk_group": get("expert_group_used_count") or 1,
    }


def latent_fields(arch: str, get: Callable[..., Any], path: Path) -> dict:
    """deepseek2's latent attention sizes (both conversions' metadata)."""
    rope, rank = get("rope.dimension_count"), get("attention.kv_lora_rank")
    key = get("attention.key_length_mla") or get("attention.key_length")
    value = get("attention.value_length_mla") or get("attention.value_length")
    if not (rope and rank and key and value) or key <= rope:
        raise CheckpointError(
            f"{path}: {arch} latent attention needs rope.dimension_count, "
            f"attention.kv_lora_rank and key/value lengths; got {rope}, {rank}, {key}, {value}"
        )
    return {
        "kv_lora_rank": rank,
        "q_lora_rank": get("attention.q_lora_rank") or 0,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key - rope,
        "v_head_dim": value,
    }


def rope_scaling(get: Callable[..., Any]) -> dict | None:
    """DeepSeek-V3's YaRN from `rope.scaling.*` (llama.cpp keeps one log multiplier:
    0.1 * mscale_all_dim; mlx-lm's mscale and mscale_all_dim are both taken from it,
    as in DeepSeek-V3's own config where both are 1)."""
    if get("rope.scaling.type") != "yarn":
        return None
    # the float32 the file holds as its shortest decimal (0.1, not 0.100000001)
    mscale = float(f"{get('rope.scaling.yarn_log_multiplier') or 0.0:.7g}") / 0.1
    return {
        "type": "yarn",
        "factor": get("rope.scaling.factor", 1.0),
        "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        "mscale": mscale,
        "mscale_all_dim": mscale,
        "beta_fast": 32,
        "beta_slow": 1,
    }


def indexer_fields(arch: str, get: Callable[..., Any], path: Path) -> dict:
    """The lightning indexer's fields (`ModelArgs.extra`, as `sparse_attention.sparse_fields`
    reads a config's) from `{arch}.attention.indexer.*`."""
    sizes = [get(f"attention.indexer.{k}") for k in ("head_count", "key_length", "top_k")]
    if not all(sizes):
        raise CheckpointError(
            f"{path}: {arch} needs attention.indexer.head_count, key_length and top_k; "
            f"got {', '.join(map(str, sizes))}"
        )
    types = get("attention.indexer.types")
    shared = types is not None and not all(types)
    # llama.cpp takes GLM-5.2's pattern for a 1M-token glm-dsa file that does not say
    shared |= types is None and arch == "glm-dsa" and (get("context_length") or 0) >= 1 << 20
    if shared:
        raise CheckpointError(
            f"{path}: {arch} layers that reuse an earlier layer's top-k (GLM-5.2's "
            "attention.indexer.types) are not read: every layer's indexer is its own here"
        )
    heads, width, top = (int(v) for v in sizes)
    return {
        "extra": {
            "index_n_heads": heads,
            "index_head_dim": width,
            "index_topk": top,
            "indexer_rope_interleave": _INDEXER_INTERLEAVED[arch],
        }
    }


def fields(arch: str, get: Callable[..., Any], path: Path) -> dict:
    """The ModelArgs fields of a deepseek2, glm4moe, glm-dsa or deepseek32 file beyond
    the common ones."""
    out = routing_fields(arch, get, path) if get("expert_count") else {}
    if arch in _LATENT:
        out |= latent_fields(arch, get, path)
        out["rope_scaling"] = rope_scaling(get)
    else:
        out["rope_dims"] = get("rope.dimension_count") or 0
    if arch in _INDEXER_INTERLEAVED:
        out |= indexer_fields(arch, get, path)
    return out
