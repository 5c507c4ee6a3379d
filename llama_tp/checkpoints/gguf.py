"""GGUF files (llama.cpp), read natively by MLX.

Q4_0, Q4_1 and Q8_0 tensors come back from `mx.load` as MLX affine-quantized
weight/scales/biases (group size 32) and stay quantized; F32/F16/BF16 load as
they are; MLX converts every other type to float16 (warned once, by name).
llama.cpp's converter permutes q/k rows for interleaved rotary embeddings, so
GGUF models use the interleaved ("traditional") RoPE layout.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import mlx.core as mx

from ..model import ModelArgs
from . import Checkpoint, CheckpointError
from .gguf_header import CONVERTED_TYPES, NATIVE_TYPES, read_header

ARCHITECTURES = ("llama",)

_RENAMES = [
    (r"^token_embd\.", "tok_embeddings."),
    (r"^output_norm\.", "norm."),
    (r"^output\.", "output."),
    (r"^blk\.(\d+)\.attn_q\.", r"layers.\1.attention.wq."),
    (r"^blk\.(\d+)\.attn_k\.", r"layers.\1.attention.wk."),
    (r"^blk\.(\d+)\.attn_v\.", r"layers.\1.attention.wv."),
    (r"^blk\.(\d+)\.attn_output\.", r"layers.\1.attention.wo."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"layers.\1.feed_forward.w1."),
    (r"^blk\.(\d+)\.ffn_down\.", r"layers.\1.feed_forward.w2."),
    (r"^blk\.(\d+)\.ffn_up\.", r"layers.\1.feed_forward.w3."),
    (r"^blk\.(\d+)\.attn_norm\.", r"layers.\1.attention_norm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"layers.\1.ffn_norm."),
]
_RENAMES = [(re.compile(a), b) for a, b in _RENAMES]


def to_model_name(name: str) -> str:
    for pattern, repl in _RENAMES:
        new, n = pattern.subn(repl, name)
        if n:
            return new
    return name


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    if isinstance(value, mx.array):
        return value.item()
    return value


def args_from_metadata(meta: dict, weights: dict[str, mx.array], path: Path) -> ModelArgs:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )

    def get(key, default=None):
        return _scalar(meta, f"{arch}.{key}", default)

    n_heads = get("attention.head_count")
    dim = get("embedding_length")
    if n_heads is None or dim is None or get("block_count") is None:
        raise CheckpointError(f"{path}: GGUF metadata lacks {arch}.* head/size entries")
    vocab = get("vocab_size") or weights["tok_embeddings.weight"].shape[0]
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"type": "linear", "factor": get("rope.scaling.factor", 1.0)}
    if "rope_freqs.weight" in weights:
        warnings.warn(
            f"{path.name}: per-frequency RoPE factors (rope_freqs) are not applied yet; "
            "long-context outputs of Llama-3.1-style models may differ",
            stacklevel=2,
        )
    try:
        return ModelArgs(
            dim=dim,
            n_layers=get("block_count"),
            n_heads=n_heads,
            n_kv_heads=get("attention.head_count_kv") or n_heads,
            hidden_dim=get("feed_forward_length"),
            vocab_size=vocab,
            head_dim=get("attention.key_length") or dim // n_heads,
            norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=get("rope.freq_base", 10000.0),
            rope_traditional=True,
            rope_scaling=scaling,
            max_position_embeddings=get("context_length", 4096),
            tie_word_embeddings="output.weight" not in weights,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def read(path: Path) -> Checkpoint:
    try:
        header = read_header(path)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if header.architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {header.architecture!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    types = {t.type_name for t in header.tensors.values()}
    unreadable = sorted(types - NATIVE_TYPES - CONVERTED_TYPES)
    if unreadable:
        raise CheckpointError(
            f"{path}: tensor types {', '.join(unreadable)} cannot be read by MLX "
            f"(readable: {', '.join(sorted(NATIVE_TYPES | CONVERTED_TYPES))})"
        )
    converted = sorted(types & CONVERTED_TYPES)
    if converted:
        warnings.warn(
            f"{path.name}: tensor types {', '.join(converted)} are not kept quantized; "
            "MLX converts them to float16 (more memory, same results)",
            stacklevel=2,
        )
    try:
        raw, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read GGUF ({e})") from None
    weights = {to_model_name(k): v for k, v in raw.items()}
    args = args_from_metadata(meta, weights, path)
    weights.pop("rope_freqs.weight", None)
    return Checkpoint(path, "gguf", args, weights, meta, files=[path])
