"""GGUF (llama.cpp) quantization blocks -> MLX affine quantization, in vectorized numpy.

MLX stores a quantized (rows, cols) matrix as `weight` uint32 (rows, cols * bits / 32),
the `bits`-bit values packed as one little-endian bit stream per row, and `scales`,
`biases` (rows, cols / 32) for group size 32, with `w = scale * q + bias` per group.

- Exact (up to rounding scale and bias to float16): Q4_0, Q4_1 (4 bits), Q5_0, Q5_1
  (5 bits), Q8_0 (8 bits), and the K-quants whose 32-value sub-blocks carry their own
  scale and minimum, Q4_K (4 bits) and Q5_K (5 bits).
- Requantized: Q6_K, Q3_K, Q2_K have 16-value sub-blocks, which MLX groups cannot
  hold. They are dequantized (exactly, in float32) and requantized per group of 32
  with min-max affine quantization at `REQUANT_BITS`; the error is bounded by half
  a step of the new grid (docs/models.md, "Formats", has the measured bound).

MXFP4 (gpt-oss's experts: 32 values of 4-bit E2M1 under one E8M0 exponent) is MLX's
`mxfp4` mode already: the same codes and exponent, only the nibbles ordered otherwise
(`mxfp4_to_mlx`), so it is held as stored, 17 bytes per 32 values, never dequantized.

Every group of 32 is converted on its own, so a slice of a tensor that starts and
stops on a 32-value boundary converts to exactly that slice of the whole tensor.
"""

from __future__ import annotations

import numpy as np

from .gguf_header import GGML_TYPES

GROUP = 32  # MLX group size of every converted tensor
QK_K = 256
# GGUF type -> MLX bits, for the types converted exactly
EXACT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
# GGUF type -> MLX bits after requantization: the smallest width whose worst error on
# random blocks stays well inside half the source's own step (<= 0.6 of it; 6 bits for
# Q6_K reach 1.0, 4 bits for Q2_K 1.03). Measured in tests/test_gguf_quants.py.
REQUANT_BITS = {"Q6_K": 8, "Q3_K": 4, "Q2_K": 5}
# GGUF type -> (values per block, bytes per block) of the quantized types handled here
BLOCKS = {
    name: (per, size)
    for name, per, size in GGML_TYPES.values()
    if name in EXACT_BITS or name in REQUANT_BITS
}

MXFP4 = "MXFP4"  # held in MLX's mxfp4 mode: weight uint32 and scales uint8, no biases

_SHIFT2 = np.array([0, 2, 4, 6], np.uint8)  # the four 2-bit fields of a byte


def mlx_bits(type_name: str) -> int | None:
    """MLX bits a GGUF quantized type becomes (None: a float type or unsupported)."""
    return EXACT_BITS.get(type_name) or REQUANT_BITS.get(type_name)


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 -> (n, 1) float32 from little-endian float16."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """(n, chunks * width) bytes -> (n, chunks * 2, width): low nibbles, then high, per chunk."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, width)
    out = np.empty((n, qs.shape[1], 2, width), np.uint8)
    np.bitwise_and(qs, 15, out=out[:, :, 0])
    np.right_shift(qs, 4, out=out[:, :, 1])
    return out.reshape(n, -1, width)


def _bits_of(bytes_: np.ndarray, count: int) -> np.ndarray:
    """(n, k) bytes -> (n, count) of their bits, least significant first."""
    return np.unpackbits(bytes_, axis=-1, bitorder="little")[:, :count]


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit (scale, min) pairs -> two (n, 8) uint8 arrays."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc, mn


