"""The checkpoint record every reader returns, and its error."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..model_args import ModelArgs


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: the message names the file and the problem."""


@dataclass
class Checkpoint:
    path: Path
    format: str  # "hf", "gguf" or "split" (one rank's folder of a pre-split checkpoint)
    args: ModelArgs
    weights: dict[str, mx.array]  # lazy, by the model's parameter names
    metadata: dict[str, Any] = field(default_factory=dict)  # GGUF metadata, config.json
    files: list[Path] = field(default_factory=list)  # the weight files
    # model name -> (file, stored name) where tensors can be read in slices (safetensors)
    sources: dict[str, tuple[Any, str]] = field(default_factory=dict)
    load_stats: dict[str, Any] = field(default_factory=dict)  # filled in by the loader
    # Values per quantization block along the feed-forward split axis, when the file's
    # blocks are wider than MLX groups (GGUF K-quants: 256): the plan splits on them.
    ffn_block: int | None = None
    notes: list[str] = field(default_factory=list)  # what the reader converted (--verbose)
    # model weight name -> GGUF type, for tensors kept as the file's blocks (native kernels)
    blocks: dict[str, str] = field(default_factory=dict)
    products: str = ""  # what computes the matrix products (the loader's; --verbose)
    mesh: Any = None  # the loader's parallel.mesh.Mesh (tp x pp x dp), when it made one
    placement: Any = None  # the loader's parallel.placement.Placement (built-in plan)
    # the weights' fingerprint when known without the files (a rank that received its
    # slices: the sender's; `fingerprint.weights_fingerprint`)
    fingerprint: str | None = None
    # mlx-lm's classes (generic/): the route (why that path), each stage's layers, the bytes held
    route: Any = None
    stages: list = field(default_factory=list)
    held_bytes: int = 0
