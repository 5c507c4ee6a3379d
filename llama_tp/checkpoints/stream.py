"""Write safetensors files tensor by tensor: peak memory about the largest tensor.

The header (names, dtypes, shapes, offsets) is known before any tensor is read, so
each tensor is read (and converted) from its source, written, and dropped before
the next: a whole-model conversion never holds more than one tensor's arrays.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from ..cluster import progress as bars

_NAMES = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.uint8: "U8",
}


def header(tensors: list[tuple[str, tuple[int, ...], mx.Dtype]]) -> tuple[bytes, int]:
    """A safetensors file's start for `tensors` (name, shape, dtype) stored in this order:
    the 8-byte length and the JSON header (mlx's metadata, the data 8-byte aligned), and
    the bytes of their data that follow."""
    out: dict = {"__metadata__": {"format": "mlx"}}
    at = 0
    for name, shape, dtype in tensors:
        nbytes = math.prod(shape) * dtype.size
        out[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [at, at + nbytes],
        }
        at += nbytes
    blob = json.dumps(out, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, at


def _plan_files(sizes: list[int], max_bytes: int) -> list[int]:
    """File index of each tensor: consecutive tensors fill a file up to `max_bytes`."""
    out, index, used = [], 0, 0
    for n in sizes:
        if used and used + n > max_bytes:
            index, used = index + 1, 0
        out.append(index)
        used += n
    return out


def write_streaming(
    tensors: dict[str, tuple[tuple[int, ...], mx.Dtype, Callable[[], mx.array]]],
    out: Path,
    max_bytes: int,
    progress: bool,
) -> tuple[int, list[str]]:
    """Write `tensors` (name -> (shape, dtype, read)) into `out` as mlx-lm names its files;
    returns (bytes, file names). `read()` is called once per tensor, in name order."""
    names = sorted(tensors)
    sizes = [math.prod(tensors[k][0]) * tensors[k][1].size for k in names]
    which = _plan_files(sizes, max_bytes)
    n_files = which[-1] + 1 if which else 1
    files = (
        ["model.safetensors"]
        if n_files == 1
        else [f"model-{i:05d}-of-{n_files:05d}.safetensors" for i in range(1, n_files + 1)]
    )
    total = sum(sizes)
    bar = bars.progress(desc="converting", total=total, enabled=progress, unit="B", unit_scale=True)
    weight_map: dict[str, str] = {}
    with bar:
        for i, file in enumerate(files):
            mine = [(k, s) for k, s, w in zip(names, sizes, which, strict=True) if w == i]
            start, _ = header([(k, *tensors[k][:2]) for k, _ in mine])
            with open(out / file, "wb") as f:
                f.write(start)
                for k, s in mine:
                    shape, dtype, read = tensors[k]
                    v = read()
                    if tuple(v.shape) != tuple(shape) or v.dtype != dtype:
                        raise ValueError(f"{k}: read {v.shape} {v.dtype}, expected {shape} {dtype}")
                    mx.eval(v)
                    f.write(memoryview(v.view(mx.uint16) if dtype == mx.bfloat16 else v))
                    del v
                    bar.update(s)
                    weight_map[k] = file
    if n_files > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return total, files
