"""A bounds-checked reader of a GGUF file's header: metadata, tensor names, types, offsets.

Pure Python and numpy: a damaged header (a huge tensor count, a truncated file, a
row that is not whole blocks) becomes a clear error instead of a crash, and each
tensor's bytes can then be read in slices (`gguf_reader.py`). Metadata values come
back as Python scalars and strings, lists of strings, and numpy arrays.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"

# ggml type id -> (name, elements per block, bytes per block)
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    30: ("BF16", 1, 2),
    # Known to llama.cpp, not loaded here (named in the refusal)
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    29: ("IQ1_M", 256, 56),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

# Metadata value type id -> struct format of a scalar (8: string, 9: array).
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY = {k: np.dtype("<" + v) for k, v in _SCALARS.items()}
_LIMIT = 1 << 24  # more tensors or metadata entries than this is a damaged header


@dataclass
class TensorInfo:
    type_name: str  # "Q4_K", ...; "type N" for an id this reader does not know
    shape: tuple[int, ...]  # as ggml lists them: fastest-varying dimension first
    offset: int  # from the start of the file
    nbytes: int | None  # None for a type this reader does not know
    block: tuple[int, int] = (0, 0)  # (values, bytes) per block of the type


@dataclass
class GGUFHeader:
    version: int
    architecture: str | None
    tensors: dict[str, TensorInfo]
    metadata: dict[str, Any] = field(default_factory=dict)


class _Reader:
    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise ValueError("header extends past the end of the file (truncated?)")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.data):
            raise ValueError("header extends past the end of the file (truncated?)")
        s = self.data[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.take("I"), self.take("Q")
            if count > len(self.data):
                raise ValueError(f"array of {count} entries is larger than the file")
            if etype in _SCALARS:
                dtype = _NUMPY[etype]
                end = self.pos + count * dtype.itemsize
                if end > len(self.data):
                    raise ValueError("header extends past the end of the file (truncated?)")
                out = np.frombuffer(self.data, dtype, count, self.pos).copy()
                self.pos = end
                return out
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")


def read_header(path: Path) -> GGUFHeader:
    """Parse and bounds-check the header of the GGUF file at `path`.

    Raises ValueError (message without the path) when the file is not GGUF,
    is truncated, or its header is inconsistent.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError("not a GGUF file (bad magic bytes)")
        f.seek(0)
        # Headers hold the vocabulary; 64 MiB covers the largest seen, and the
        # reader reports truncation if a header is longer still.
        data = f.read(min(size, 64 << 20))
    r = _Reader(data, path)
    r.pos = 4
    version = r.take("I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (expected 2 or 3)")
    n_tensors, n_kv = r.take("Q"), r.take("Q")
    if n_tensors > _LIMIT or n_kv > _LIMIT:
        raise ValueError(f"damaged header: {n_tensors} tensors, {n_kv} metadata entries")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, vtype = r.string(), r.take("I")
        metadata[key] = r.value(vtype)
    alignment = int(metadata.get("general.alignment", 32))
    arch = metadata.get("general.architecture")
    infos = []
    for _ in range(n_tensors):
        name, ndim = r.string(), r.take("I")
        if ndim > 8:
            raise ValueError(f"damaged header: tensor {name!r} has {ndim} dimensions")
        shape = tuple(r.take("Q") for _ in range(ndim))
        infos.append((name, shape, r.take("I"), r.take("Q")))
    data_start = (r.pos + alignment - 1) // alignment * alignment
    tensors = {}
    for name, shape, tid, offset in infos:
        tname, block, block_bytes = GGML_TYPES.get(tid, (f"type {tid}", 0, 0))
        count = 1
        for d in shape:
            count *= d
        if block and shape and shape[0] % block:
            raise ValueError(
                f"tensor {name!r}: rows of {shape[0]} values are not whole {tname} blocks "
                f"of {block} (size does not match its type)"
            )
        nbytes = count // block * block_bytes if block else None
        start = data_start + offset
        if nbytes is not None and start + nbytes > size:
            raise ValueError(
                f"tensor {name!r} ends at byte {start + nbytes} but the file has {size} "
                "bytes (truncated?)"
            )
        tensors[name] = TensorInfo(tname, shape, start, nbytes, (block, block_bytes))
    return GGUFHeader(version, arch, tensors, metadata)
