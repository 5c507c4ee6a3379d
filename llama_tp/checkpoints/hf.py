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
from ..models.registry import FAMILIES, MODEL_TYPES, checkpoint_names, unsupported
from .base import Checkpoint, CheckpointError
from .experts import check_experts, per_expert, stack_experts
from .gated_delta import SKIPPED, from_release, is_release, kda_tensors, say_once, text_name
from .kimi_k3 import k3_release, packed_expert
from .latent import split_kv_b
from .mxfp4 import mxfp4_experts, stored_part
from .safetensors import SafetensorsFile

# Hugging Face parameter names -> the model's names: the model's own, then every kind's
# (`models.registry.checkpoint_names`: each mixer kind declares its names).
_MODEL_NAMES = [
    (r"^model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
    # Nemotron-H's (`models/nemotron_h.py`): its layers under `backbone.layers.` (as
    # `model.layers.`, `to_model_name`)
    (r"^backbone\.embeddings\.", "tok_embeddings."),
    (r"^backbone\.norm_f\.", "norm."),
    # Gemma 4's per-layer inputs (`models/gemma.py`)
    (r"^model\.embed_tokens_per_layer\.", "per_layer_embeddings."),
    (r"^model\.per_layer_model_projection\.", "per_layer_projection."),
    (r"^model\.per_layer_projection_norm\.", "per_layer_norm."),
    # Kimi K3's attention residuals' output mix (`models/kimi_k3.py`)
    (r"^model\.output_attn_res_", "output_attn_res_"),
    (r"^model\.output_attn_res\.proj_weight$", "output_attn_res_proj.weight"),  # the release's
    (r"^model\.output_attn_res\.norm_weight$", "output_attn_res_norm.weight"),
]


def _layer_rename(src: str, dst: str) -> tuple[str, str]:
    """A kind's (checkpoint path, model path) under a layer as a regex and replacement."""
    if src.endswith("$"):
        return rf"^model\.layers\.(\d+)\.{re.escape(src[:-1])}$", rf"layers.\1.{dst}"
    return rf"^model\.layers\.(\d+)\.{re.escape(src)}\.", rf"layers.\1.{dst}."


def renames(model_type: str | None = None) -> list[tuple[re.Pattern, str]]:
    """The model's names, then every kind's (the family's own first), compiled."""
    if model_type not in _BY_FAMILY:
        pairs = _MODEL_NAMES + [_layer_rename(a, b) for a, b in checkpoint_names("hf", model_type)]
        _BY_FAMILY[model_type] = [(re.compile(a), b) for a, b in pairs]
    return _BY_FAMILY[model_type]


_BY_FAMILY: dict[str | None, list[tuple[re.Pattern, str]]] = {}
# MLX quantization modes read (and split): affine, and the MXFP4 of gpt-oss's experts
QUANT_MODES = ("affine", "mxfp4")
# The families whose mixture-of-experts block mlx-lm names `block_sparse_moe` (not `mlp`)
BLOCK_SPARSE_MOE = ("mixtral",)
# The DeepSeek-V3 architecture (Kimi K2 is one, mlx-lm reads both with its deepseek_v3;
# DeepSeek-V3.2 and GLM-5 add the indexer: `models/sparse_attention.py`)
DEEPSEEK_V3 = ("deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa")
# The families routed as DeepSeek-V3 (sigmoid, groups, correction bias; `mlp.shared_experts`)
SIGMOID_GROUP = (*DEEPSEEK_V3, "glm4_moe")
_RENAMES = renames()
# Precomputed rotary frequencies some checkpoints carry; the model computes its own.
_DROP = re.compile(r"rotary_emb\.inv_freq$")
_BACKBONE = re.compile(r"^backbone\.layers\.")  # Nemotron-H's layers
# Multimodal wrappers whose language model is a family here (Gemma 3 and 4 as Google
# releases them): their `text_config`, their language model's tensors under
# `model.language_model.` (Hugging Face) or `language_model.model.` (mlx-lm, mlx-vlm),
# the vision and audio towers left out.
WRAPPED = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
_LANGUAGE = re.compile(r"^(?:model\.language_model\.|language_model\.model\.)")
_TOWERS = re.compile(
    r"^(?:model\.)?(?:vision_tower|multi_modal_projector|audio_tower|embed_audio|"
    r"embed_vision|vision_embedder)\."
)


def to_model_name(name: str, model_type: str | None = None) -> str | None:
    """Map a Hugging Face tensor name of a `model_type` checkpoint onto the model's name
    (None: not used)."""
    if _DROP.search(name) or _TOWERS.match(name):
        return None
    name = _LANGUAGE.sub("model.", name).replace("language_model.lm_head.", "lm_head.")
    name = _BACKBONE.sub("model.layers.", name)
    for pattern, repl in renames(model_type):
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
    if config.get("model_type") in WRAPPED:  # the language model's config, as mlx-lm reads it
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(
                f"{path / 'config.json'}: {config['model_type']} without text_config"
            )
        outer = ("quantization", "vocab_size", "eos_token_id", "torch_dtype", "dtype")
        keep = {k: config[k] for k in outer if k in config}
        config = {**text, **keep, "model_type": WRAPPED[config["model_type"]]}
    return config


def language_model(config: dict) -> dict:
    """The language model's config: a release that nests it in `text_config` beside a
    vision tower (Qwen3.5 / 3.6) lifted to the top, under the release's `model_type`; the
    RoPE base of a `rope_parameters` block (transformers 5) as `rope_theta`."""
    text = config.get("text_config")
    if isinstance(text, dict):
        outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        config = {**outer, **text, "model_type": config.get("model_type")}
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" not in config and "rope_theta" in rope:
        config = {**config, "rope_theta": rope["rope_theta"]}
    return config


def moe_fields(config: dict, model_type: str) -> dict:
    """The family's own fields of ModelArgs (experts, routing, latent attention, sinks,
    qk-norm) for `model_type`'s config: its registry row's readers (`models/registry.py`)."""
    family = FAMILIES[model_type]
    out: dict = {"model_type": model_type, "qk_norm": family.qk_norm}
    return out | (family.fields(config) if family.fields else {})


def args_from_config(config: dict, path: Path) -> ModelArgs:
    """ModelArgs from a Hugging Face `config.json` dictionary."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{path / 'config.json'}: {unsupported('model_type', model_type, MODEL_TYPES)}"
        )
    config = language_model(config)
    if model_type == "nemotron_h" and "num_hidden_layers" not in config:
        config = {**config, "num_hidden_layers": 0}  # its pattern's length (its fields)
    if "intermediate_size" not in config and config.get("moe_intermediate_size"):
        # experts in every layer (Qwen3.5-MoE's text_config): no dense width
        config = {**config, "intermediate_size": config["moe_intermediate_size"]}
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
        common = dict(
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
        )
        # the family's fields (its kinds' readers) override the common ones
        return ModelArgs(**(common | moe_fields(config, model_type)))
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
    files: list[Path], skipped: set[str] | None = None, model_type: str | None = None
) -> tuple[dict[str, mx.array], dict[str, tuple[SafetensorsFile, str]]]:
    """Lazily load safetensors files of a `model_type` checkpoint, keyed by the model's
    names; and where each tensor lives, for reading slices of it (headers are checked
    against the sizes). A release's language model under its own names; its vision tower
    and multi-token prediction layers left out (their kinds added to `skipped`)."""
    weights, sources, experts, blocks = {}, {}, {}, {}
    skipped = set() if skipped is None else skipped
    for f in files:
        header = SafetensorsFile(f)  # a truncated file fails here, with the numbers
        try:
            tensors = mx.load(str(f))
        except Exception as e:  # mlx raises RuntimeError/ValueError with a terse text
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
        for stored_name, value in tensors.items():
            name = text_name(stored_name, skipped)
            if name is None:
                continue
            source = header
            if model_type == "kimi_k3":  # the release's packed MXFP4 experts, as MLX's
                name, source, value = packed_expert(name, header, stored_name, value)
            if stacked := per_expert(name):  # one expert's tensor: stacked below
                experts.setdefault(stacked[0], {})[stacked[1]] = (source, stored_name, value)
                continue
            if stored_part(name):  # gpt-oss's MXFP4 blocks: read as the model's, below
                blocks[name] = (header, value)
                continue
            new = to_model_name(name, model_type)
            if new is not None:
                weights[new] = value
                sources[new] = (header, stored_name)
    for name, (value, source) in stack_experts(experts, files[0].parent).items():
        new = to_model_name(name, model_type)
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
    skipped: set[str] = set()
    weights, sources = load_weights(files, skipped, args.model_type)
    if "vision_config" in config:
        skipped.add("vision")
    for kind in sorted(skipped):
        say_once(str(path), SKIPPED[kind])
    if "linear_layers" in args.extra and is_release(weights):
        from_release(weights, sources)  # zero-centred norms, (C, 1, K) convs
    if "kda_layers" in args.extra:
        kda_tensors(weights, sources)  # Kimi's A_log (1, 1, H, 1) flat, release convs
        split_kv_b(weights, sources, args, str(path))  # a release's latent attention
    if args.model_type == "kimi_k3":
        k3_release(weights, sources, args, str(path))  # fused q|k|v, A_log
    if args.model_type in SIGMOID_GROUP:
        _sigmoid_group(weights, sources, args, path)
    shared = [i for i, s in enumerate(args.extra.get("kv_sources") or ()) if s is not None]
    unused = tuple(f"layers.{i}.attention.{p}." for i in shared for p in ("wk", "wv", "k_norm"))
    for name in [k for k in weights if k.startswith(unused)] if unused else ():
        del weights[name]  # Gemma 4's KV-shared layers' keys, never used (mlx-lm drops them)
        sources.pop(name, None)
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
    ckpt = Checkpoint(path, "hf", args, weights, config, files, sources)
    ckpt.notes += [SKIPPED[kind] for kind in sorted(skipped)]
    return ckpt
