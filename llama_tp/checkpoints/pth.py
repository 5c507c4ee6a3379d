"""PyTorch checkpoints (`torch.save` since torch 1.6: a zip archive), read without torch.

The archive holds `<prefix>/data.pkl`, a pickle whose tensors are calls
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` and whose
storages are persistent ids `('storage', torch.<T>Storage, key, location, numel)`
naming the raw bytes in `<prefix>/data/<key>`. Unpickling allows exactly those
globals (a subset of what torch's own `weights_only=True` loader allows), so no
other object is ever built or called. Storages are memory-mapped: a tensor's
bytes are read only when it is copied (`Tensor.to_mx`).
"""

from __future__ import annotations

import io
import math
import pickle
import re
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .base import CheckpointError

# torch storage class -> numpy dtype of its elements (bfloat16 as its bits, uint16).
STORAGE_DTYPES = {
    "DoubleStorage": "f8",
    "FloatStorage": "f4",
    "HalfStorage": "f2",
    "BFloat16Storage": "u2",
    "LongStorage": "i8",
    "IntStorage": "i4",
    "ShortStorage": "i2",
    "CharStorage": "i1",
    "ByteStorage": "u1",
    "BoolStorage": "?",
}
# What the pre-1.6 formats start with: torch's magic number pickled with protocol 2.
_LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[:-1]
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length


class Tensor:
    """One tensor of a .pth file: a (possibly strided, memory-mapped) numpy view.

    `array` has the stored element type (bfloat16 as uint16 bits, in the file's
    byte order); `bfloat16` says whether those bits are bfloat16.
    """

    __slots__ = ("array", "bfloat16")

    def __init__(self, array: np.ndarray, bfloat16: bool):
        self.array = array
        self.bfloat16 = bfloat16

    def __setstate__(self, state: Any) -> None:  # a BUILD opcode aimed at a tensor
        raise _Refused("data.pkl sets attributes on a tensor")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    def native(self) -> np.ndarray:
        """The elements as a C-contiguous, native-byte-order array (copied only if needed)."""
        a = self.array
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        return a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)

    def to_mx(self) -> mx.array:
        """The tensor as an MLX array of its own dtype (this reads its bytes)."""
        return as_mx(self.native(), self.bfloat16)


def as_mx(array: np.ndarray, bfloat16: bool) -> mx.array:
    """An MLX copy of `array`, reinterpreting uint16 bits as bfloat16 when `bfloat16`."""
    out = mx.array(array)
    return out.view(mx.bfloat16) if bfloat16 else out


class _Refused(Exception):
    """data.pkl asks for something that is not a plain tensor state dict."""


class _StorageType:
    """Stands for one `torch.<T>Storage` class inside data.pkl."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __setstate__(self, state: Any) -> None:
        raise _Refused(f"data.pkl sets attributes on torch.{self.name}")


class _Storage:
    """One storage record: its elements (1-D) and whether they are bfloat16."""

    __slots__ = ("elements", "bfloat16")

    def __init__(self, elements: np.ndarray, bfloat16: bool):
        self.elements = elements
        self.bfloat16 = bfloat16

    def __setstate__(self, state: Any) -> None:
        raise _Refused("data.pkl sets attributes on a storage")


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(type(i) is int and i >= 0 for i in x)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> Tensor:
    """torch._utils._rebuild_tensor_v2, as a strided view of the storage's elements."""
    if not isinstance(storage, _Storage):
        raise _Refused(f"a tensor whose storage is a {type(storage).__name__}")
    if not (_is_shape(size) and _is_shape(stride) and len(size) == len(stride)):
        raise _Refused(f"a tensor with size {size!r:.60} and stride {stride!r:.60}")
    if type(storage_offset) is not int or storage_offset < 0:
        raise _Refused(f"a tensor with storage offset {storage_offset!r:.60}")
    if metadata:  # conjugate / negative-bit views: not something a checkpoint holds
        raise _Refused(f"a tensor with metadata {metadata!r:.60}")
    elements = storage.elements
    if math.prod(size) == 0:
        return Tensor(np.empty(size, elements.dtype), storage.bfloat16)
    last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= elements.size:
        raise _Refused(
            f"a tensor of size {list(size)}, stride {list(stride)} and offset {storage_offset} "
            f"reaches element {last} of a storage of {elements.size}"
        )
    view = np.lib.stride_tricks.as_strided(
        elements[storage_offset:],
        shape=size,
        strides=[s * elements.itemsize for s in stride],
        writeable=False,
    )
    return Tensor(view, storage.bfloat16)


def _rebuild_parameter(data: Any, requires_grad: Any = False, *rest: Any) -> Any:
    """torch._utils._rebuild_parameter(_with_state): an nn.Parameter is just its tensor here."""
    if not isinstance(data, Tensor):
        raise _Refused(f"a parameter whose data is a {type(data).__name__}")
    return data


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
}


