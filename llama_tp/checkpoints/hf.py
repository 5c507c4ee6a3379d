"""Hugging Face / MLX directories: `config.json` + `model*.safetensors`.

Covers fp32/fp16/bf16 checkpoints and MLX affine-quantized ones (a
`quantization` block in `config.json`, as in mlx-community 4-bit models), MXFP4 experts
(MLX's `mxfp4` mode, and gpt-oss's Hugging Face `*_blocks` layout: `mxfp4.py`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx

from ..model_args import ModelArgs
from ..models.registry import MODEL_TYPES, unsupported
from .base import Checkpoint, CheckpointError
from .experts import check_experts, per_expert, stack_experts
from .latent import split_kv_b
from .mxfp4 import mxfp4_experts, stored_part
from .safetensors import SafetensorsFile

# Hugging Face parameter names -> the model's names.
_RENAMES = [
    (r"^model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_proj\.", r"layers.\1.attention.wq."),
    (r"^model\.layers\.(\d+)\.self_attn\.k_proj\.", r"layers.\1.attention.wk."),
    (r"^model\.layers\.(\d+)\.self_attn\.v_proj\.", r"layers.\1.attention.wv."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.attention.wo."),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.", r"layers.\1.feed_forward.w1."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.feed_forward.w2."),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.feed_forward.w3."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attention_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
    # Qwen3's per-head norms
    (r"^model\.layers\.(\d+)\.self_attn\.q_norm\.", r"layers.\1.attention.q_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.k_norm\.", r"layers.\1.attention.k_norm."),
    # Mixtures of experts (experts stacked as mlx-lm stores them; Mixtral's block after Qwen's)
    (r"^model\.layers\.(\d+)\.mlp\.gate\.", r"layers.\1.feed_forward.router."),
    (r"^model\.layers\.(\d+)\.mlp\.switch_mlp\.", r"layers.\1.feed_forward.switch_mlp."),
    (
        r"^model\.layers\.(\d+)\.mlp\.shared_expert\.gate_proj\.",
        r"layers.\1.feed_forward.shared_expert.w1.",
    ),
    (
        r"^model\.layers\.(\d+)\.mlp\.shared_expert\.down_proj\.",
        r"layers.\1.feed_forward.shared_expert.w2.",
    ),
    (
        r"^model\.layers\.(\d+)\.mlp\.shared_expert\.up_proj\.",
        r"layers.\1.feed_forward.shared_expert.w3.",
    ),
    (
        r"^model\.layers\.(\d+)\.mlp\.shared_expert_gate\.",
        r"layers.\1.feed_forward.shared_expert_gate.",
    ),
    # DeepSeek-V3's shared experts (one FeedForward of n_shared_experts experts' width)
    (
        r"^model\.layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.",
        r"layers.\1.feed_forward.shared_expert.w1.",
    ),
    (
        r"^model\.layers\.(\d+)\.mlp\.shared_experts\.down_proj\.",
        r"layers.\1.feed_forward.shared_expert.w2.",
    ),
    (
        r"^model\.layers\.(\d+)\.mlp\.shared_experts\.up_proj\.",
        r"layers.\1.feed_forward.shared_expert.w3.",
    ),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.", r"layers.\1.feed_forward.router."),
    (
        r"^model\.layers\.(\d+)\.block_sparse_moe\.switch_mlp\.",
        r"layers.\1.feed_forward.switch_mlp.",
    ),
    # gpt-oss (mlx-lm's names): the router and the stacked experts
    (r"^model\.layers\.(\d+)\.mlp\.router\.", r"layers.\1.feed_forward.router."),
    (r"^model\.layers\.(\d+)\.mlp\.experts\.", r"layers.\1.feed_forward.switch_mlp."),
    # multi-head latent attention's own projections and norms, under their own names (last:
    # the projections every attention has are named above)
    (r"^model\.layers\.(\d+)\.self_attn\.", r"layers.\1.attention."),
]
# MLX quantization modes read (and split): affine, and the MXFP4 of gpt-oss's experts
QUANT_MODES = ("affine", "mxfp4")
# The families whose mixture-of-experts block mlx-lm names `block_sparse_moe` (not `mlp`)
BLOCK_SPARSE_MOE = ("mixtral",)
# The DeepSeek-V3 architecture (Kimi K2 is one, mlx-lm reads both with its deepseek_v3)
DEEPSEEK_V3 = ("deepseek_v3", "kimi_k2")
# The families routed as DeepSeek-V3 (sigmoid, groups, correction bias; `mlp.shared_experts`)
SIGMOID_GROUP = (*DEEPSEEK_V3, "glm4_moe")
_RENAMES = [(re.compile(a), b) for a, b in _RENAMES]
# Precomputed rotary frequencies some checkpoints carry; the model computes its own.
_DROP = re.compile(r"rotary_emb\.inv_freq$")


def to_model_name(name: str) -> str | None:
    """Map a Hugging Face tensor name onto the model's name (None: not used)."""
    if _DROP.search(name):
        return None
    for pattern, repl in _RENAMES:
        new, n = pattern.subn(repl, name)
        if n:
            return new
    return name


