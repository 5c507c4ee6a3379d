"""What a rank received, kept for its next start: a pre-split folder per source and placement.

    ROOT/<source fingerprint>/source.json           the checkpoint's description (`description.py`)
    ROOT/<source fingerprint>/<model name>/         its tokenizer and config files
    ROOT/<source fingerprint>/slices-<key>/         one rank's slices, as its placement cut them:
        entry.json                                  every tensor's file, size and checksum
        weights-00001.safetensors ...               the slices by the model's names

ROOT is `--weights-cache DIR`, else `$LLAMA_TP_WEIGHTS_CACHE`, else `llama_tp/weights` under
the user's cache folder (`$XDG_CACHE_HOME`, default `~/.cache`); `none` turns caching off.
`<key>` is a hash of the rank's slices (`RankPlacement.slices`: which tensors, which
rows or columns), so another rank count, split, mesh or expert split finds no entry
and a changed source another fingerprint. A folder is written under a temporary name and
renamed when complete (`entry.json` last), so a crash mid-write leaves nothing that
looks complete; reading checks every tensor's size and checksum, and a damaged or
missing file's tensors are fetched again (`read_entry` names them).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..cluster.transfer import checksum
from .description import decode, encode
from .fingerprint import digest

ENV = "LLAMA_TP_WEIGHTS_CACHE"
OFF = ("none", "off", "")
FORMAT = "llama_tp-received"
FILE_BYTES = 1 << 30  # bytes per weights file: a damaged file costs at most this again


class CacheError(OSError):
    """The cache could not be written (e.g. the disk is full); the partial copy is gone."""


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llama_tp" / "weights"


def cache_root(option: str | os.PathLike | bool | None = None) -> Path | None:
    """The cache folder for `--weights-cache` (None: the environment's or the default;
    False or 'none': no cache)."""
    if option is False:
        return None
    if option is None or option is True:
        option = os.environ.get(ENV)
        if option is None:
            return default_root()
    if str(option).strip().lower() in OFF:
        return None
    return Path(option).expanduser()


def entry_key(slices: Mapping[str, Any]) -> str:
    """The name of a rank's entry: its slices, in placement order."""
    return digest([repr(list(slices.items())).encode()])


class WeightsCache:
    """One cache folder (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def source(self, fingerprint: str) -> Path:
        return self.root / fingerprint

    def description(self, fingerprint: str, variant: str) -> dict[str, Any] | None:
        """The cached description of a source (None: none, or unreadable)."""
        path = self.source(fingerprint) / f"source{variant}.json"
        try:
            return decode(path.read_bytes())
        except (OSError, ValueError):
            return None

    def save_description(self, fingerprint: str, variant: str, desc: dict[str, Any]) -> None:
        folder = self.source(fingerprint)
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / f"source{variant}.json", encode(desc))

    def has_entry(self, fingerprint: str, slices: Mapping[str, Any]) -> bool:
        """Whether this rank's entry is there, complete (its checksums are checked when read)."""
        folder = self.source(fingerprint) / f"slices-{entry_key(slices)}"
        try:
            entry = json.loads((folder / "entry.json").read_text())
            return entry["format"] == FORMAT and entry["slices"] == _plain(slices)
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def read_entry(
        self, fingerprint: str, slices: Mapping[str, Any]
    ) -> tuple[dict[str, mx.array], list[str]]:
        """The tensors of this rank's entry that are intact (evaluated, checked), and the
        names to fetch again (every tensor of a damaged or missing file). No entry: ({},
        every name)."""
        folder = self.source(fingerprint) / f"slices-{entry_key(slices)}"
        try:
            entry = json.loads((folder / "entry.json").read_text())
            assert entry["format"] == FORMAT and entry["slices"] == _plain(slices)
            tensors = entry["tensors"]
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            return {}, list(slices)
        have: dict[str, mx.array] = {}
        files: dict[str, list[str]] = {}
        for name in slices:
            files.setdefault(tensors.get(name, {}).get("file", ""), []).append(name)
        for file, names in files.items():
            got = _read_file(folder / file, names, tensors) if file else None
            if got is not None:
                have.update(got)
        return have, [n for n in slices if n not in have]

    def write_entry(
        self, fingerprint: str, slices: Mapping[str, Any], tensors: Mapping[str, mx.array]
    ) -> int:
        """Write this rank's entry from `tensors` (every name of `slices`), replacing any
        old one; returns the bytes written. CacheError (the partial folder removed) when
        it cannot be written."""
        source = self.source(fingerprint)
        final = source / f"slices-{entry_key(slices)}"
        partial = source / f".{final.name}.partial-{os.getpid()}"
        try:
            partial.mkdir(parents=True, exist_ok=True)
            table, nbytes = _write_files(partial, slices, tensors)
            entry = {"format": FORMAT, "version": 1, "slices": _plain(slices), "tensors": table}
            _write_atomic(partial / "entry.json", json.dumps(entry, indent=1).encode())
            _replace_dir(partial, final)
        except OSError as e:
            shutil.rmtree(partial, ignore_errors=True)
            why = e.strerror or str(e)
            raise CacheError(e.errno, f"cannot cache the weights in {source}: {why}") from None
        return nbytes


