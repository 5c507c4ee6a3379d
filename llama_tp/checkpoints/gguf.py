"""GGUF files (llama.cpp): every tensor read in slices and kept quantized.

The header (`gguf_header.py`) gives the metadata and where each tensor is; the
weights are lazy placeholders until the loader reads each rank's slices through
`ckpt.sources` (`gguf_reader.py`), converting the blocks to MLX affine
quantization (`gguf_quants.py`: exact for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K,
requantized for Q6_K/Q3_K/Q2_K). Types MLX cannot hold (the IQ family, TQ,
MXFP4, ...) are refused with one line naming them and their tensors.
llama.cpp's converter permutes q/k rows for interleaved rotary embeddings, so
GGUF models use the interleaved ("traditional") RoPE layout.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from pathlib import Path

import mlx.core as mx

from ..model import ModelArgs
from . import gguf_quants as gq
from .base import Checkpoint, CheckpointError
from .gguf_header import GGUFHeader, read_header
from .gguf_reader import _MX, GGUFFile

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
    """ModelArgs from the `{arch}.*` metadata (the vocabulary size from the embedding
    if the metadata lacks it)."""
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


def check_types(header: GGUFHeader, path: Path) -> None:
    """Refuse, in one line naming the tensors, types this reader cannot hold."""
    unknown = [(n, t.type_name) for n, t in header.tensors.items() if t.nbytes is None]
    if unknown:
        name, kind = unknown[0]
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise CheckpointError(
            f"{path}: tensor {name!r} has unknown ggml type id {kind.split()[-1]}{more}: "
            "damaged, or newer than this reader"
        )
    bad: dict[str, list[str]] = {}
    for name, t in header.tensors.items():
        if t.type_name not in _MX and t.type_name not in gq.BLOCKS:
            bad.setdefault(t.type_name, []).append(name)
    if bad:
        kinds = "; ".join(
            f"{k} ({names[0]}" + (f", +{len(names) - 1} more)" if len(names) > 1 else ")")
            for k, names in sorted(bad.items())
        )
        raise CheckpointError(
            f"{path}: tensor types MLX cannot hold quantized: {kinds}; supported: "
            f"{', '.join([*_MX, *gq.BLOCKS])}"
        )


def describe(file: GGUFFile) -> list[str]:
    """One line per GGUF type: what it became, e.g. `Q6_K -> 8-bit (requantized), 1 tensor`."""
    counts = Counter(t.type_name for t in file.gguf.values())
    stored = {t.type_name for n, t in file.gguf.items() if file.block_type(n)}
    out = []
    for kind, n in sorted(counts.items()):
        what = "as it is" if kind in _MX else f"MLX {gq.mlx_bits(kind)}-bit, group {gq.GROUP}"
        if kind in stored:
            what = "as stored (native kernels)"
        elif kind in gq.REQUANT_BITS:
            what += " (requantized)"
        elif kind in gq.EXACT_BITS:
            what += " (exact)"
        out.append(f"{kind} -> {what}: {n} tensor{'s' * (n > 1)}")
    return out


def ffn_block(file: GGUFFile) -> int | None:
    """Values per GGUF block along ffn_down's rows (the feed-forward split axis), as one
    unit for every layer (256 for K-quants); None when ffn_down is not quantized."""
    blocks = [
        t.block[0]
        for n, t in file.gguf.items()
        if n.endswith("ffn_down.weight") and t.type_name in gq.BLOCKS
    ]
    return math.lcm(*blocks) if blocks else None


def split_notes(ckpt: Checkpoint, plan) -> list[str]:
    """How a partition plan meets the file's blocks (for `llama_tp.plan`)."""
    file = next(iter(ckpt.sources.values()))[0]
    out = []
    if ckpt.ffn_block and plan.n > 1:
        if plan.group_size and plan.group_size % ckpt.ffn_block == 0:
            out.append(
                f"feed-forward columns split in units of {plan.group_size}: whole GGUF blocks "
                f"of ffn_down ({ckpt.ffn_block} values)"
            )
        else:
            out.append(
                f"feed-forward columns split in units of {plan.group_size}: ffn_down's GGUF "
                f"blocks of {ckpt.ffn_block} values do not split over {plan.n} ranks, so a "
                "boundary block is read by both neighbours (each keeps its own 32-value groups)"
            )
    straddled = sorted(
        {
            t.type_name
            for n, t in file.gguf.items()
            if n.endswith("attn_output.weight")
            and t.block[0] > gq.GROUP
            and any(p.q_heads.start * plan.head_dim % t.block[0] for p in plan.parts)
        }
    )
    if straddled:
        out.append(
            f"attn_output ({', '.join(straddled)}): query-head boundaries fall inside GGUF "
            "blocks; both neighbours read the boundary block (each keeps its own 32-value groups)"
        )
    if plan.n > 1:
        out.append("vocabulary rows split anywhere: GGUF blocks lie within rows")
    return out


def read(path: Path, blocks: bool = False) -> Checkpoint:
    """The checkpoint of a GGUF file; with `blocks`, its quantized tensors stay as stored
    (for the native kernels: `ckpt.blocks` maps their model names to GGUF types)."""
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
    check_types(header, path)
    file = GGUFFile(path, header, blocks)
    weights, sources, kept = {}, {}, {}
    for stored in file.tensors:
        name = to_model_name(stored)
        weights[name] = file.placeholder(stored)
        sources[name] = (file, stored)
        if file.block_type(stored):
            kept[name] = file.block_type(stored)
    args = args_from_metadata(header.metadata, weights, path)
    for name in [k for k in weights if k.startswith("rope_freqs.")]:
        del weights[name], sources[name]
    ckpt = Checkpoint(path, "gguf", args, weights, header.metadata, [path], sources)
    ckpt.ffn_block = ffn_block(file)
    ckpt.blocks = kept
    ckpt.notes = describe(file)
    return ckpt