def read_config(path: Path) -> dict:
    try:
        with open(path / "config.json") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / 'config.json'}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / 'config.json'}: expected a JSON object")
    return config


def moe_fields(config: dict, model_type: str) -> dict:
    """The mixture-of-experts and qk-norm fields of ModelArgs for `model_type`'s config."""
    out: dict = {"model_type": model_type, "qk_norm": model_type in ("qwen3", "qwen3_moe")}
    if model_type == "mixtral":
        out |= {
            "n_experts": config.get("num_local_experts", 8),
            "n_experts_per_tok": config.get("num_experts_per_tok", 2),
            "moe_hidden_dim": config["intermediate_size"],
            "router": "topk_softmax",
        }
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        n_layers, step = config["num_hidden_layers"], config.get("decoder_sparse_step", 1) or 1
        dense = set(config.get("mlp_only_layers") or [])
        sparse = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
        out |= {
            "n_experts": config.get("num_experts", 0),
            "n_experts_per_tok": config.get("num_experts_per_tok", 0),
            "moe_hidden_dim": config.get("moe_intermediate_size", 0),
            # Qwen3-MoE has no shared expert: a config that carries the key anyway loads, as
            # in mlx-lm and transformers, which ignore it
            "shared_expert_dim": config.get("shared_expert_intermediate_size", 0)
            if model_type == "qwen2_moe"
            else 0,
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "sparse_layers": None if len(sparse) == n_layers else sparse,
        }
    elif model_type in DEEPSEEK_V3:
        out |= deepseek_v3_fields(config)
    elif model_type == "gpt_oss":
        out |= gpt_oss_fields(config)
    elif model_type == "glm4_moe":
        out |= glm4_moe_fields(config)
    return out


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


def _check_routing(topk_method: str, scoring_func: str) -> None:
    if topk_method != "noaux_tc" or scoring_func != "sigmoid":
        raise ValueError(
            f"model config: routing {topk_method!r} with {scoring_func!r} scores is not "
            "supported (DeepSeek-V3's is 'noaux_tc' with 'sigmoid')"
        )


