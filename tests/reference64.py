"""A float64 Llama forward pass over gguf-py's dequantized GGUF weights: the reference
llama_tp's GGUF loading is held to (issue 18).

It reads the file with llama.cpp's own Python library (`gguf.GGUFReader` and
`gguf.quants.dequantize`), shares no code with llama_tp, and follows llama.cpp's
layout: weights as stored (rows = outputs), the interleaved RoPE GGUF's Q and K rows are
permuted for (pairs 2i, 2i+1 rotate together), grouped KV heads, RMSNorm, SwiGLU.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf.quants import dequantize


def read(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata key -> value, tensor name -> float64 array in (rows, cols))."""
    reader = gguf.GGUFReader(path)
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("llama.") and field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            meta[key] = field.contents()
    weights = {}
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float64)
        weights[t.name] = values.reshape(tuple(reversed(t.shape.tolist())))
    return meta, weights


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """(L, heads, hd) rotated by position, adjacent pairs together (llama.cpp's 'normal')."""
    L, _, hd = x.shape
    freqs = theta ** (-np.arange(0, hd, 2) / hd)  # (hd/2,)
    angle = np.arange(L)[:, None] * freqs[None, :]  # (L, hd/2)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def logits(path: str, tokens: list[int]) -> np.ndarray:
    """Logits (L, vocab) in float64 for `tokens`, every position (causal)."""
    meta, w = read(path)
    heads = int(meta["llama.attention.head_count"])
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    eps = float(meta["llama.attention.layer_norm_rms_epsilon"])
    theta = float(meta.get("llama.rope.freq_base", 10000.0))
    layers = int(meta["llama.block_count"])
    x = w["token_embd.weight"][tokens]  # (L, dim)
    L, dim = x.shape
    hd = dim // heads
    mask = np.triu(np.full((L, L), -np.inf), 1)
    for i in range(layers):
        p = f"blk.{i}."
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        q = _rope((h @ w[p + "attn_q.weight"].T).reshape(L, heads, hd), theta)
        k = _rope((h @ w[p + "attn_k.weight"].T).reshape(L, kv_heads, hd), theta)
        v = (h @ w[p + "attn_v.weight"].T).reshape(L, kv_heads, hd)
        k = np.repeat(k, heads // kv_heads, axis=1)
        v = np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(L, dim)
        x = x + attn @ w[p + "attn_output.weight"].T
        h = _rms(x, w[p + "ffn_norm.weight"], eps)
        gate = h @ w[p + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "ffn_up.weight"].T)) @ (
            w[p + "ffn_down.weight"].T
        )
    x = _rms(x, w["output_norm.weight"], eps)
    head = w.get("output.weight", w["token_embd.weight"])
    return x @ head.T


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def top5_gap(got: np.ndarray, ref: np.ndarray) -> float:
    """Largest |log p| difference (nats) at the reference's top 5 tokens, any position."""
    got, ref = log_softmax(got.astype(np.float64)), log_softmax(ref)
    top = np.argsort(-ref, axis=-1)[:, :5]
    return float(np.abs(np.take_along_axis(got, top, -1) - np.take_along_axis(ref, top, -1)).max())
