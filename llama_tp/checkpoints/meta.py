"""Original Meta Llama checkpoints: `params.json`, `consolidated.NN.pth`, `tokenizer.model`.

The format of Meta's reference code and of the MLX Llama example. Tensor names
are already the model's (`tok_embeddings`, `layers.N.attention.wq`, ...) and the
q/k rows are in the interleaved RoPE layout, hence `rope_traditional`. A
model-parallel checkpoint has one file per Meta rank, each with a slice of every
projection; they merge back along the axis Meta split (its ColumnParallelLinear
`wq/wk/wv/w1/w3/output` by rows, RowParallelLinear `wo/w2` by columns, the
embedding by columns in Llama 1/2 and by rows in Llama 3), norms are replicated.

The .pth files are read without torch (`pth.py`) and every tensor is copied into
memory when the checkpoint is opened: convert once (`python -m llama_tp.convert`)
and load the converted directory for lazy, per-rank reading.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..model_args import ModelArgs
from .base import Checkpoint, CheckpointError
from .pth import Tensor, as_mx
from .pth import load as load_pth

# Meta's model-parallel layers and the axis each one's weight is split along.
_SPLIT_AXIS = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1}
_REPLICATED = {"attention_norm", "ffn_norm", "norm"}
# Precomputed rotary frequencies (Llama 1); the model computes its own.
_DROP = {"rope.freqs"}
_SHARD = re.compile(r"consolidated\.(\d+)\.pth")


def shard_files(path: Path) -> list[Path]:
    """consolidated.00.pth, consolidated.01.pth, ...: all of them, in order, none missing."""
    found = {int(m.group(1)): f for f in path.iterdir() if (m := _SHARD.fullmatch(f.name))}
    if not found:
        raise CheckpointError(f"{path}: params.json but no consolidated.NN.pth weight files")
    missing = [f"consolidated.{i:02d}.pth" for i in range(max(found) + 1) if i not in found]
    if missing:
        raise CheckpointError(f"{path}: missing {', '.join(missing)} (found {len(found)} shards)")
    return [found[i] for i in sorted(found)]


def read_params(path: Path) -> dict[str, Any]:
    file = path / "params.json"
    try:
        params = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(params, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    missing = [k for k in ("dim", "n_layers", "n_heads") if k not in params]
    if missing:
        raise CheckpointError(f"{file}: missing {', '.join(missing)}")
    return params


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's FeedForward size: 2/3 of 4 * dim, times the multiplier, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _merge(name: str, parts: list[Tensor], dim: int, files: list[Path]) -> np.ndarray:
    """One tensor from its per-file slices (the whole tensor when there is one file)."""
    if len(parts) == 1:
        return parts[0].native()
    leaf = name.split(".")[-2]
    shapes = [p.shape for p in parts]
    if leaf in _REPLICATED:
        axis = None
    elif leaf == "tok_embeddings":
        # ParallelEmbedding (Llama 1/2) splits the vectors; VocabParallelEmbedding the rows.
        axis = 1 if sum(s[1] for s in shapes) == dim else 0
    elif leaf in _SPLIT_AXIS:
        axis = _SPLIT_AXIS[leaf]
    else:
        raise CheckpointError(f"{files[0].parent}: do not know how to merge tensor {name}")
    if axis is None or len(shapes[0]) < 2:
        if any(s != shapes[0] for s in shapes):
            raise CheckpointError(
                f"{files[0].parent}: {name} should be the same in every file, "
                f"but has shapes {', '.join(map(str, shapes))}"
            )
        return parts[0].native()
    other = [s[:axis] + s[axis + 1 :] for s in shapes]
    if any(o != other[0] for o in other):
        raise CheckpointError(
            f"{files[0].parent}: the slices of {name} do not fit together along axis {axis}: "
            f"{', '.join(map(str, shapes))}"
        )
    return np.concatenate([p.native() for p in parts], axis=axis)


def load_weights(files: list[Path], dim: int) -> dict[str, mx.array]:
    """The merged tensors of all shard files, as MLX arrays by the model's names."""
    shards = [load_pth(f) for f in files]
    names = [n for n in shards[0] if n not in _DROP]
    for f, shard in zip(files[1:], shards[1:], strict=True):
        if set(shard) != set(shards[0]):
            diff = sorted(set(shard) ^ set(shards[0]))
            raise CheckpointError(
                f"{f}: holds other tensors than {files[0].name} "
                f"({len(diff)} differ, e.g. {diff[0]})"
            )
    weights = {}
    for name in names:
        parts = [shard.pop(name) for shard in shards]
        weights[name] = as_mx(_merge(name, parts, dim, files), parts[0].bfloat16)
    return weights


