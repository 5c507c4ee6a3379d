"""Read whole tensors or row/column slices of a GGUF file, converted to MLX, counting bytes.

The loader's sliced reading (`checkpoints/slices.py`) asks a source for `(stored name,
axis, start, stop)` in the units of the array it gets back; here every quantized
GGUF tensor `X.weight` appears as the three MLX arrays `X.weight` (packed uint32),
`X.scales` and `X.biases` (group size 32, see `gguf_quants.py`; MXFP4 as MLX's mxfp4
mode, `X.weight` and uint8 `X.scales`), and float tensors as themselves; stacked
experts (E, rows, cols) read as E matrices one after another (whole experts, or the
same rows or columns of each). With `blocks` (the native kernels
are on, `llama_tp.kernels`), a quantized matrix stays as the file stores it: `X.weight`
uint8 (rows, blocks * bytes), sliced in value units (rows, columns) into the whole
blocks covering them. A row slice reads one contiguous byte range; a column slice reads,
per row, the blocks covering the columns (a block of 256 values that straddles
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
from .safetensors import DTYPES, pread_into, read_dense

_CHUNK = 8 << 20  # source bytes converted at a time
_MX = {k: DTYPES[k][1] for k in ("F32", "F16", "BF16")}  # GGUF's float types, as MLX reads them
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
            self._add(name, t, blocks and t.type_name in GGUF_TYPES)

    def _add(self, name: str, t: GGUFTensor, blocks: bool) -> None:
        shape = tuple(reversed(t.shape))  # ggml lists the fastest dimension first
        bits = 4 if t.type_name == gq.MXFP4 else gq.mlx_bits(t.type_name)
        if bits is None:
            self.tensors[name] = Part(shape, _MX[t.type_name], name, "weight")
            return
        if blocks and len(shape) == 2:
            self.tensors[name] = Part(shape, mx.uint8, name, "blocks")
            return
        if len(shape) not in (2, 3) or shape[-1] % gq.GROUP:
            raise CheckpointError(f"{self.path}: tensor {name!r}: cannot hold shape {list(shape)}")
        self.bits[name] = bits
        *lead, cols = shape  # (rows, cols), or stacked experts' (E, rows, cols)
        base = name.removesuffix(".weight")
        self.tensors[name] = Part((*lead, cols * bits // 32), mx.uint32, name, "weight")
        for p, dtype in _scales(t.type_name).items():
            self.tensors[f"{base}.{p}"] = Part((*lead, cols // gq.GROUP), dtype, name, p)

    def unblock(self, name: str) -> None:
        """Hold tensor `name` converted to MLX's quantization (groups of 32), not as stored
        blocks: its columns are read in pieces narrower than a block."""
        if self.tensors[name].part == "blocks":
            self._add(name, self.gguf[name], False)

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
        """Array `name`, whole (`axis` None) or its slice [start, stop) along `axis`: rows
        or columns of a matrix; whole experts, rows or columns of stacked experts."""
        t = self.tensors[name]
        if axis is not None and not (0 <= axis < len(t.shape) and 0 <= start < stop):
            raise ValueError(f"{name}: bad slice [{start}, {stop}) of axis {axis} of {t.shape}")
        src = self.gguf[t.source]
        shape = tuple(reversed(src.shape))
        if len(shape) == 1:  # a vector: its "columns"
            shape = (1, *shape)
        *lead, R, C = shape
        E = lead[0] if lead else 1  # stacked experts: E matrices of R rows, one after another
        rows, cols, n, dense = [(0, E * R)], (0, C), E, (None, 0, 0)
        if axis is not None and axis == len(t.shape) - 1:  # in the part's units: proportional
            cols = (start * C // t.shape[-1], stop * C // t.shape[-1])
            dense = (len(shape) - 1, *cols)
        elif axis is not None and axis == len(t.shape) - 2:
            rows = [(e * R + start, e * R + stop) for e in range(E)]
            dense = (len(shape) - 2, start, stop)
        elif axis is not None:  # whole experts
            rows, n = [(start * R, stop * R)], stop - start
            dense = (0, start, stop)
        if src.type_name in _MX:
            out = read_dense(self.path, src.offset, shape, src.type_name, *dense)
        else:
            out = self._quantized(t, src, rows, cols)
        # (n * rows, ...) -> the part's shape: (rows, ...) or (n, rows per expert, ...)
        if len(t.shape) == 1:
            return out.reshape(-1)
        return out.reshape(n, -1, out.shape[-1]) if len(t.shape) == 3 else out

    def read_piece(
        self,
        name: str,
        piece: tuple[int, int],
        axis: int | None = None,
        start: int = 0,
        stop: int = 0,
    ) -> mx.array:
        """As `read`, of stacked experts (E, k * R, C) whose rows are k pieces of R each,
        piece j of `piece` (j, k) seen as the array (E, R, C) (Gemma 4's fused gate and up
        rows): only the piece's bytes are read."""
        t = self.tensors[name]
        src = self.gguf[t.source]
        E, full, C = tuple(reversed(src.shape))
        j, k = piece
        R = full // k
        at = j * R  # the piece's first row in each expert
        shape = (*t.shape[:-2], t.shape[-2] // k, t.shape[-1])
        if axis is not None and not (0 <= axis < 3 and 0 <= start < stop):
            raise ValueError(f"{name}: bad slice [{start}, {stop}) of axis {axis} of {shape}")
        experts, r0, r1, cols = range(E), 0, R, (0, C)
        if axis == 2:  # in the part's units: proportional
            cols = (start * C // t.shape[-1], stop * C // t.shape[-1])
        elif axis == 1:
            r0, r1 = start, stop
        elif axis == 0:
            experts = range(start, stop)
        rows = [(e * full + at + r0, e * full + at + r1) for e in experts]
        if src.type_name in _MX:
            parts = []
            for a, b in rows:  # each expert's rows: a (rows, C) matrix of its own
                item = DTYPES[src.type_name][0].size
                offset = src.offset + a * C * item
                dense = (1, *cols) if axis == 2 else (None, 0, 0)
                parts.append(read_dense(self.path, offset, (b - a, C), src.type_name, *dense))
            out = mx.concatenate(parts)
        else:
            out = self._quantized(t, src, rows, cols)
        return out.reshape(len(experts), -1, out.shape[-1])

    def _quantized(self, t: Part, src: GGUFTensor, rows: list[tuple], cols: tuple) -> mx.array:
        """Part `t` of quantized rows `rows`, value columns `cols` (one read for all parts)."""
        if t.part == "blocks":  # (rows, value columns): the whole blocks covering them
            out = self._read_blocks(src, rows, cols)
        else:  # weight, scales and biases come from one read: kept until all are taken
            key = (t.source, tuple(rows), cols)
            if key not in self._cache:
                self._cache[key] = self._read_quantized(t.source, src, rows, cols)
            parts = self._cache[key]
            out = parts.pop(t.part)
            if not parts:
                del self._cache[key]
        return out

    def _read_blocks(self, src: GGUFTensor, rows: list[tuple], cols: tuple) -> mx.array:
        """The row ranges `rows` of the whole blocks covering value columns [c0, c1), as
        stored: uint8 (rows, blocks * bytes)."""
        per, size = src.block
        c0, c1 = cols
        b0, b1 = c0 // per, -(-c1 // per)
        row_bytes = src.shape[0] // per * size
        width = (b1 - b0) * size
        out = mx.zeros((sum(r1 - r0 for r0, r1 in rows), width), dtype=mx.uint8)
        mx.eval(out)
        buf = memoryview(out).cast("B")
        done = 0
        with self._fd() as fd:
            for r0, r1 in rows:
                if width == row_bytes:  # whole rows: one contiguous range
                    at = src.offset + r0 * row_bytes
                    pread_into(fd, buf[done * width : (done + r1 - r0) * width], at, self.path)
                else:
                    for i in range(r1 - r0):
                        at = src.offset + (r0 + i) * row_bytes + b0 * size
                        j = (done + i) * width
                        pread_into(fd, buf[j : j + width], at, self.path)
                done += r1 - r0
        return out

    def _read_quantized(
        self, name: str, src: GGUFTensor, rows: list[tuple], cols: tuple
    ) -> dict[str, mx.array]:
        """weight, scales, biases of the row ranges `rows` (of the tensor seen as (rows,
        cols)) and value columns [c0, c1) (32-aligned)."""
        per, size = src.block
        bits = self.bits[name]
        c0, c1 = cols
        if c0 % gq.GROUP or c1 % gq.GROUP:
            raise CheckpointError(
                f"{self.path}: tensor {name!r}: columns [{c0}, {c1}) do not fall on groups of "
                f"{gq.GROUP}"
            )
        b0, b1 = c0 // per, -(-c1 // per)  # the blocks covering the columns
        row_bytes = src.shape[0] // per * size
        width = (b1 - b0) * size
        n = sum(b - a for a, b in rows)
        out = {"weight": mx.zeros((n, (c1 - c0) * bits // 32), dtype=mx.uint32)}
        for p, dtype in _scales(src.type_name).items():
            out[p] = mx.zeros((n, (c1 - c0) // gq.GROUP), dtype=dtype)
        mx.eval(*out.values())
        views = {k: np.asarray(memoryview(v)) for k, v in out.items()}
        lead = c0 - b0 * per  # values to drop at the start of each row
        g0, g1 = lead // gq.GROUP, (lead + c1 - c0) // gq.GROUP
        step = max(1, _CHUNK // width)
        done = 0  # rows of the output filled
        with self._fd() as fd:
            for r0, r1 in rows:
                for a in range(r0, r1, step):
                    b = min(r1, a + step)
                    raw = np.empty((b - a, width), np.uint8)
                    if width == row_bytes:
                        pread_into(
                            fd, memoryview(raw).cast("B"), src.offset + a * row_bytes, self.path
                        )
                    else:
                        for i in range(b - a):
                            at = src.offset + (a + i) * row_bytes + b0 * size
                            pread_into(fd, memoryview(raw[i]), at, self.path)
                    try:
                        w, *sz = _convert(src.type_name, raw)
                    except ValueError as e:
                        raise CheckpointError(f"{self.path}: tensor {name!r}: {e}") from None
                    at = slice(done, done + b - a)
                    views["weight"][at] = w[:, g0 * bits : g1 * bits]
                    for p, v in zip(_scales(src.type_name), sz, strict=True):
                        views[p][at] = v[:, g0:g1]
                    done += b - a
        return out

    def _fd(self):
        return _File(self.path)


def _scales(type_name: str) -> dict[str, mx.Dtype]:
    """The arrays beside `weight` of a quantized type, per group of 32: MXFP4's uint8
    exponent (MLX's mxfp4 mode), else float16 scales and biases (affine)."""
    if type_name == gq.MXFP4:
        return {"scales": mx.uint8}
    return {"scales": mx.float16, "biases": mx.float16}


def _convert(type_name: str, raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """Whole blocks (rows, bytes) -> weight and the `_scales` arrays, in MLX's layout."""
    return gq.mxfp4_to_mlx(raw) if type_name == gq.MXFP4 else gq.to_mlx(type_name, raw)


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
