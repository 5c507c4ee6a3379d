"""Read whole tensors or row/column slices of a GGUF file, converted to MLX, counting bytes.

The loader's sliced reading (`engine/loader.py`) asks a source for `(stored name,
axis, start, stop)` in the units of the array it gets back; here every quantized
GGUF tensor `X.weight` appears as the three MLX arrays `X.weight` (packed uint32),
`X.scales` and `X.biases` (group size 32, see `gguf_quants.py`), and float tensors
as themselves. With `blocks` (the native kernels are on, `llama_tp.kernels`), a
quantized tensor stays as the file stores it: `X.weight` uint8 (rows, blocks * bytes),
sliced in value units (rows, columns) into the whole blocks covering them. A row
slice reads one contiguous byte range; a column slice reads, per row, the blocks
covering the columns (a block of 256 values that straddles
the boundary is read by both neighbours and cut on the 32-value group boundary, so
the result is exactly that slice of the whole tensor). Bytes are read with
`os.preadv` into numpy buffers, converted in chunks of rows, and written straight
into the MLX arrays' own memory; every byte read is counted in `READ`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import gguf_quants as gq
from .base import CheckpointError
from .gguf_header import GGUFHeader
from .gguf_header import TensorInfo as GGUFTensor
from .safetensors import pread_into

_CHUNK = 8 << 20  # source bytes converted at a time
_MX = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
_PARTS = ("weight", "scales", "biases")


@dataclass(frozen=True)
class Part:
    """One MLX array of a GGUF tensor: its shape and dtype, and what it is part of."""

    shape: tuple[int, ...]
    dtype: mx.Dtype
    source: str  # the GGUF tensor's name
    part: str  # "weight", "scales", "biases", or "blocks" (shape in values, not bytes)


class GGUFFile:
    """A GGUF file's tensors as MLX arrays, read in slices (`read`).

    `tensors` maps `name` (the GGUF name; `.scales`/`.biases` added for quantized
    ones) to a `Part` with the MLX shape. `bits[name]` is the MLX width of each
    quantized GGUF tensor. With `blocks`, quantized tensors of the types the native
    kernels compute are kept as stored (`Part.part == "blocks"`).
    """

    def __init__(self, path: Path, header: GGUFHeader, blocks: bool = False):
        from ..kernels import GGUF_TYPES

        self.path = path
        self.gguf: dict[str, GGUFTensor] = header.tensors
        self.tensors: dict[str, Part] = {}
        self.bits: dict[str, int] = {}
        self._cache: dict[tuple, dict[str, mx.array]] = {}
        for name, t in header.tensors.items():
            shape = tuple(reversed(t.shape))  # ggml lists the fastest dimension first
            bits = gq.mlx_bits(t.type_name)
            if bits is None:
                self.tensors[name] = Part(shape, _MX[t.type_name], name, "weight")
                continue
            if blocks and t.type_name in GGUF_TYPES and len(shape) == 2:
                self.tensors[name] = Part(shape, mx.uint8, name, "blocks")
                continue
            if len(shape) != 2 or shape[1] % gq.GROUP:
                raise CheckpointError(f"{path}: tensor {name!r}: cannot hold shape {list(shape)}")
            self.bits[name] = bits
            rows, cols = shape
            base = name.removesuffix(".weight")
            self.tensors[name] = Part((rows, cols * bits // 32), mx.uint32, name, "weight")
            for p in ("scales", "biases"):
                self.tensors[f"{base}.{p}"] = Part((rows, cols // gq.GROUP), mx.float16, name, p)

    def placeholder(self, name: str) -> mx.array:
        """A lazy array of `name`'s shape and dtype (never evaluated: sources replace it)."""
        t = self.tensors[name]
        if t.part == "blocks":
            per, size = self.gguf[name].block
            return mx.zeros((t.shape[0], t.shape[1] // per * size), dtype=mx.uint8)
        return mx.zeros(t.shape, dtype=t.dtype)

    def block_type(self, name: str) -> str | None:
        """The GGUF type of a tensor kept as stored blocks, else None."""
        return self.gguf[name].type_name if self.tensors[name].part == "blocks" else None

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        """Array `name`, whole (`axis` None) or its slice [start, stop) along axis 0 or 1."""
        t = self.tensors[name]
        if axis is not None and not (0 <= axis < len(t.shape) and 0 <= start < stop):
            raise ValueError(f"{name}: bad slice [{start}, {stop}) of axis {axis} of {t.shape}")
        src = self.gguf[t.source]
        shape = tuple(reversed(src.shape))
        if axis is None:
            rows, cols = (0, shape[0]), (0, shape[-1])
        elif axis == 0:
            rows, cols = (start, stop), (0, shape[-1])
        else:  # in value columns: the part's columns are proportional to them
            rows = (0, shape[0])
            cols = (start * shape[1] // t.shape[1], stop * shape[1] // t.shape[1])
        key = (t.source, rows, cols)
        if key not in self._cache:
            if src.type_name in _MX:
                return self._read_float(src, shape, rows, cols)
            if t.part == "blocks":
                return self._read_blocks(src, rows, cols)
            self._cache[key] = self._read_quantized(t.source, src, rows, cols)
        parts = self._cache[key]
        out = parts.pop(t.part)
        if not parts:
            del self._cache[key]
        return out

    def _read_float(self, src: GGUFTensor, shape: tuple, rows: tuple, cols: tuple) -> mx.array:
        dtype = _MX[src.type_name]
        read_as = mx.uint16 if dtype == mx.bfloat16 else dtype
        size = read_as.size
        if len(shape) == 1:
            out = mx.zeros((cols[1] - cols[0],), dtype=read_as)
            mx.eval(out)
            self._pread(memoryview(out).cast("B"), src.offset + cols[0] * size)
            return out.view(dtype) if dtype != read_as else out
        out = mx.zeros((rows[1] - rows[0], cols[1] - cols[0]), dtype=read_as)
        mx.eval(out)
        buf = memoryview(out).cast("B")
        row, inner = shape[1] * size, (cols[1] - cols[0]) * size
        first = src.offset + rows[0] * row + cols[0] * size
        if inner == row:
            self._pread(buf, first)
        else:
            with self._fd() as fd:
                for i in range(rows[1] - rows[0]):
                    self._pread(buf[i * inner : (i + 1) * inner], first + i * row, fd)
        return out.view(dtype) if dtype != read_as else out

    def _read_blocks(self, src: GGUFTensor, rows: tuple, cols: tuple) -> mx.array:
        """Rows [r0, r1) of the whole blocks covering value columns [c0, c1), as stored."""
        per, size = src.block
        (r0, r1), (c0, c1) = rows, cols
        b0, b1 = c0 // per, -(-c1 // per)
        row_bytes = src.shape[0] // per * size
        out = mx.zeros((r1 - r0, (b1 - b0) * size), dtype=mx.uint8)
        mx.eval(out)
        buf = memoryview(out).cast("B")
        width = (b1 - b0) * size
        if width == row_bytes:
            self._pread(buf, src.offset + r0 * row_bytes)
            return out
        with self._fd() as fd:
            for i in range(r1 - r0):
                at = src.offset + (r0 + i) * row_bytes + b0 * size
                self._pread(buf[i * width : (i + 1) * width], at, fd)
        return out

    def _read_quantized(
        self, name: str, src: GGUFTensor, rows: tuple, cols: tuple
    ) -> dict[str, mx.array]:
        """weight, scales, biases of rows [r0, r1) and value columns [c0, c1) (32-aligned)."""
        per, size = src.block
        bits = self.bits[name]
        (r0, r1), (c0, c1) = rows, cols
        if c0 % gq.GROUP or c1 % gq.GROUP:
            raise CheckpointError(
                f"{self.path}: tensor {name!r}: columns [{c0}, {c1}) do not fall on groups of "
                f"{gq.GROUP}"
            )
        b0, b1 = c0 // per, -(-c1 // per)  # the blocks covering the columns
        row_bytes = src.shape[0] // per * size
        width = (b1 - b0) * size
        n = r1 - r0
        out = {
            "weight": mx.zeros((n, (c1 - c0) * bits // 32), dtype=mx.uint32),
            "scales": mx.zeros((n, (c1 - c0) // gq.GROUP), dtype=mx.float16),
            "biases": mx.zeros((n, (c1 - c0) // gq.GROUP), dtype=mx.float16),
        }
        mx.eval(*out.values())
        views = {k: np.asarray(memoryview(v)) for k, v in out.items()}
        lead = c0 - b0 * per  # values to drop at the start of each row
        step = max(1, _CHUNK // width)
        with self._fd() as fd:
            for a in range(r0, r1, step):
                b = min(r1, a + step)
                raw = np.empty((b - a, width), np.uint8)
                if width == row_bytes:
                    self._pread(memoryview(raw).cast("B"), src.offset + a * row_bytes, fd)
                else:
                    for i in range(b - a):
                        at = src.offset + (a + i) * row_bytes + b0 * size
                        self._pread(memoryview(raw[i]), at, fd)
                try:
                    w, s, z = gq.to_mlx(src.type_name, raw)
                except ValueError as e:
                    raise CheckpointError(f"{self.path}: tensor {name!r}: {e}") from None
                g0, g1 = lead // gq.GROUP, (lead + c1 - c0) // gq.GROUP
                views["weight"][a - r0 : b - r0] = w[:, g0 * bits : g1 * bits]
                views["scales"][a - r0 : b - r0] = s[:, g0:g1]
                views["biases"][a - r0 : b - r0] = z[:, g0:g1]
        return out

    def _fd(self):
        return _File(self.path)

    def _pread(self, buf: memoryview, offset: int, fd: int | None = None) -> None:
        if fd is None:
            with self._fd() as own:
                return self._pread(buf, offset, own)
        pread_into(fd, buf, offset, self.path)


class _File:
    """`with _File(path) as fd:` an OS-level read-only file descriptor."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> int:
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror})") from None
        return self.fd

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
