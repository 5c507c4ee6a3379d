"""GGUF block formats the native kernels compute as stored: sizes, slices, test data."""

from __future__ import annotations

import numpy as np

# GGUF types the kernels compute as stored: name -> (ggml type id, values, bytes per block)
GGUF_TYPES = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84),
    "Q3_K": (11, 256, 110),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}

# Where each type keeps its float16 scale(s) in a block (the rest are integers)
_F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def block_span(start: int, stop: int, type_name: str) -> tuple[int, int, int]:
    """Columns [start, stop) of a GGUF row -> (first byte, end byte, lead): the blocks
    covering them, and how many values of the first block come before `start`."""
    _, per, size = GGUF_TYPES[type_name]
    b0, b1 = start // per, -(-stop // per)
    return b0 * size, b1 * size, start - b0 * per


def row_bytes(cols: int, type_name: str) -> int:
    _, per, size = GGUF_TYPES[type_name]
    if cols % per:
        raise ValueError(f"{type_name} rows hold whole blocks of {per} values, not {cols}")
    return cols // per * size


def random_blocks(type_name: str, rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, blocks * bytes) uint8 of random blocks with moderate float16 scales (random
    bytes there could be inf or nan): for tests and benchmarks."""
    _, per, size = GGUF_TYPES[type_name]
    raw = rng.integers(0, 256, size=(rows * blocks, size), dtype=np.uint8)
    for i, at in enumerate(_F16_FIELDS[type_name]):
        scale = rng.uniform(0.001, 0.05, size=rows * blocks).astype(np.float16)
        if i == 1 and type_name in ("Q4_1", "Q5_1"):
            scale = -scale * 8  # their second field is the block's minimum
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks * size)
