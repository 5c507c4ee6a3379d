"""GGUF files of gpt-oss (llama.cpp's `gpt-oss` architecture, LLM_ARCH_OPENAI_MOE), as
llama.cpp's converter writes them from the Hugging Face release.

    blk.N.attn_sinks.weight                  (heads,)        -> layers.N.attention.sinks
    blk.N.attn_{q,k,v,output}.{weight,bias}  with biases     (the core attention's names)
    blk.N.post_attention_norm.weight         the feed-forward's norm (`TransformerBlock.gguf_names`)
    blk.N.ffn_gate_inp.{weight,bias}         the biased router
    blk.N.ffn_{gate,up,down}_exps.{weight,bias}  stacked experts, MXFP4 weights

The release's interleaved `gate_up_proj` is split by the converter into separate
`ffn_gate_exps` (its even rows) and `ffn_up_exps` (its odd rows), so a rank reads its
rows of each as of any stacked experts. The MXFP4 weights are held in MLX's `mxfp4`
mode as stored (`gguf_quants.mxfp4_to_mlx`: the nibbles reordered, never dequantized),
and split per rank on whole 32-value blocks as any quantized tensor.

The metadata names what llama.cpp reads: `expert_count`, `expert_used_count`,
`expert_feed_forward_length`, `attention.sliding_window`, and YaRN's
`rope.scaling.{type,factor,original_context_length,yarn_beta_fast,yarn_beta_slow}`.
What llama.cpp fixes in code rather than reading is fixed here the same way: every
other layer slides, the first included (`set_swa_pattern(2)`, the release's
`layer_types`), the clamped SwiGLU's limit 7, the router's top-k then softmax over those
k, RoPE on the halves of each head (NEOX: q/k rows are not permuted).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .base import CheckpointError

ARCHITECTURES = {"gpt-oss": "gpt_oss"}
_SWIGLU_LIMIT = 7.0  # llama.cpp's build_moe_ffn for LLM_FFN_SWIGLU_OAI_MOE
# YaRN keys llama.cpp would apply that mlx-lm's YarnRoPE has no place for: their neutral value
_YARN_NEUTRAL = {"yarn_attn_factor": 1.0, "yarn_ext_factor": 1.0, "yarn_log_multiplier": 0.0}


def rope_scaling(get: Callable[..., Any], path: Path) -> dict | None:
    """gpt-oss's YaRN as mlx-lm's YarnRoPE takes it (no `mscale` keys: mlx-lm's defaults
    give the attention factor 0.1 * ln(factor) + 1 that llama.cpp applies); a file
    asking for another attention or extrapolation factor is refused."""
    if get("rope.scaling.type") != "yarn":
        return None
    for key, neutral in _YARN_NEUTRAL.items():
        value = get(f"rope.scaling.{key}")
        if value is not None and value not in (neutral, -1.0):  # -1: llama.cpp's "unset"
            raise CheckpointError(
                f"{path}: gpt-oss.rope.scaling.{key} is {value}: only gpt-oss's own YaRN "
                f"({key} {neutral}) is read"
            )
    return {
        "type": "yarn",
        "factor": get("rope.scaling.factor", 1.0),
        "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0),
    }


def fields(arch: str, get: Callable[..., Any], path: Path) -> dict:
    """The ModelArgs fields of a gpt-oss file beyond the common ones (as
    `hf.gpt_oss_fields` gives them for the release's config.json)."""
    window, n_layers = get("attention.sliding_window"), get("block_count")
    if not window:
        raise CheckpointError(
            f"{path}: {arch}.attention.sliding_window is {window}: gpt-oss's sliding-window "
            "layers need a window of 1 or more tokens"
        )
    return {
        "router": "topk_softmax",
        "norm_topk_prob": False,
        "expert_bias": True,
        "activation": "swiglu_oai",
        "swiglu_limit": _SWIGLU_LIMIT,
        "attention_sinks": True,
        "sliding_window": window,
        "layer_types": ["sliding_attention", "full_attention"] * (n_layers // 2)
        + ["sliding_attention"] * (n_layers % 2),
        "o_bias": True,
        "rope_scaling": rope_scaling(get, path),
    }
