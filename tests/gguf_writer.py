"""A minimal GGUF writer for tests: tiny Llama files with chosen tensor types.

Only what the tests need: scalar/string metadata and F32 or raw-block tensors.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

F32, F16 = 0, 1  # ggml type ids
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL = 20
NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K"}
NAMES.update({12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 0: "F32", 1: "F16"})
# type -> (values per block, bytes per block, {offset of a float16 field: its typical size})
# The float16 scales are set so that weights come out about 0.1 at most.
BLOCKS = {
    Q4_0: (32, 18, {0: 0.1 / 8}),
    Q4_1: (32, 20, {0: 0.1 / 15, 2: -0.05}),
    Q5_0: (32, 22, {0: 0.1 / 16}),
    Q5_1: (32, 24, {0: 0.1 / 31, 2: -0.05}),
    Q8_0: (32, 34, {0: 0.1 / 127}),
    Q2_K: (256, 84, {80: 0.1 / 45, 82: 0.05 / 15}),
    Q3_K: (256, 110, {108: 0.1 / 128}),
    Q4_K: (256, 144, {0: 0.1 / 945, 2: 0.05 / 63}),
    Q5_K: (256, 176, {0: 0.1 / 1953, 2: 0.05 / 63}),
    Q6_K: (256, 210, {208: 0.1 / 4096}),
    IQ4_NL: (32, 18, {0: 0.01}),
}


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(v) -> bytes:
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, list):  # arrays of strings, float32 or int32
        if all(isinstance(x, str) for x in v):
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(map(_string, v))
        if any(isinstance(x, float) for x in v):
            return struct.pack("<IIQ", 9, 6, len(v)) + np.asarray(v, "<f4").tobytes()
        return struct.pack("<IIQ", 9, 5, len(v)) + np.asarray(v, "<i4").tobytes()
    return struct.pack("<II", 4, v)  # uint32


def llama_vocabulary(size: int) -> dict:
    """Tokenizer metadata of a made-up sentencepiece ("llama") vocabulary of `size` tokens:
    <unk>, <s>, </s>, the 256 byte tokens, then pieces `▁t3`, `▁t4`, ..."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581t{i}" for i in range(len(tokens), size)]
    types = [2, 3, 3] + [6] * 256 + [1] * (size - 259)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-float(i) for i in range(size)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def write_gguf(path: Path, metadata: dict, tensors: dict[str, tuple[int, tuple, bytes]]) -> None:
    """tensors: name -> (ggml type, shape in ggml order (fastest first), raw bytes, or a
    function returning them: called once, as the file is written, for large files)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _string(key) + _value(value)
    offset, sizes = 0, []
    for name, (kind, shape, _) in tensors.items():
        out += _string(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in shape)
        out += struct.pack("<IQ", kind, offset)
        per, size = (1, 2 if kind == F16 else 4) if kind in (F32, F16) else BLOCKS[kind][:2]
        nbytes = int(np.prod(shape)) // per * size
        sizes.append(nbytes)
        offset += nbytes + (-nbytes) % 32
    out += b"\0" * ((-len(out)) % 32)
    with open(path, "wb") as f:
        f.write(out)
        for (name, (_, _, data)), nbytes in zip(tensors.items(), sizes, strict=True):
            data = data() if callable(data) else data
            if len(data) != nbytes:
                raise ValueError(f"{name}: {len(data)} bytes given, {nbytes} expected")
            f.write(data + b"\0" * ((-len(data)) % 32))


def random_blocks(kind: int, rows: int, cols: int, rng: np.random.Generator) -> bytes:
    """Random but well-formed blocks of a quantized type: random bits, and float16
    scales (and minimums) between 0.5 and 1 times the type's typical size."""
    per, size, fields = BLOCKS[kind]
    n = rows * cols // per
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at, typical in fields.items():
        values = (typical * rng.uniform(0.5, 1.0, n)).astype(np.float16)
        blocks[:, at : at + 2] = values.view(np.uint8).reshape(n, 2)
    return blocks.tobytes()


def tiny_llama_gguf(
    path: Path,
    quantized: dict[str, int] | None = None,
    seed: int = 0,
    dim: int = 64,
    hidden: int = 256,
    vocab: int = 64,
    heads: int = 4,
    kv_heads: int | None = None,
    layers: int = 1,
    metadata: dict | None = None,
) -> Path:
    """A small Llama in GGUF (default: 1 layer, dim 64, 4 heads, vocab 64), F32 but for
    `quantized` tensors (GGUF name -> type; `blk.*.` names apply to every layer)."""
    rng = np.random.default_rng(seed)
    quantized = quantized or {}
    kv_heads = kv_heads or heads
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": dim,
        "llama.block_count": layers,
        "llama.feed_forward_length": hidden,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 128,
        **(metadata or {}),
    }
    kv = dim // heads * kv_heads
    layer = {
        "attn_norm.weight": (dim,),
        "ffn_norm.weight": (dim,),
        "attn_q.weight": (dim, dim),
        "attn_k.weight": (kv, dim),
        "attn_v.weight": (kv, dim),
        "attn_output.weight": (dim, dim),
        "ffn_gate.weight": (hidden, dim),
        "ffn_up.weight": (hidden, dim),
        "ffn_down.weight": (dim, hidden),
    }
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,)}
    shapes["output.weight"] = (vocab, dim)
    for i in range(layers):
        shapes.update({f"blk.{i}.{k}": v for k, v in layer.items()})
    tensors = {}
    for name, shape in shapes.items():
        ggml_shape = tuple(reversed(shape))
        generic = re.sub(r"^blk\.\d+\.", "blk.*.", name)
        kind = quantized.get(name, quantized.get(generic))
        if kind == F16:
            values = rng.normal(0, shape[-1] ** -0.5, shape).astype(np.float16)
            tensors[name] = (F16, ggml_shape, values.tobytes())
        elif kind is not None:
            tensors[name] = (kind, ggml_shape, random_blocks(kind, shape[0], shape[-1], rng))
        else:
            values = rng.normal(0, shape[-1] ** -0.5, shape).astype(np.float32)
            if name.endswith("norm.weight"):
                values = np.ones(shape, np.float32)
            tensors[name] = (F32, ggml_shape, values.tobytes())
    write_gguf(path, meta, tensors)
    return path
