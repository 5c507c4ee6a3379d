"""What `convert` writes for mlx-lm: the family's `config.json` and its tensor names.

The names are the Hugging Face reader's table (`hf.py`) inverted, as mlx-lm stores them
(experts stacked under `switch_mlp`, a Mixtral's block named `block_sparse_moe`), and the
`quantization` block is mlx-lm's: the dominant setting and per-module overrides.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import mlx.nn as nn
import numpy as np
from mlx_lm.models.mla import QuantizedMultiLinear
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from ..models.registry import FAMILIES
from ..models.sparse_attention import indexer_config
from .base import Checkpoint, CheckpointError
from .hf import BLOCK_SPARSE_MOE, DEEPSEEK_V3, SIGMOID_GROUP, renames, to_model_name


def _invert(pattern: re.Pattern, repl: str) -> tuple[re.Pattern, str]:
    r"""Swap the sides of one rename.

    `^model\.layers\.(\d+)\.x\.` -> `layers.\1.y.` becomes
    `^layers\.(\d+)\.y\.` -> `model.layers.\1.x.`.
    """
    src = "^" + re.escape(repl).replace(re.escape("\\1"), r"(\d+)")
    dst = (
        pattern.pattern.removeprefix("^")
        .replace(r"(\d+)", r"\1")
        .replace("\\.", ".")
        .removesuffix("$")
    )
    return re.compile(src), dst


GATED_DELTA = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # the families with linear_attn layers
# Nemotron-H's model-level names (mlx-lm's `backbone`)
_NEMOTRON_H = {
    "model.layers.": "backbone.layers.",
    "model.embed_tokens.": "backbone.embeddings.",
    "model.norm.": "backbone.norm_f.",
}
_BACKBONE = re.compile("^(?:" + "|".join(map(re.escape, _NEMOTRON_H)) + ")")


def hf_name(name: str, model_type: str = "llama") -> str:
    """The Hugging Face name (as mlx-lm stores it) of the model's tensor `name` in a
    `model_type` model (checked against the reader): the HF reader's table, inverted."""
    first = "block_sparse_moe" if model_type in BLOCK_SPARSE_MOE else "mlp."
    first = "shared_experts" if model_type in (*SIGMOID_GROUP, "kimi_linear") else first
    inverted = [_invert(p, r) for p, r in renames(model_type)]
    # a kind's module prefix (`linear_attn.`) round-trips for any tensor under its slot:
    # only the families that have that kind may take it
    gated = model_type in GATED_DELTA
    for pattern, repl in sorted(inverted, key=lambda r: first not in r[1]):
        if ".linear_attn." in repl and not gated:
            continue
        new, n = pattern.subn(repl, name)
        if n and model_type == "nemotron_h":  # mlx-lm's names under `backbone.`
            new = _BACKBONE.sub(lambda m: _NEMOTRON_H[m.group(0)], new)
        if n and to_model_name(new, model_type) == name:
            family = FAMILIES.get(model_type)
            return (family.prefix if family else "") + new
    raise CheckpointError(f"tensor {name!r} has no Hugging Face name")


def _f32(x: float) -> float:
    """The shortest decimal that is the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(x)))


def token_ids(ckpt: Checkpoint) -> tuple[int | None, int | list[int] | None]:
    """(bos, eos) ids: GGUF metadata keys, or the source's own config."""
    if ckpt.format != "gguf":
        return ckpt.metadata.get("bos_token_id"), ckpt.metadata.get("eos_token_id")
    meta = ckpt.metadata

    def get(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if value is None else int(value.item() if hasattr(value, "item") else value)

    eos = list(dict.fromkeys(i for i in map(get, ("eos", "eot", "eom")) if i is not None))
    return get("bos"), (eos[0] if len(eos) == 1 else eos or None)


def quantized_modules(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Module path -> (group_size, bits) of every quantized layer (stacked experts too,
    when affine: MXFP4 experts keep their own mode)."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, QuantizedSwitchLinear) and m.mode == "affine":
            out[path] = (m.group_size, m.bits)
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedMultiLinear)):
            if m.mode != "affine":
                raise CheckpointError(f"{path}: unsupported quantization mode {m.mode!r}")
            out[path] = (m.group_size, m.bits)
    return out


def quantization(model: nn.Module) -> dict[str, Any] | None:
    """mlx-lm's `quantization` block: the dominant setting plus per-module overrides."""
    per_module = quantized_modules(model)
    params: Counter[tuple[int, int]] = Counter()
    for path, m in model.named_modules():
        if path in per_module:
            params[per_module[path]] += m.weight.size * 32 // m.bits
    if not params:
        return None
    (group_size, bits), _ = params.most_common(1)[0]
    block: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    model_type = model.args.model_type
    names = ((hf_name(f"{p}.weight", model_type), s) for p, s in per_module.items())
    for path, (g, b) in sorted(names):
        if (g, b) != (group_size, bits):
            block[path.removesuffix(".weight")] = {"group_size": g, "bits": b}
    return block


_ARCHITECTURES = {t: f.architecture for t, f in FAMILIES.items() if f.architecture}