class _Archive:
    """The records of one torch zip archive; storages memory-mapped where stored uncompressed."""

    def __init__(self, path: Path):
        self.path = path
        self.size = path.stat().st_size
        self.zip = zipfile.ZipFile(path)
        pickles = [n for n in self.zip.namelist() if re.fullmatch(r"[^/]*/data\.pkl", n)]
        if not pickles:
            raise CheckpointError(f"{path}: a zip archive without data.pkl: not a torch.save file")
        self.prefix = pickles[0][: -len("data.pkl")]
        self._mmap: np.memmap | None = None

    def close(self) -> None:
        self.zip.close()

    def has(self, name: str) -> bool:
        return self.prefix + name in self.zip.NameToInfo

    def read(self, name: str) -> bytes:
        """A whole (small) record, its checksum verified."""
        return self.zip.read(self.prefix + name)

    def data(self, name: str) -> np.ndarray:
        """The bytes of a record as a uint8 array (a view of the file when stored)."""
        try:
            info = self.zip.getinfo(self.prefix + name)
        except KeyError:
            raise CheckpointError(f"{self.path}: record {self.prefix}{name} is missing") from None
        if info.compress_type != zipfile.ZIP_STORED:
            return np.frombuffer(self.zip.read(info), np.uint8)
        self.zip.fp.seek(info.header_offset)
        signature, name_len, extra_len = _LOCAL_HEADER.unpack(self.zip.fp.read(30))
        if signature != b"PK\x03\x04":
            raise CheckpointError(f"{self.path}: damaged zip entry {info.filename}")
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.file_size > self.size:
            raise CheckpointError(
                f"{self.path}: truncated: {info.filename} needs bytes up to "
                f"{start + info.file_size}, the file has {self.size}"
            )
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap[start : start + info.file_size]


def _not_a_zip(path: Path) -> str:
    """Why a file that is not a readable zip archive cannot be loaded (one line)."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(_LEGACY_MAGIC) or head[257:262] == b"ustar":
        return (
            f"{path}: a legacy (pre-1.6) torch.save file, which is not supported: "
            "re-save it with torch >= 1.6 (torch.save(torch.load(f), f))"
        )
    if head.startswith(b"PK\x03\x04"):
        return f"{path}: truncated or damaged zip archive (no central directory)"
    return f"{path}: not a PyTorch checkpoint (expected the zip archive torch.save writes)"


def load(path: str | Path) -> dict[str, Tensor]:
    """The tensors of a torch.save'd state dict at `path`, by name (memory-mapped views).

    Raises CheckpointError (one line naming the file) for anything else: legacy
    or damaged files, and pickles that refer to any global other than the
    tensor-rebuilding ones (which are refused before they are called).
    """
    path = Path(path)
    try:
        if not zipfile.is_zipfile(path):
            raise CheckpointError(_not_a_zip(path))
        archive = _Archive(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{path}: damaged zip archive ({e})") from None
    try:
        return _load(archive)
    finally:
        archive.close()


def _load(archive: _Archive) -> dict[str, Tensor]:
    path = archive.path
    byteorder = archive.read("byteorder") if archive.has("byteorder") else b"little"
    if byteorder not in (b"little", b"big"):
        raise CheckpointError(f"{path}: unknown byte order {byteorder[:20]!r}")
    order = "<" if byteorder == b"little" else ">"
    storages: dict[str, _Storage] = {}

    def storage(key: str, kind: _StorageType, numel: int) -> _Storage:
        if key not in storages:
            raw = archive.data(f"data/{key}")
            dtype = np.dtype(order + STORAGE_DTYPES[kind.name])
            if raw.size < numel * dtype.itemsize:
                raise CheckpointError(
                    f"{path}: storage data/{key} holds {raw.size} bytes; its {numel} "
                    f"{kind.name} elements need {numel * dtype.itemsize}"
                )
            elements = raw[: numel * dtype.itemsize].view(dtype)
            storages[key] = _Storage(elements, kind.name == "BFloat16Storage")
        return storages[key]

    try:
        obj = _Unpickler(archive.read("data.pkl"), storage).load()
    except CheckpointError:
        raise
    except _Refused as e:
        raise CheckpointError(f"{path}: refused: data.pkl contains {e}") from None
    except Exception as e:  # damaged pickles raise anything from EOFError to TypeError
        raise CheckpointError(f"{path}: damaged data.pkl ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a dict of tensors, found a {type(obj).__name__}")
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise CheckpointError(
                f"{path}: expected a dict of tensors, but {key!r:.60} is a {type(value).__name__}"
            )
    return dict(obj)


class _Unpickler(pickle.Unpickler):
    """Unpickles tensors and nothing else: every other global is refused by name."""

    def __init__(self, data: bytes, storage):
        super().__init__(io.BytesIO(data))
        self._storage = storage

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _Refused(
                f"the global {module}.{name} (only torch tensors and storages are allowed)"
            ) from None

    def persistent_load(self, pid: Any) -> _Storage:
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
            and type(pid[4]) is int
            and pid[4] >= 0
        ):
            raise _Refused(f"the persistent id {pid!r:.80}")
        return self._storage(pid[2], pid[1], pid[4])