def rope_scaling(params: dict[str, Any]) -> dict[str, Any] | None:
    """Llama 3.1's `use_scaled_rope`, as the rope_scaling block mlx-lm and Hugging Face use.

    Meta's reference applies factor 8, low/high frequency factors 1 and 4 and an
    original context of 8192 unless params.json says otherwise.
    """
    if not params.get("use_scaled_rope"):
        return None
    return {
        "rope_type": "llama3",
        "factor": float(params.get("rope_scaling_factor") or 8.0),
        "low_freq_factor": 1.0,
        "high_freq_factor": float(params.get("rope_high_freq_factor") or 4.0),
        "original_max_position_embeddings": 8192,
    }


def args_from_params(params: dict[str, Any], weights: dict[str, mx.array], path: Path) -> ModelArgs:
    """ModelArgs from params.json, with the sizes params.json leaves open read off the weights."""
    file = path / "params.json"
    dim = params["dim"]
    embedding = weights.get("tok_embeddings.weight")
    if embedding is None:
        raise CheckpointError(f"{path}: no tok_embeddings.weight in the weight files")
    vocab = params.get("vocab_size", -1)
    if vocab is None or vocab <= 0:  # Llama 1/2: the size of tokenizer.model
        vocab = embedding.shape[0]
    elif vocab != embedding.shape[0]:
        raise CheckpointError(
            f"{file}: vocab_size {vocab}, but tok_embeddings has {embedding.shape[0]} rows"
        )
    multiple_of = params.get("multiple_of", 256)
    multiplier = params.get("ffn_dim_multiplier")
    try:
        hidden = ffn_hidden_dim(dim, multiple_of, multiplier)
    except (TypeError, ZeroDivisionError) as e:
        raise CheckpointError(f"{file}: bad dim/multiple_of/ffn_dim_multiplier ({e})") from None
    w1 = weights.get("layers.0.feed_forward.w1.weight")
    if w1 is not None and w1.shape[0] != hidden:
        raise CheckpointError(
            f"{file}: dim {dim}, multiple_of {multiple_of} and ffn_dim_multiplier {multiplier} "
            f"give a feed-forward size of {hidden}, but layers.0.feed_forward.w1 has "
            f"{w1.shape[0]} rows"
        )
    theta = float(params.get("rope_theta", 10000.0))
    scaling = rope_scaling(params)
    # params.json does not say the context length: Meta's for Llama 2, 3 and 3.1.
    context = params.get("max_seq_len") or (131072 if scaling else 8192 if theta >= 5e5 else 4096)
    try:
        return ModelArgs(
            dim=dim,
            n_layers=params["n_layers"],
            n_heads=params["n_heads"],
            n_kv_heads=params.get("n_kv_heads") or params["n_heads"],
            hidden_dim=hidden,
            vocab_size=vocab,
            norm_eps=float(params.get("norm_eps", 1e-5)),
            rope_theta=theta,
            rope_traditional=True,
            rope_scaling=scaling,
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in weights,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: {e}") from None


def special_token_ids(path: Path) -> dict[str, int]:
    """bos/eos ids of a sentencepiece tokenizer.model (none for other tokenizers)."""
    import sentencepiece as spm

    file = path / "tokenizer.model"
    if not file.is_file():
        return {}
    try:
        sp = spm.SentencePieceProcessor(model_file=str(file))
    except Exception:  # not sentencepiece (Llama 3's tiktoken file): tokenizer.py says so
        return {}
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id()}
    return {k: v for k, v in ids.items() if v >= 0}


def read(path: Path) -> Checkpoint:
    """The checkpoint in Meta directory `path` (its tensors read into memory, shards merged)."""
    params = read_params(path)
    files = shard_files(path)
    weights = load_weights(files, params["dim"])
    args = args_from_params(params, weights, path)
    metadata = {"params": params, "shards": len(files), **special_token_ids(path)}
    return Checkpoint(
        path=path, format="meta", args=args, weights=weights, metadata=metadata, files=files
    )
