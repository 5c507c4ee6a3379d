"""Reading exactly what one rank of an mlx-lm model holds from its safetensors files.

A folder `mlx_lm.convert` wrote (every file's metadata says `format: mlx`) stores the
model's own names, which mlx-lm's `sanitize` leaves as they are: each tensor this rank
holds is read by its name, and a tensor split by a tensor-parallel `shard()` only in the
rows or columns this rank keeps (`Split`: the ranges mlx's `shard_linear` /
`shard_inplace` cut, segments and all). Any other folder (Hugging Face's names, experts
stored one by one, fused projections) is read as mlx-lm's own pipeline loader reads it:
the tensors of this stage's layers (by the layer number in their stored names) and the
tensors outside the layers this stage needs, whole, then `sanitize`d together, then cut
in memory. Every byte goes through `checkpoints/safetensors.py`, which counts them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..checkpoints.base import CheckpointError
from ..checkpoints.safetensors import DTYPES, SafetensorsFile, TensorInfo
from .structure import Structure


@dataclass(frozen=True)
class Split:
    """How a tensor-parallel split cut one parameter: along `axis`, the stored tensor is
    `segments` (mlx's `_split`: a count, split indices, or fractions) each cut into `n`
    equal parts, of which this rank keeps part `r` of every segment."""

    axis: int
    segments: int | list
    n: int
    r: int

    def runs(self, size: int) -> list[tuple[int, int]]:
        """[start, stop) along the axis, per segment, of what this rank keeps of `size`."""
        s = self.segments
        if isinstance(s, int):
            if size % s:
                raise ValueError(f"{size} does not split into {s} segments")
            cuts = [size * i // s for i in range(s + 1)]
        else:
            inner = [x if isinstance(x, int) else int(x * size) for x in s]
            cuts = [0, *inner, size]
        out = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            if (b - a) % self.n:
                raise ValueError(f"{b - a} does not divide over {self.n} ranks")
            part = (b - a) // self.n
            out.append((a + self.r * part, a + (self.r + 1) * part))
        return out

    def cut(self, value: mx.array) -> mx.array:
        """This rank's part of the whole parameter `value` (in memory)."""
        axis = self.axis % value.ndim
        parts = []
        for a, b in self.runs(value.shape[axis]):
            index = [slice(None)] * value.ndim
            index[axis] = slice(a, b)
            parts.append(value[tuple(index)])
        return mx.contiguous(mx.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0])


@dataclass(frozen=True)
class Take:
    """A parameter a `shard()` cut by hand (Kimi's per-head conv weights and decay rates,
    DeepSeek's per-head `embed_q`): the flat indices of the stored tensor it keeps, in its
    order, and its shape. Read whole, then taken (these tensors are small)."""

    indices: tuple[int, ...]
    shape: tuple[int, ...]

    def cut(self, value: mx.array) -> mx.array:
        flat = value.reshape(-1)[mx.array(self.indices, dtype=mx.int64)]
        return mx.contiguous(flat.reshape(self.shape))


def stored_tensors(files: list[Path]) -> dict[str, tuple[SafetensorsFile, TensorInfo]]:
    """Every tensor of the weight files by its stored name (headers only)."""
    out = {}
    for f in files:
        header = SafetensorsFile(f)
        for name, info in header.tensors.items():
            out[name] = (header, info)
    return out


def mlx_format(files: list[Path]) -> bool:
    """Did mlx-lm write these files (its names, already sanitized)?"""
    return all(SafetensorsFile(f).metadata.get("format") == "mlx" for f in files)


