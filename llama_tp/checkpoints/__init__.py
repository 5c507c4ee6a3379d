"""Checkpoint readers: each format yields (ModelArgs, weights by the model's names).

`open_checkpoint(path)` picks the reader from what the path is: a `.gguf`
file, or a Hugging Face / MLX directory (`config.json` + `*.safetensors`).
Weights stay lazy: nothing is read until the model evaluates them.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

from ..cluster.distributed import first_line
from .base import Checkpoint, CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "open_checkpoint", "quantization_of"]


def open_checkpoint(
    path: str | Path, rank: int = 0, size: int = 1, blocks: bool = False
) -> Checkpoint:
    """Read the config and (lazily) the weights of a checkpoint at `path`.

    A checkpoint pre-split by `convert --shards N` opens as the folder of
    `rank` (of `size` ranks), which must be the N it was split for. `blocks`: a GGUF
    file's quantized tensors stay as stored, for the native kernels (`llama_tp.kernels`).
    """
    from . import gguf, hf, split

    p = Path(path)
    if not p.exists() and _REPO_ID.match(str(path)):
        p = _download(str(path))
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if split.is_split(p):
        return split.read(split.rank_dir(p, rank, size), rank, size)
    if p.is_file():
        return gguf.read(p, blocks)
    if (p / "config.json").is_file():
        return hf.read(p)
    if (p / "params.json").is_file():
        from . import meta  # original Meta checkpoint: params.json + consolidated.*.pth

        return meta.read(p)
    raise CheckpointError(
        f"{p}: not a model: expected a .gguf file or a directory with config.json "
        "(or params.json and consolidated.*.pth)"
    )


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _download(repo: str) -> Path:
    """A Hugging Face hub repo id, fetched (or found in the cache) as mlx-lm does."""
    from mlx_lm.utils import _download as mlx_lm_download

    try:
        return Path(mlx_lm_download(repo))
    except Exception as e:
        raise CheckpointError(
            f"{repo}: not a local path, and fetching it from the Hugging Face hub failed "
            f"({first_line(e)})"
        ) from None


def quantization_of(
    weights: dict[str, mx.array], path: str, in_dims: int
) -> dict[str, int | str] | None:
    """Bits and group size of a quantized tensor, read off its shapes.

    MLX's affine quantization packs `in_dims` values into `in_dims * bits / 32`
    uint32 columns with one scale and bias per `group_size` values, so both
    numbers follow from the stored shapes (this also covers GGUF tensors, which
    `gguf_reader.py` presents in the same form with group size 32).
    """
    scales = weights.get(f"{path}.scales")
    if scales is None:
        return None
    packed = weights[f"{path}.weight"].shape[-1]
    bits, group_size = packed * 32 // in_dims, in_dims // scales.shape[-1]
    if f"{path}.biases" in weights or scales.dtype != mx.uint8:
        return {"bits": bits, "group_size": group_size}
    # MLX's microscaled modes keep one uint8 exponent per group and no biases
    if (bits, group_size) != (4, 32):
        raise CheckpointError(
            f"{path}: {bits}-bit values in groups of {group_size} with uint8 scales: only "
            "MXFP4 (4 bits, groups of 32) and affine quantization are read"
        )
    return {"bits": bits, "group_size": group_size, "mode": "mxfp4"}