def glm4_moe_fields(config: dict) -> dict:
    """GLM-4.5's fields: partial rotary, optional q/k norms, DeepSeek-V3's routing and
    shared experts, the first `first_k_dense_replace` layers dense (Hugging Face's
    defaults for the keys a config leaves out)."""
    _check_routing(config.get("topk_method", "noaux_tc"), config.get("scoring_func", "sigmoid"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor = config.get("partial_rotary_factor", 0.5)
    routed = config["n_routed_experts"] or 0
    first = config.get("first_k_dense_replace", 1)
    n_layers = config["num_hidden_layers"]
    sparse = [i for i in range(n_layers) if routed and i >= first]
    return {
        "qk_norm": bool(config.get("use_qk_norm", False)),
        "rope_dims": int(head_dim * factor),
        "n_experts": routed,
        "n_experts_per_tok": config["num_experts_per_tok"] if routed else 0,
        "moe_hidden_dim": config["moe_intermediate_size"],
        "shared_expert_dim": (config.get("n_shared_experts", 1) or 0)
        * config["moe_intermediate_size"],
        "shared_expert_gated": False,
        "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
        "router": "sigmoid_group",
        "n_group": config.get("n_group", 1) or 1,
        "topk_group": config.get("topk_group", 1) or 1,
        "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        "sparse_layers": None if len(sparse) == n_layers else sparse,
    }


def deepseek_v3_fields(config: dict) -> dict:
    """Latent attention and routing fields of a DeepSeek-V3 config (mlx-lm's defaults)."""
    from mlx_lm.models.deepseek_v3 import ModelArgs as DeepseekV3Args

    d = DeepseekV3Args.from_dict(config)
    _check_routing(d.topk_method, d.scoring_func)
    routed = d.n_routed_experts or 0
    freq = d.moe_layer_freq or 1
    sparse = [
        i
        for i in range(d.num_hidden_layers)
        if routed and i >= d.first_k_dense_replace and i % freq == 0
    ]
    return {
        "n_experts": routed,
        "n_experts_per_tok": d.num_experts_per_tok if routed else 0,
        "moe_hidden_dim": d.moe_intermediate_size,
        "shared_expert_dim": (d.n_shared_experts or 0) * d.moe_intermediate_size,
        "shared_expert_gated": False,
        "norm_topk_prob": bool(d.norm_topk_prob),
        "router": "sigmoid_group",
        "n_group": d.n_group,
        "topk_group": d.topk_group,
        "routed_scaling_factor": float(d.routed_scaling_factor),
        "sparse_layers": None if len(sparse) == d.num_hidden_layers else sparse,
        "kv_lora_rank": d.kv_lora_rank,
        "q_lora_rank": d.q_lora_rank or 0,
        "qk_nope_head_dim": d.qk_nope_head_dim,
        "qk_rope_head_dim": d.qk_rope_head_dim,
        "v_head_dim": d.v_head_dim,
    }


def args_from_config(config: dict, path: Path) -> ModelArgs:
    """ModelArgs from a Hugging Face `config.json` dictionary."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{path / 'config.json'}: {unsupported('model_type', model_type, MODEL_TYPES)}"
        )
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        if k not in config
    ]
    if model_type in ("qwen2_moe", "qwen3_moe"):
        keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
        missing += [k for k in keys if k not in config]
    if model_type == "glm4_moe":
        keys = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
        missing += [k for k in keys if k not in config]
    if missing:
        raise CheckpointError(f"{path / 'config.json'}: missing {', '.join(missing)}")
    quant = config.get("quantization") or {}
    if quant.get("mode", "affine") not in QUANT_MODES:
        raise CheckpointError(
            f"{path / 'config.json'}: quantization mode {quant['mode']!r} is not supported "
            f"(supported: {', '.join(QUANT_MODES)})"
        )
    if model_type == "gpt_oss":  # mlx-lm's defaults, and its biases on every projection
        config = {"rope_theta": 150000, "rms_norm_eps": 1e-5, "head_dim": 64, **config}
        config["attention_bias"] = True
    attention_bias = bool(config.get("attention_bias", False))
    if model_type in DEEPSEEK_V3 and attention_bias:
        raise CheckpointError(f"{path / 'config.json'}: attention_bias is not supported")
    try:
        return ModelArgs(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"],
            n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            hidden_dim=config["intermediate_size"],
            vocab_size=config.get("vocab_size", 32000),
            head_dim=config.get("head_dim") or 0,
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta", 10000.0),
            rope_traditional=config.get("rope_traditional", False),
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            # Qwen2 has q/k/v biases and no output bias; Llama's flag covers all four.
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or attention_bias,
            o_bias=attention_bias and model_type != "glm4_moe",  # GLM: q/k/v biases only
            mlp_bias=bool(config.get("mlp_bias", False)),
            **moe_fields(config, model_type),
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a directory, checked against the index if there is one."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{path}: missing weight files {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no model*.safetensors weight files")
    return files


def load_weights(
    files: list[Path],
) -> tuple[dict[str, mx.array], dict[str, tuple[SafetensorsFile, str]]]:
    """Lazily load safetensors files, keyed by the model's names; and where each
    tensor lives, for reading slices of it (headers are checked against the sizes)."""
    weights, sources, experts, blocks = {}, {}, {}, {}
    for f in files:
        header = SafetensorsFile(f)  # a truncated file fails here, with the numbers
        try:
            tensors = mx.load(str(f))
        except Exception as e:  # mlx raises RuntimeError/ValueError with a terse text
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
        for name, value in tensors.items():
            if stacked := per_expert(name):  # one expert's tensor: stacked below
                experts.setdefault(stacked[0], {})[stacked[1]] = (header, name, value)
                continue
            if stored_part(name):  # gpt-oss's MXFP4 blocks: read as the model's, below
                blocks[name] = (header, value)
                continue
            new = to_model_name(name)
            if new is not None:
                weights[new] = value
                sources[new] = (header, name)
    for name, (value, source) in stack_experts(experts, files[0].parent).items():
        new = to_model_name(name)
        weights[new], sources[new] = value, (source, name)
    for name, (value, source) in mxfp4_experts(blocks).items():
        weights[name], sources[name] = value, (source, source.stored)
    return weights, sources


def _sigmoid_group(weights: dict, sources: dict, args: ModelArgs, path: Path) -> None:
    """A DeepSeek-V3 or GLM-4.5 checkpoint's tensors as the model holds them, in place:
    the multi-token prediction layers after the last (layer 61 of DeepSeek-V3, 92 of
    GLM-4.5) dropped, as mlx-lm drops them; DeepSeek's kv_b_proj split into embed_q /
    unembed_out (`latent.py`)."""
    for _, stored in sources.values():
        if stored.endswith(("_scale_inv", "weight_packed")):
            raise CheckpointError(
                f"{path}: {stored}: FP8 / packed int4 weights are not read; convert the "
                "checkpoint with mlx_lm.convert first"
            )
    for name in list(weights):
        m = re.match(r"^layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= args.n_layers:
            del weights[name]
            sources.pop(name, None)
    if args.kv_lora_rank:
        split_kv_b(weights, sources, args, str(path))


def read(path: Path) -> Checkpoint:
    config = read_config(path)
    args = args_from_config(config, path)
    files = weight_files(path)
    weights, sources = load_weights(files)
    if args.model_type in SIGMOID_GROUP:
        _sigmoid_group(weights, sources, args, path)
    if "output.weight" not in weights and not args.tie_word_embeddings:
        # Converters drop lm_head when it equals the embedding.
        args.tie_word_embeddings = True
    if args.tie_word_embeddings:
        weights.pop("output.weight", None)
    key = "num_local_experts" if args.model_type == "mixtral" else "num_experts"
    key = "num_local_experts" if args.model_type == "gpt_oss" else key
    key = "n_routed_experts" if args.model_type in SIGMOID_GROUP else key
    check_experts(
        args,
        {k: tuple(v.shape) for k, v in weights.items()},
        str(path),
        {k: stored for k, (_, stored) in sources.items()},
        f"config.json's {key}",
    )
    return Checkpoint(path, "hf", args, weights, config, files, sources)