def shapes_of(stored: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) of every stored tensor."""
    return {k: (info.shape, info.dtype) for k, (_, info) in stored.items()}


def placeholders(shapes: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, mx.array]:
    """Lazy zeros of every tensor's shape and dtype (never evaluated: for `sanitize` and the
    quantization rule to see names, shapes and dtypes)."""
    return {k: mx.zeros(shape, DTYPES[dtype][1]) for k, (shape, dtype) in shapes.items()}


def held(model: nn.Module) -> dict[str, mx.array]:
    """The parameters this rank holds (skipped layers' emptied ones left out)."""
    return {k: v for k, v in tree_flatten(model.parameters()) if isinstance(v, mx.array) and v.size}


def _read_split(header: SafetensorsFile, name: str, split: Split | Take | None) -> mx.array:
    info = header.tensors[name]
    if split is None:
        return header.read(name)
    if isinstance(split, Take):
        return split.cut(header.read(name))
    axis = split.axis % len(info.shape)
    parts = [header.read(name, axis, a, b) for a, b in split.runs(info.shape[axis])]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def sanitized(sanitize: Callable[[dict], dict], read: dict, shapes: dict) -> dict:
    """`sanitize` over the tensors this rank read, beside lazy placeholders of every other
    tensor of the checkpoint (`shapes`): it then sees the names a whole load shows it (some
    act on them: Gemma 3's drops its head when the file has none, Falcon-H1's looks at layer
    0's conv1d). Only the names read are taken from it (`read_*` check every one), so no
    placeholder reaches a tensor this rank holds."""
    others = {k: v for k, v in placeholders(shapes).items() if k not in read}
    out = sanitize({**others, **read})
    return {k: v for k, v in out.items() if k not in others or k in read}


def read_direct(
    stored: dict,
    want: dict[str, mx.array],
    splits: dict[str, Split],
    sanitize: Callable[[dict], dict],
    on_bytes: Callable,
    shapes: dict | None = None,
) -> list[tuple[str, mx.array]]:
    """Each wanted parameter read by its own name, only this rank's part of it. The tensors
    read whole still go through `sanitize` (some change values under the same name, e.g.
    Baichuan's normalized head); a part of a tensor is taken as stored."""
    missing = [k for k in want if k not in stored]
    if missing:
        raise CheckpointError(
            f"weights do not match the model: {len(missing)} parameters missing "
            f"(first: {missing[0]})"
        )
    whole, parts = {}, {}
    for name in want:
        header, _ = stored[name]
        value = _read_split(header, name, splits.get(name))
        (parts if name in splits else whole)[name] = value
        on_bytes(value.nbytes)
    whole = sanitized(sanitize, whole, shapes or shapes_of(stored)) if whole else whole
    out = []
    for name, like in want.items():
        value = parts[name] if name in parts else whole.get(name)
        if value is None:
            raise CheckpointError(f"weights do not match the model: {name} missing")
        _check_shape(name, value, like, stored[name][1].shape)
        out.append((name, value))
    return out


def read_sanitized(
    stored: dict,
    want: dict[str, mx.array],
    splits: dict[str, Split],
    structure: Structure,
    layers: range,
    sanitize: Callable[[dict], dict],
    on_bytes: Callable,
    shapes: dict | None = None,
) -> list[tuple[str, mx.array]]:
    """The stage's stored tensors whole (its layers', and those outside the layers that it
    holds a part of), sanitized together as mlx-lm loads them, then cut in memory."""
    pattern = structure.stored_layer_pattern()
    parts = {
        p.rsplit(".", 1)[-1]: any(k.startswith(p + ".") for k in want)
        for p in (structure.embedding, structure.head)
        if p
    }
    chosen = {}
    for name, (header, _) in stored.items():
        m = pattern.search(name)
        if m:
            keep = int(m.group(1)) in layers
        else:  # outside the layers: the embedding and head only where this rank holds them
            owner = next((p for p in parts if f".{p}." in f".{name}"), None)
            keep = parts[owner] if owner else True
        if keep:
            chosen[name] = header.read(name)
            on_bytes(chosen[name].nbytes)
    weights = sanitized(sanitize, chosen, shapes or shapes_of(stored))
    missing = [k for k in want if k not in weights]
    if missing:
        raise CheckpointError(
            f"weights do not match the model: {len(missing)} parameters missing "
            f"(first: {missing[0]})"
        )
    out = []
    for name, like in want.items():
        value = weights[name]
        if name in splits:
            value = splits[name].cut(value)
        _check_shape(name, value, like, None)
        out.append((name, value))
    return out


def _check_shape(name: str, value: mx.array, like: mx.array, stored: tuple | None) -> None:
    if tuple(value.shape) != tuple(like.shape):
        whole = f" (stored {list(stored)})" if stored is not None else ""
        raise CheckpointError(
            f"weights do not match the model: {name} has shape {list(value.shape)}{whole}, "
            f"the model takes {list(like.shape)}"
        )


def nbytes_of(stored: dict, names: list[str]) -> int:
    return sum(stored[n][1].nbytes for n in names if n in stored)


def shape_bytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * DTYPES[dtype][0].size
