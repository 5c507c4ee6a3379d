"""Fingerprints of a checkpoint's weights and tokenizer, compared across ranks at start-up.

Each weight file is fingerprinted by its size, its first 64 KiB and evenly spaced
64 KiB samples: cheap on a 40 GB file, and enough to tell two different files apart.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import mlx.core as mx

SAMPLE = 1 << 16  # bytes read per sample
SAMPLES = 8  # samples per weight file besides its header
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()[:12]


def weight_files(path: Path) -> list[Path]:
    """The files holding a checkpoint's weights: the GGUF file or the directory's safetensors."""
    path = Path(path)
    return [path] if path.is_file() else sorted(path.glob("*.safetensors"))


def file_fingerprint(path: Path) -> list[bytes]:
    """Size, the first 64 KiB and 64 KiB at SAMPLES evenly spaced offsets of one file."""
    size = path.stat().st_size
    parts = [path.name.encode(), str(size).encode()]
    with open(path, "rb") as f:
        for i in range(SAMPLES + 1):
            f.seek(i * size // (SAMPLES + 1))
            parts.append(f.read(SAMPLE))
    return parts


def weights_fingerprint(ckpt: Any) -> str:
    """A short hash identifying the checkpoint's weights (see the module docstring)."""
    if getattr(ckpt, "fingerprint", None):  # received from a rank that has the files
        return str(ckpt.fingerprint)
    given = (ckpt.metadata.get("llama_tp") or {}).get("fingerprint")
    if ckpt.format == "split":  # one rank's folder: its files differ from the others' by design
        given = given or ckpt.metadata.get("fingerprint") or "(pre-split, no fingerprint)"
    if given:
        return str(given)
    parts: list[bytes] = []
    for f in getattr(ckpt, "files", None) or weight_files(ckpt.path):
        parts += file_fingerprint(Path(f))
    return digest(parts)


def _metadata_bytes(value: Any) -> bytes:
    if isinstance(value, mx.array):
        return str(value.dtype).encode() + bytes(memoryview(value))
    if hasattr(value, "tobytes") and hasattr(value, "dtype"):  # numpy arrays (GGUF metadata)
        return str(value.dtype).encode() + value.tobytes()
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\0".join(value).encode("utf-8", "surrogatepass")
    return repr(value).encode()


def tokenizer_fingerprint(ckpt: Any, tokenizer: Any) -> str:
    """A short hash of the tokenizer's source: its files, or the GGUF's tokenizer metadata,
    with the end-of-sequence ids in use and the chat template."""
    parts: list[bytes] = []
    if ckpt.format == "gguf":
        for key in sorted(k for k in ckpt.metadata if k.startswith("tokenizer.")):
            parts += [key.encode(), _metadata_bytes(ckpt.metadata[key])]
    else:
        for name in TOKENIZER_FILES:
            f = Path(ckpt.path) / name
            if f.is_file():
                parts += [name.encode(), f.read_bytes()]
    parts.append(repr(sorted(tokenizer.eos_token_ids)).encode())
    parts.append((getattr(tokenizer, "chat_template", None) or "").encode())
    return digest(parts)
