"""Llama 3's RoPE scaling from a GGUF file's `rope_freqs` tensor.

llama.cpp's converter does not write a `rope_type: llama3` config into the metadata: it
writes the per-frequency factors it implies (`rope_freqs`, one per rotated pair: 1 for
the short wavelengths, `factor` for the long ones, smoothed in between), which llama.cpp
divides each frequency by. mlx-lm rotates with the config's four numbers
(`rope_utils.Llama3RoPE`); they come back from the factors: `factor` is the largest,
and the smoothed ones lie on s = (L / wavelength - low) / (high - low), a line in
1 / wavelength whose two numbers give L / low and L / high (the scaling needs no more:
`low` is taken as 1; without smoothed factors, high = low as Llama 4's). The recovered
numbers are checked by recomputing every factor.
"""

from __future__ import annotations

import math

import numpy as np


def factors(base: float, dims: int, scaling: dict) -> np.ndarray:
    """llama.cpp's converter's `rope_freqs` for a llama3 `scaling` (float64)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    waves = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    with np.errstate(divide="ignore", invalid="ignore"):  # low = high: no smoothed ones
        smooth = (old / waves - low) / (high - low)
        out = 1 / ((1 - smooth) / factor + smooth)
    return np.where(waves < old / high, 1.0, np.where(waves > old / low, factor, out))


def llama3_scaling(values: np.ndarray, base: float, dims: int) -> dict | None:
    """mlx-lm's `rope_scaling` whose factors are `values` (None: no scaling, or factors no
    llama3 scaling gives: the caller says so)."""
    f = np.asarray(values, np.float64)
    top = float(f.max())
    if len(f) != dims // 2 or top <= 1 + 1e-6:
        return None
    waves = 2 * math.pi * base ** (np.arange(0, dims, 2) / dims)
    medium = (f > 1 + 1e-5) & (f < top * (1 - 1e-5))
    s = (1 / f[medium] - 1 / top) / (1 - 1 / top)
    if medium.sum() >= 2:  # s = a / wavelength - b: L = a / b, high = (1 + b) / b
        a, b = np.polyfit(1 / waves[medium], s, 1) * (1, -1)
        old, high = (a / b, (1 + b) / b) if b > 0 else (8192.0, 4.0)
    elif medium.sum() == 1:  # llama.cpp's defaults' high = 4: L from the one point
        old, high = float(waves[medium][0] * (3 * s[0] + 1)), 4.0
    else:  # no smoothed factor (Llama 4's low = high = 1): L between the two kinds
        short, long = waves[f <= 1 + 1e-5].max(), waves[f >= top * (1 - 1e-5)].min()
        old, high = (8192.0 if short < 8192 < long else math.sqrt(short * long)), 1.0
    if abs(old - round(old)) < 1e-3 * old:
        old = int(round(old))
    scaling = {
        "rope_type": "llama3",
        "factor": round(top, 6),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(float(high), 6),
        "original_max_position_embeddings": old,
    }
    if not np.allclose(factors(base, dims, scaling), f, rtol=1e-4):
        return None
    return scaling
