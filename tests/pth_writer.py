"""Write PyTorch checkpoints (what `torch.save` writes since torch 1.6) without torch.

The same bytes as torch.save for the same tensors (checked against torch 2.14):
a zip archive, every record stored uncompressed with its data aligned to 64 bytes
(an "FB" padding field in the local header) and followed by a data descriptor,
zip64 end records; the records `<name>/data.pkl` (pickle protocol 2: each tensor
a `torch._utils._rebuild_tensor_v2` reduce whose storage is a persistent id
`('storage', torch.<T>Storage, key, 'cpu', numel)`), `.format_version`,
`.storage_alignment`, `byteorder`, `data/<key>` (the raw elements), `version`
and `.data/serialization_id`. `<name>` is the file name up to its last dot.
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

ALIGNMENT = 64
# numpy element type -> torch storage class (bfloat16 is written from its uint16 bits).
STORAGE_TYPES = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
}


class Global:
    """A module-level name that the pickle refers to (e.g. torch._utils._rebuild_tensor_v2)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # save_reduce wants a callable
        raise TypeError(f"{self.module}.{self.name} is a stand-in")


REBUILD_TENSOR_V2 = Global("torch._utils", "_rebuild_tensor_v2")
_STORAGE_GLOBALS = {
    name: Global("torch", name) for name in [*STORAGE_TYPES.values(), "BFloat16Storage"]
}


class Storage:
    """A tensor's storage: 1-D elements (bfloat16 as uint16 bits with `bfloat16=True`)."""

    def __init__(self, elements: np.ndarray, bfloat16: bool = False):
        self.elements = np.asarray(elements).reshape(-1)
        self.bfloat16 = bfloat16
        if bfloat16 and self.elements.dtype != np.uint16:
            raise ValueError("bfloat16 storages hold uint16 bits")

    @property
    def type_name(self) -> str:
        return "BFloat16Storage" if self.bfloat16 else STORAGE_TYPES[self.elements.dtype.name]


class TensorView:
    """A tensor as torch pickles it: a storage, an offset, a size and a stride (in elements)."""

    def __init__(self, storage: Storage, offset: int, size: tuple, stride: tuple):
        self.storage, self.offset = storage, offset
        self.size, self.stride = tuple(size), tuple(stride)

    def __reduce_ex__(self, protocol: int):
        # As torch.Tensor._reduce_ex_internal: requires_grad False, no backward hooks.
        args = (self.storage, self.offset, self.size, self.stride, False, OrderedDict())
        return REBUILD_TENSOR_V2, args


def contiguous(array: np.ndarray | mx.array) -> TensorView:
    """A tensor with its own storage, from a numpy array or an MLX array (bfloat16 included)."""
    bfloat16 = isinstance(array, mx.array) and array.dtype == mx.bfloat16
    if isinstance(array, mx.array):
        array = np.array(array.view(mx.uint16) if bfloat16 else array)
    array = array if array.flags.c_contiguous else array.copy(order="C")  # 0-d stays 0-d
    strides = tuple(s // array.itemsize for s in array.strides)
    return TensorView(Storage(array, bfloat16), 0, array.shape, strides)


class _Pickler(pickle._Pickler):
    """The pure-Python pickler (same opcodes as the C one) that knows the torch stand-ins."""

    dispatch = pickle._Pickler.dispatch.copy()

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=2)
        self.storage_keys: dict[int, str] = {}
        self.storages: dict[str, Storage] = {}

    def save_stand_in(self, obj: Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[Global] = save_stand_in

    def persistent_id(self, obj: Any) -> tuple | None:
        if not isinstance(obj, Storage):
            return None
        key = self.storage_keys.setdefault(id(obj), str(len(self.storage_keys)))
        self.storages[key] = obj
        kind = _STORAGE_GLOBALS[obj.type_name]
        return ("storage", kind, key, "cpu", obj.elements.size)


def pickle_state_dict(tensors: dict[str, Any]) -> tuple[bytes, dict[str, bytes]]:
    """data.pkl and the storage records of `tensors` (TensorViews, numpy or MLX arrays)."""
    state = type(tensors)(
        (k, v if isinstance(v, TensorView) else contiguous(v)) for k, v in tensors.items()
    )
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(state)
    records = {k: s.elements.tobytes() for k, s in pickler.storages.items()}
    return buf.getvalue(), records


def archive_name(path: Path) -> str:
    """torch's record prefix: the file name without its last extension."""
    name = Path(path).name
    return name.rsplit(".", 1)[0] if "." in name else name


def write_archive(
    path: str | Path,
    data_pkl: bytes,
    storages: dict[str, bytes],
    serialization_id: str = "0" * 40,
) -> Path:
    """Write the zip archive as torch's PyTorchStreamWriter (miniz) lays it out."""
    path = Path(path)
    prefix = archive_name(path)
    records = [
        ("data.pkl", data_pkl),
        (".format_version", b"1"),
        (".storage_alignment", str(ALIGNMENT).encode()),
        ("byteorder", b"little"),
        *((f"data/{key}", data) for key, data in storages.items()),
        ("version", b"3\n"),
        (".data/serialization_id", serialization_id.encode()),
    ]
    out = bytearray()
    central = []
    for name, data in records:
        fname = f"{prefix}/{name}".encode()
        offset = len(out)
        if offset + len(data) >= 0xFFFFFFFF:
            raise ValueError("this writer does not do zip64 records (4 GB and over)")
        pad = -(offset + 30 + len(fname) + 4) % ALIGNMENT
        extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        crc = zlib.crc32(data)
        # UTF-8 names; sizes and checksum in a data descriptor after the data (none if empty).
        flags = 0x0808 if data else 0x0800
        out += struct.pack(
            "<4sHHHHHIIIHH", b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(fname), len(extra)
        )
        out += fname + extra + data
        if data:
            out += struct.pack("<4sIII", b"PK\x07\x08", crc, len(data), len(data))
        central.append(
            struct.pack(
                "<4sHHHHHHIIIHHHHHII",
                *(b"PK\x01\x02", 0, 0, flags, 0, 0, 0, crc, len(data), len(data), len(fname)),
                *(0, 0, 0, 0, 0, offset),
            )
            + fname
        )
    n, cd_offset, cd = len(records), len(out), b"".join(central)
    out += cd
    eocd64 = len(out)
    out += struct.pack(
        "<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 45, 0, 0, n, n, len(cd), cd_offset
    )
    out += struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64, 1)
    out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, n, n, len(cd), cd_offset, 0)
    path.write_bytes(out)
    return path


def save(tensors: dict[str, Any], path: str | Path, serialization_id: str = "0" * 40) -> Path:
    """`torch.save(tensors, path)` for a dict of TensorViews, numpy or MLX arrays."""
    data_pkl, storages = pickle_state_dict(tensors)
    return write_archive(path, data_pkl, storages, serialization_id)
