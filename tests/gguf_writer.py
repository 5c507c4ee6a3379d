"""A minimal GGUF writer for tests: tiny Llama files with chosen tensor types.

Only what the tests need: scalar/string metadata and F32 or raw-block tensors.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

F32, Q5_0, Q6_K = 0, 6, 14  # ggml type ids
# type -> (values per block, bytes per block, offset of the block's float16 scale)
BLOCKS = {Q5_0: (32, 22, 0), Q6_K: (256, 210, 208)}


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(v) -> bytes:
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    return struct.pack("<II", 4, v)  # uint32


def write_gguf(path: Path, metadata: dict, tensors: dict[str, tuple[int, tuple, bytes]]) -> None:
    """tensors: name -> (ggml type, shape in ggml order (fastest first), raw bytes)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _string(key) + _value(value)
    offset, blobs = 0, []
    for name, (kind, shape, data) in tensors.items():
        out += _string(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in shape)
        out += struct.pack("<IQ", kind, offset)
        pad = (-len(data)) % 32
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    out += b"\0" * ((-len(out)) % 32)
    path.write_bytes(bytes(out) + b"".join(blobs))


def random_blocks(kind: int, rows: int, cols: int, rng: np.random.Generator) -> bytes:
    """Random but well-formed blocks of a quantized type, each with a small float16 scale."""
    per, size, at = BLOCKS[kind]
    out = bytearray()
    for _ in range(rows * cols // per):
        block = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        block[at : at + 2] = np.float16(0.001).tobytes()
        out += block
    return bytes(out)


def tiny_llama_gguf(path: Path, quantized: dict[str, int] | None = None, seed: int = 0) -> Path:
    """A 1-layer Llama (dim 64, 4 heads, vocab 64) in GGUF, F32 but for `quantized` tensors."""
    rng = np.random.default_rng(seed)
    quantized = quantized or {}
    dim, hidden, vocab, heads = 64, 256, 64, 4
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": dim,
        "llama.block_count": 1,
        "llama.feed_forward_length": hidden,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": heads,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 128,
    }
    shapes = {
        "token_embd.weight": (vocab, dim),
        "output_norm.weight": (dim,),
        "output.weight": (vocab, dim),
        "blk.0.attn_norm.weight": (dim,),
        "blk.0.ffn_norm.weight": (dim,),
        "blk.0.attn_q.weight": (dim, dim),
        "blk.0.attn_k.weight": (dim, dim),
        "blk.0.attn_v.weight": (dim, dim),
        "blk.0.attn_output.weight": (dim, dim),
        "blk.0.ffn_gate.weight": (hidden, dim),
        "blk.0.ffn_up.weight": (hidden, dim),
        "blk.0.ffn_down.weight": (dim, hidden),
    }
    tensors = {}
    for name, shape in shapes.items():
        ggml_shape = tuple(reversed(shape))
        if name in quantized:
            kind = quantized[name]
            tensors[name] = (kind, ggml_shape, random_blocks(kind, shape[0], shape[-1], rng))
        else:
            values = rng.normal(0, shape[-1] ** -0.5, shape).astype(np.float32)
            if name.endswith("norm.weight"):
                values = np.ones(shape, np.float32)
            tensors[name] = (F32, ggml_shape, values.tobytes())
    write_gguf(path, meta, tensors)
    return path
