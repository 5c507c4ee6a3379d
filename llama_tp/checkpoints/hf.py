"""Hugging Face / MLX directories: `config.json` + `model*.safetensors`.

Covers fp32/fp16/bf16 checkpoints and MLX affine-quantized ones (a
`quantization` block in `config.json`, as in mlx-community 4-bit models).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx

from ..model import ModelArgs
from .base import Checkpoint, CheckpointError
from .safetensors import SafetensorsFile

# Architectures that are the Llama block under another name.
MODEL_TYPES = ("llama", "mistral", "qwen2")

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
]
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


def args_from_config(config: dict, path: Path) -> ModelArgs:
    """ModelArgs from a Hugging Face `config.json` dictionary."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{path / 'config.json'}: unsupported model_type {model_type!r} "
            f"(supported: {', '.join(MODEL_TYPES)})"
        )
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        if k not in config
    ]
    if missing:
        raise CheckpointError(f"{path / 'config.json'}: missing {', '.join(missing)}")
    quant = config.get("quantization") or {}
    if quant.get("mode", "affine") != "affine":
        raise CheckpointError(
            f"{path / 'config.json'}: quantization mode {quant['mode']!r} is not supported "
            "(only MLX affine quantization)"
        )
    attention_bias = bool(config.get("attention_bias", False))
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
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
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
    weights, sources = {}, {}
    for f in files:
        header = SafetensorsFile(f)  # a truncated file fails here, with the numbers
        try:
            tensors = mx.load(str(f))
        except Exception as e:  # mlx raises RuntimeError/ValueError with a terse text
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
        for name, value in tensors.items():
            new = to_model_name(name)
            if new is not None:
                weights[new] = value
                sources[new] = (header, name)
    return weights, sources


def read(path: Path) -> Checkpoint:
    config = read_config(path)
    args = args_from_config(config, path)
    files = weight_files(path)
    weights, sources = load_weights(files)
    if "output.weight" not in weights and not args.tie_word_embeddings:
        # Converters drop lm_head when it equals the embedding.
        args.tie_word_embeddings = True
    if args.tie_word_embeddings:
        weights.pop("output.weight", None)
    return Checkpoint(path, "hf", args, weights, config, files, sources)
