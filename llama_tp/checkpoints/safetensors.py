"""Read whole tensors or row/column slices of safetensors files, counting the bytes.

MLX's `mx.load` is lazy per tensor, but it reads a whole tensor even when only
a slice of it is kept. Here a rank asks for `rows [a, b)` or `columns [a, b)`
and only those bytes are read (`os.preadv` straight into the MLX array's own
buffer, so no second copy exists): a row slice is one contiguous range, a
column slice one range per row.

Format: 8-byte little-endian header length, a JSON header mapping each name to
{dtype, shape, data_offsets} (relative to the end of the header), then the data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .base import CheckpointError

# safetensors dtype (GGUF's float types have the same names) ->
# (MLX dtype the bytes are read as, dtype of the result)
DTYPES = {
    "F32": (mx.float32, mx.float32),
    "F16": (mx.float16, mx.float16),
    "BF16": (mx.uint16, mx.bfloat16),  # read as uint16, then viewed (no copy)
    "U32": (mx.uint32, mx.uint32),
    "I32": (mx.int32, mx.int32),
    "U8": (mx.uint8, mx.uint8),
    "I8": (mx.int8, mx.int8),
    "F8_E8M0": (mx.uint8, mx.uint8),  # exponents (MXFP4 scales), held as MLX's uint8
    "I64": (mx.int64, mx.int64),
}
_MAX_HEADER = 100 << 20
_HAVE_PREADV = hasattr(os, "preadv")
_CHUNK = 16 << 20  # the safetensors reference implementation's limit


class ReadCounter:
    """Bytes this process read from weight files (the loader's own accounting)."""

    def __init__(self) -> None:
        self.bytes = 0

    def reset(self) -> None:
        self.bytes = 0


READ = ReadCounter()


def pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    """Fill `buf` with the bytes of the open file `fd` from `offset` on (counted in READ);
    CheckpointError naming `path` and the byte where the file ends too soon."""
    done = 0
    while done < len(buf):
        if _HAVE_PREADV:
            n = os.preadv(fd, [buf[done:]], offset + done)
        else:  # some macOS Pythons: bounded chunks through a temporary bytes object
            data = os.pread(fd, min(len(buf) - done, _CHUNK), offset + done)
            n = len(data)
            buf[done : done + n] = data
        if n <= 0:
            raise CheckpointError(f"{path}: truncated at byte {offset + done}")
        done += n
    READ.bytes += done


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors name, e.g. "F16"
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0].size


class SafetensorsFile:
    """The header of one safetensors file, checked against the file size."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: truncated: {size} bytes, no header")
                (n,) = struct.unpack("<Q", head)
                if n > min(size - 8, _MAX_HEADER):
                    raise CheckpointError(
                        f"{self.path}: damaged header: length {n} in a file of {size} bytes"
                    )
                header = json.loads(f.read(n))
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{self.path}: damaged header: not valid JSON") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, TensorInfo] = {}
        base = 8 + n
        for name, t in header.items():
            try:
                dtype, shape, (start, stop) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: damaged header entry {name!r}") from None
            if dtype not in DTYPES:
                raise CheckpointError(f"{self.path}: {name}: unsupported dtype {dtype}")
            nbytes = math.prod(shape) * DTYPES[dtype][0].size
            if stop - start != nbytes:
                raise CheckpointError(
                    f"{self.path}: {name}: {stop - start} bytes stored for shape {list(shape)} "
                    f"{dtype} ({nbytes} bytes)"
                )
            if base + stop > size:
                raise CheckpointError(
                    f"{self.path}: truncated: {name} ends at byte {base + stop}, "
                    f"the file has {size}"
                )
            self.tensors[name] = TensorInfo(dtype, shape, base + start, nbytes)

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        """Tensor `name`, whole (`axis` None) or its slice [start, stop) along `axis`."""
        t = self.tensors[name]
        try:
            return read_dense(self.path, t.offset, t.shape, t.dtype, axis, start, stop)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def read_dense(
    path: Path,
    offset: int,
    shape: tuple[int, ...],
    dtype: str,
    axis: int | None = None,
    start: int = 0,
    stop: int = 0,
) -> mx.array:
    """The row-major `dtype` tensor of `shape` at byte `offset` of `path` (safetensors
    tensors, GGUF float tensors), whole (`axis` None) or its slice [start, stop) along
    `axis`: only those bytes are read, into the result's own buffer."""
    read_as, result = DTYPES[dtype]
    out_shape = list(shape)
    if axis is not None:
        if not 0 <= axis < len(shape) or not 0 <= start < stop <= shape[axis]:
            raise ValueError(f"bad slice [{start}, {stop}) of axis {axis} of {list(shape)}")
        out_shape[axis] = stop - start
    # A fresh buffer of the result's size, filled in place by the reads below.
    out = mx.zeros(out_shape, dtype=read_as)
    mx.eval(out)
    buf = memoryview(out).cast("B")
    if axis is None:
        axis, start, stop = 0, 0, (shape[0] if shape else 1)
    # The slice is `outer` runs of `(stop - start) * inner` bytes, one per index of the
    # axes before `axis` (one run for axis 0; one per row for the columns of a matrix).
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1 :]) * read_as.size
    run, stride = (stop - start) * inner, (shape[axis] if shape else 1) * inner
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    try:
        for i in range(outer):
            pread_into(fd, buf[i * run : (i + 1) * run], offset + i * stride + start * inner, path)
    finally:
        os.close(fd)
    return out.view(result) if result != read_as else out