def _first_dense(a: Any) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq) of the model's expert layers."""
    sparse = [i for i in range(a.n_layers) if a.is_sparse(i)]
    first = sparse[0] if sparse else a.n_layers
    freq = sparse[1] - sparse[0] if len(sparse) > 1 else 1
    if sparse != [i for i in range(first, a.n_layers) if i % freq == 0]:
        raise CheckpointError(
            f"expert layers {sparse} are not first_k_dense_replace / moe_layer_freq"
        )
    return first, freq


def _glm4_moe_config(a: Any) -> dict[str, Any]:
    """GLM-4.5's keys: DeepSeek-V3's routing, partial rotary, q/k norms and biases."""
    first, freq = _first_dense(a)
    if freq != 1:
        raise CheckpointError(f"glm4_moe: expert layers every {freq} layers cannot be written")
    return {
        "n_routed_experts": a.n_experts or None,
        "num_experts_per_tok": a.n_experts_per_tok,
        "moe_intermediate_size": a.moe_hidden_dim,
        "n_shared_experts": a.shared_expert_dim // a.moe_hidden_dim
        if a.shared_expert_dim
        else None,
        "routed_scaling_factor": a.routed_scaling_factor,
        "norm_topk_prob": a.norm_topk_prob,
        "n_group": a.n_group,
        "topk_group": a.topk_group,
        "first_k_dense_replace": first,
        "use_qk_norm": a.qk_norm,
        "partial_rotary_factor": (a.rope_dims or a.head_dim) / a.head_dim,
        "rope_scaling": a.rope_scaling,
    }


def _deepseek_v3_config(a: Any) -> dict[str, Any]:
    """The latent attention and routing keys of a DeepSeek-V3 `config.json` (and
    DeepSeek-V3.2's / GLM-5's indexer)."""
    first, freq = _first_dense(a)
    indexer = indexer_config(a) if "index_topk" in a.extra else {}
    return indexer | {
        "n_routed_experts": a.n_experts or None,
        "num_experts_per_tok": a.n_experts_per_tok,
        "moe_intermediate_size": a.moe_hidden_dim,
        "n_shared_experts": a.shared_expert_dim // a.moe_hidden_dim
        if a.shared_expert_dim
        else None,
        "routed_scaling_factor": a.routed_scaling_factor,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": a.norm_topk_prob,
        "n_group": a.n_group,
        "topk_group": a.topk_group,
        "first_k_dense_replace": first,
        "moe_layer_freq": freq,
        "q_lora_rank": a.q_lora_rank or None,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
    }


def _experts_config(a: Any) -> dict[str, Any]:
    """The mixture-of-experts keys of `config.json`, as the family's mlx-lm model reads them."""
    if a.model_type in DEEPSEEK_V3:
        return _deepseek_v3_config(a)
    if a.model_type == "glm4_moe":
        return _glm4_moe_config(a)
    if not a.n_experts:
        return {}
    if a.model_type == "mixtral":
        return {"num_local_experts": a.n_experts, "num_experts_per_tok": a.n_experts_per_tok}
    out = {
        "num_experts": a.n_experts,
        "num_experts_per_tok": a.n_experts_per_tok,
        "moe_intermediate_size": a.moe_hidden_dim,
        "norm_topk_prob": a.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(a.n_layers) if not a.is_sparse(i)],
    }
    if a.shared_expert_dim:
        out["shared_expert_intermediate_size"] = a.shared_expert_dim
    return out


def _family_config(a: Any) -> dict[str, Any]:
    """The family's own keys: its registry row's writer, or the experts' keys above."""
    keys = FAMILIES[a.model_type].config_keys
    return keys(a) if keys is not None else _experts_config(a)


def hf_config(ckpt: Checkpoint, model: nn.Module) -> dict[str, Any]:
    """`config.json` for mlx-lm's model of the family (and llama_tp's HF reader)."""
    a = ckpt.args
    if a.model_type not in _ARCHITECTURES:
        raise CheckpointError(f"convert does not write {a.model_type} folders yet")
    bos, eos = token_ids(ckpt)
    qwen2 = a.model_type in ("qwen2", "qwen2_moe")  # q/k/v biases implied by the family
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[a.model_type]],
        "model_type": a.model_type,
        "hidden_size": a.dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "intermediate_size": a.hidden_dim,
        "vocab_size": a.vocab_size,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(a.norm_eps),
        "rope_theta": _f32(a.rope_theta),
        "rope_traditional": a.rope_traditional,
        "max_position_embeddings": a.max_position_embeddings,
        "tie_word_embeddings": a.tie_word_embeddings,
        "attention_bias": a.o_bias if qwen2 else a.qkv_bias,
        "mlp_bias": a.mlp_bias,
        **_family_config(a),
    }
    if a.rope_scaling:
        config["rope_scaling"] = a.rope_scaling
    if bos is not None:
        config["bos_token_id"] = bos
    if eos is not None:
        config["eos_token_id"] = eos
    if (quant := quantization(model)) is not None:
        # mlx-lm's save_config writes the block under both names (for HF tooling).
        config["quantization"] = config["quantization_config"] = quant
    return dict(sorted(config.items()))