_writing: list[threading.Thread] = []


def write_behind(
    cache: WeightsCache,
    fingerprint: str,
    slices: Mapping[str, Any],
    tensors: Mapping[str, mx.array],
    failed: Callable[[CacheError], None],
) -> None:
    """`cache.write_entry(...)` in a thread of its own, so that the model runs meanwhile
    (the disk may be slower than the link); `failed(error)` if it cannot be written. The
    interpreter waits for it at exit; `wait_for_writes()` sooner (before reading the
    cache again)."""

    def write() -> None:
        try:
            cache.write_entry(fingerprint, slices, tensors)
        except CacheError as e:
            failed(e)

    thread = threading.Thread(target=write, name="llama_tp-cache-write")
    thread.start()
    _writing.append(thread)


def wait_for_writes() -> None:
    """Until every cache write this process started has ended."""
    while _writing:
        _writing.pop().join()


def _plain(slices: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if v is not None else None for k, v in slices.items()}


def _read_file(path: Path, names: list[str], table: dict) -> dict[str, mx.array] | None:
    """`names` from one weights file, each checked; None when any is missing or damaged."""
    try:
        arrays = mx.load(str(path))
        out = {}
        for name in names:
            a, want = arrays[name], table[name]
            mx.eval(a)
            if a.nbytes != want["nbytes"] or checksum(a) != want["checksum"]:
                return None
            out[name] = a
        return out
    except Exception:  # missing, truncated or not safetensors: fetch its tensors again
        return None


def _write_files(
    folder: Path, slices: Mapping[str, Any], tensors: Mapping[str, mx.array]
) -> tuple[dict[str, Any], int]:
    table: dict[str, Any] = {}
    batch: dict[str, mx.array] = {}
    size = total = 0
    number = 0

    def flush() -> None:
        nonlocal batch, size, number
        if batch:
            number += 1
            name = f"weights-{number:05d}.safetensors"
            _save(folder / name, batch)
            for k in batch:
                table[k]["file"] = name
            batch, size = {}, 0

    for name in slices:
        a = tensors[name]
        table[name] = {"nbytes": a.nbytes, "checksum": checksum(a), "file": None}
        batch[name] = a
        size += a.nbytes
        total += a.nbytes
        if size >= FILE_BYTES:
            flush()
    flush()
    return table, total


_NAMES = {
    mx.bool_: "BOOL", mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64",
    mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.float16: "F16",
    mx.bfloat16: "BF16", mx.float32: "F32",
}  # fmt: skip


def _save(path: Path, tensors: Mapping[str, mx.array]) -> None:
    """A safetensors file written from the arrays' own memory (no copy): a full disk is
    an OSError with its errno (mx.save_safetensors says only that it failed). Not synced:
    what a power cut leaves half-written fails its checksums and is fetched again."""
    header: dict[str, Any] = {}
    offset = 0
    for name, a in tensors.items():
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for a in tensors.values():
            f.write(memoryview(mx.contiguous(a)).cast("B"))


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _replace_dir(new: Path, final: Path) -> None:
    """Put folder `new` at `final` in one rename (an older `final` moved aside first)."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
    try:
        new.rename(final)
    except OSError:
        if old is not None and not final.exists():
            old.rename(final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