def _exact(type_name: str, blk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, bytes per block) -> q (groups, 32) uint8, scale and bias (groups,) float32."""
    n = blk.shape[0]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(blk[:, 0:2])[:, 0]
        has_min = type_name.endswith("_1")
        at = 4 if has_min else 2
        if type_name.startswith("Q5"):
            high = _bits_of(blk[:, at : at + 4], 32)
            at += 4
        q = _nibbles(blk[:, at : at + 16], 16).reshape(n, 32)
        if type_name.startswith("Q5"):
            q = q | (high << 4)
        if has_min:
            return q, d, _f16(blk[:, 2:4])[:, 0]
        return q, d, -d * (16 if type_name == "Q5_0" else 8)
    if type_name == "Q8_0":
        d = _f16(blk[:, 0:2])[:, 0]
        q = (blk[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, -128 * d
    # Q4_K / Q5_K: d, dmin (float16), 12 bytes of scales and mins, [qh 32 bytes], qs 128 bytes
    d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
    sc, mn = _k_scale_min(blk[:, 4:16])
    at = 16
    q = None
    if type_name == "Q5_K":
        # bit j of qh[i] is the high bit of value i of sub-block j
        high = _bits_of(blk[:, 16:48].reshape(n * 32, 1), 8).reshape(n, 32, 8)
        high = high.transpose(0, 2, 1)  # (n, sub-block, value)
        at = 48
    q = _nibbles(blk[:, at : at + 128], 32)  # (n, 8, 32): sub-blocks 0, 1, 2, ...
    if type_name == "Q5_K":
        q = q | (high << 4)
    scale = (d * sc.astype(np.float32)).reshape(-1)
    bias = -(dmin * mn.astype(np.float32)).reshape(-1)
    return q.reshape(-1, 32), scale, bias


def dequantize(type_name: str, blk: np.ndarray) -> np.ndarray:
    """(n, bytes per block) of any type handled here -> (n, values per block) float32."""
    n = blk.shape[0]
    if type_name in EXACT_BITS:
        q, scale, bias = _exact(type_name, blk)
        return (q * scale[:, None] + bias[:, None]).reshape(n, -1)
    if type_name == "Q6_K":
        # ql 128 bytes, qh 64 bytes, 16 int8 scales, d
        # value 32 * k + i of half h: low bits in nibble k // 2 of byte 64 h + 32 (k % 2) + i,
        # high bits at bit 2 k of byte 32 h + i of qh
        low = _nibbles(blk[:, 0:128], 64).reshape(n, 2, 4, 32)
        qh = blk[:, 128:192].reshape(n, 2, 1, 32)
        qh = (qh >> _SHIFT2.reshape(1, 1, 4, 1)) & 3
        q = (low | (qh << 4)).astype(np.float32) - 32
        scales = blk[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blk[:, 208:210])
        return (q.reshape(n, 16, 16) * (d * scales)[:, :, None]).reshape(n, QK_K)
    if type_name == "Q3_K":
        # hmask 32 bytes, qs 64 bytes, 12 bytes of 6-bit scales, d
        hm = _bits_of(blk[:, 0:32].reshape(n * 32, 1), 8).reshape(n, 32, 8).transpose(0, 2, 1)
        qs = blk[:, 32:96].reshape(n, 2, 1, 32)
        low = (qs >> _SHIFT2.reshape(1, 1, 4, 1)) & 3  # (n, 2, 4, 32)
        q = low.reshape(n, 8, 32).astype(np.int8) - ((1 - hm) << 2).astype(np.int8)
        s = blk[:, 96:108]
        lo = _nibbles(s[:, 0:8], 8).reshape(n, 16)
        hi = (s[:, 8:12].reshape(n, 1, 4) >> _SHIFT2.reshape(1, 4, 1)) & 3
        scales = (lo | (hi.reshape(n, 16) << 4)).astype(np.float32) - 32
        d = _f16(blk[:, 108:110])
        return (q.reshape(n, 16, 16) * (d * scales)[:, :, None]).reshape(n, QK_K)
    if type_name == "Q2_K":
        # 16 bytes of 4-bit (scale, min), qs 64 bytes, d, dmin
        s = blk[:, 0:16]
        qs = blk[:, 16:80].reshape(n, 2, 1, 32)
        q = ((qs >> _SHIFT2.reshape(1, 1, 4, 1)) & 3).reshape(n, 16, 16)
        d, dmin = _f16(blk[:, 80:82]), _f16(blk[:, 82:84])
        dl = d * (s & 15).astype(np.float32)
        ml = dmin * (s >> 4).astype(np.float32)
        return (q * dl[:, :, None] - ml[:, :, None]).reshape(n, QK_K)
    raise ValueError(f"no decoder for GGUF type {type_name}")


def _reduce(w: np.ndarray, op: np.ufunc) -> np.ndarray:
    """op over each row of (n, 2**k): halving steps (numpy reduces short rows slowly)."""
    while w.shape[1] > 1:
        half = w.shape[1] // 2
        w = op(w[:, :half], w[:, half:])
    return w[:, 0]


def requantize(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(groups, 32) float32 -> min-max affine q (groups, 32) uint8, scale, bias (float16-exact).

    The scale is rounded up to float16 so that the group's range stays on the grid;
    q is computed against the rounded scale and bias, so the error is at most half
    a step (plus float16 rounding of the bias).
    """
    lo, hi = _reduce(w, np.minimum), _reduce(w, np.maximum)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).astype(np.float16)
    short = scale.astype(np.float32) * levels < hi - lo
    scale = np.where(short, np.nextafter(scale, np.float16(np.inf)), scale).astype(np.float32)
    bias = lo.astype(np.float16).astype(np.float32)
    inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)
    t = w - bias[:, None]
    t *= inverse[:, None]
    np.rint(t, out=t)
    np.clip(t, 0, levels, out=t)
    return t.astype(np.uint8), scale, bias


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(rows, cols) uint8 values < 2**bits -> (rows, cols * bits / 32) uint32, MLX's layout:
    one little-endian bit stream per row."""
    rows = q.shape[0]
    if bits == 8:
        return np.ascontiguousarray(q).view(np.uint32).reshape(rows, -1)
    if bits in (2, 4):  # whole values per byte
        per = 8 // bits
        e = q.reshape(-1, per)
        byte = e[:, 0].copy()
        for k in range(1, per):
            byte |= e[:, k] << (bits * k)
        return byte.reshape(rows, -1).view(np.uint32)
    e = q.reshape(-1, 8)  # 8 values fill `bits` bytes
    stream = e[:, 0].astype(np.uint64)
    for k in range(1, 8):
        stream |= e[:, k].astype(np.uint64) << np.uint64(bits * k)
    out = np.ascontiguousarray(stream.view(np.uint8).reshape(-1, 8)[:, :bits])
    return out.reshape(rows, -1).view(np.uint32)


def to_mlx(type_name: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, bytes per row) uint8 of whole blocks -> MLX (weight uint32, scales float16,
    biases float16), shapes (rows, cols * bits / 32), (rows, cols / 32), (rows, cols / 32)."""
    rows = raw.shape[0]
    per, size = BLOCKS[type_name]
    blk = raw.reshape(-1, size)
    if type_name in EXACT_BITS:
        bits = EXACT_BITS[type_name]
        q, scale, bias = _exact(type_name, blk)
    else:
        bits = REQUANT_BITS[type_name]
        q, scale, bias = requantize(dequantize(type_name, blk).reshape(-1, GROUP), bits)
    weight = pack(q.reshape(rows, -1), bits)
    return (
        weight,
        scale.astype(np.float16).reshape(rows, -1),
        bias.astype(np.float16).reshape(rows, -1),
    )


def mxfp4_to_mlx(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, blocks * 17) uint8 of whole MXFP4 blocks -> MLX's mxfp4 (weight uint32
    (rows, blocks * 4), scales uint8 (rows, blocks)). A ggml block is the exponent then
    16 bytes whose low nibbles are values 0..15 and high nibbles values 16..31
    (dequantize_row_mxfp4); MLX packs values 2i and 2i+1 into byte i, low nibble first.
    The 4-bit codes and the exponent are the same: only the nibbles move."""
    rows = raw.shape[0]
    blk = raw.reshape(-1, 17)
    qs = blk[:, 1:]
    values = np.concatenate([qs & 15, qs >> 4], axis=1)  # (blocks, 32) codes in order
    packed = values[:, 0::2] | (values[:, 1::2] << 4)
    weight = np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32)
    return weight, np.ascontiguousarray(blk[:, 0]).reshape(rows, -1)
