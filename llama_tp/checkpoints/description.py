"""A checkpoint as a small portable value: what a rank without the model needs to load it.

    desc = describe(ckpt)                        # on a rank that has the file: nothing read
    data = encode(desc)                          # bytes (JSON), sent or cached
    ckpt = from_description(decode(data), DIR)   # on a rank that has none: DIR gets its files

The description holds the checkpoint record (`base.Checkpoint`) without its weights:
the format, the config, the reader's metadata (a GGUF file's tokenizer included), every
tensor's stored shape and dtype (the receiver's lazy placeholders: `slices.model_shape`
and `build.skeleton` see exactly what the sender's reader saw, so both compute the same
placement), GGUF blocks kept as stored, the reader's notes, the weights' fingerprint
the ranks compare at start-up, and the small files beside the weights (tokenizer,
config, a pre-split folder's `shard.json`). The weights themselves travel as the
placement's slices (`loading/weight_transfer.py`).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..model_args import ModelArgs
from .base import Checkpoint, CheckpointError
from .fingerprint import digest, weights_fingerprint

# Files beside the weights that a receiver needs (tokenizer, config, chat template):
# every small regular file of the checkpoint's folder that holds no weights.
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pth", ".pt", ".npz", ".h5", ".msgpack")
SMALL_FILE = 64 << 20
_DTYPES = {str(d): d for d in (
    mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32,
    mx.int64, mx.float16, mx.bfloat16, mx.float32,
)}  # fmt: skip


def side_files(ckpt: Checkpoint) -> dict[str, bytes]:
    """The small files of the checkpoint's folder that hold no weights (a GGUF file has
    none: its tokenizer is in its metadata)."""
    folder = Path(ckpt.path)
    if not folder.is_dir():
        return {}
    out = {}
    for f in sorted(folder.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.stat().st_size <= SMALL_FILE:
            out[f.name] = f.read_bytes()
    return out


def source_fingerprint(ckpt: Checkpoint) -> str:
    """What ranks compare before one sends another its slices: the weights' fingerprint
    (every weight file's size, header and samples: `fingerprint.weights_fingerprint`) and
    the checkpoint's index as read (format, config, every tensor's stored shape and
    dtype, the blocks kept as stored). A pre-split folder adds its manifest (its rank
    folders differ by design)."""
    parts = [weights_fingerprint(ckpt).encode(), ckpt.format.encode()]
    if ckpt.format == "split":
        manifest = Path(ckpt.path).parent / "manifest.json"
        parts.append(manifest.read_bytes() if manifest.is_file() else b"")
    else:
        parts.append(json.dumps(ckpt.args.to_dict(), sort_keys=True, default=str).encode())
        table = sorted((k, tuple(v.shape), str(v.dtype)) for k, v in ckpt.weights.items())
        parts += [repr(table).encode(), repr(sorted(ckpt.blocks.items())).encode()]
    return digest(parts)


def describe(ckpt: Checkpoint) -> dict[str, Any]:
    """The checkpoint without its weights (see the module docstring)."""
    return {
        "format": ckpt.format,
        "name": Path(ckpt.path).name,
        "args": ckpt.args.to_dict(),
        "metadata": ckpt.metadata,
        "tensors": {k: [list(v.shape), str(v.dtype)] for k, v in ckpt.weights.items()},
        "blocks": dict(ckpt.blocks),
        "ffn_block": ckpt.ffn_block,
        "notes": list(ckpt.notes),
        "fingerprint": weights_fingerprint(ckpt),
        "files": side_files(ckpt),
    }


def from_description(desc: dict[str, Any], folder: Path) -> Checkpoint:
    """The checkpoint a receiver loads: `desc`'s record with lazy placeholders for the
    weights (never evaluated: the received slices replace what the rank keeps), its small
    files written into `folder` (which becomes the checkpoint's path)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in desc["files"].items():
        target = folder / Path(name).name
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(target)
    try:
        args = ModelArgs.from_dict(desc["args"])
        weights = {
            k: mx.zeros(tuple(shape), dtype=_DTYPES[dtype])
            for k, (shape, dtype) in desc["tensors"].items()
        }
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{folder}: a damaged model description ({e!r})") from None
    files = [folder / n for n in desc["files"]]
    ckpt = Checkpoint(folder, desc["format"], args, weights, desc["metadata"], files)
    ckpt.blocks = dict(desc["blocks"])
    ckpt.ffn_block = desc["ffn_block"]
    ckpt.notes = list(desc["notes"])
    ckpt.fingerprint = desc["fingerprint"]
    return ckpt


def _tagged(value: Any) -> Any:
    """JSON's default= hook: numpy arrays and scalars, bytes, tuples kept apart."""
    if isinstance(value, np.ndarray):
        raw = base64.b64encode(np.ascontiguousarray(value).tobytes()).decode()
        return {"__ndarray__": [value.dtype.str, list(value.shape), raw]}
    if isinstance(value, mx.array):
        return _tagged(np.array(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    raise TypeError(f"cannot describe a {type(value).__name__}")


def _untagged(obj: dict[str, Any]) -> Any:
    if "__ndarray__" in obj and len(obj) == 1:
        dtype, shape, raw = obj["__ndarray__"]
        return np.frombuffer(base64.b64decode(raw), dtype=np.dtype(dtype)).reshape(shape).copy()
    if "__bytes__" in obj and len(obj) == 1:
        return base64.b64decode(obj["__bytes__"])
    return obj


def encode(desc: dict[str, Any]) -> bytes:
    """`desc` as JSON bytes (numpy arrays and file contents base64-tagged; no pickle: a
    cached description is read back from disk)."""
    return json.dumps(desc, default=_tagged).encode()


def decode(data: bytes) -> dict[str, Any]:
    try:
        return json.loads(data, object_hook=_untagged)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"a damaged model description ({e})") from None
