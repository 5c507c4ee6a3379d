"""A float64 forward pass of a GGUF `gpt-oss` file, as llama.cpp computes it (its
LLM_ARCH_OPENAI_MOE graph), over gguf-py's dequantization of the stored bytes (MXFP4
experts included: ggml's nibble order, E8M0 exponents). Shares no code with llama_tp.

- attention with biases on q/k/v/output; RoPE on the halves of each head (NEOX) with
  YaRN as ggml's rope_yarn: corrected dimensions floor/ceil'd from beta_fast /
  beta_slow, the ramp mixing interpolated and extrapolated angles, cos and sin times
  1 + 0.1 ln(factor);
- a sink logit per head in every softmax's denominator; even layers attend to the last
  `attention.sliding_window` positions (llama.cpp's swa pattern 2), odd ones to all;
- the router's biased logits, top-k, softmax over those k; each chosen expert's biased
  gate / up, the clamped SwiGLU (gate <= 7, |up| <= 7, gate * sigmoid(1.702 gate) *
  (up + 1)), biased down.
"""

from __future__ import annotations

import math

import numpy as np
from reference64 import _rms, read

_ALPHA, _LIMIT = 1.702, 7.0


def _yarn_rope(x: np.ndarray, meta: dict) -> np.ndarray:
    """(L, heads, hd) rotated on the halves of each head, YaRN-scaled if the file says."""
    a = "gpt-oss"
    L, _, hd = x.shape
    base = float(meta[f"{a}.rope.freq_base"])
    extrap = base ** (-np.arange(0, hd, 2) / hd)  # (hd/2,) angle per position
    freqs, mscale = extrap, 1.0
    if meta.get(f"{a}.rope.scaling.type") == "yarn":
        factor = float(meta[f"{a}.rope.scaling.factor"])
        orig = float(meta[f"{a}.rope.scaling.original_context_length"])

        def corr(rotations: float) -> float:
            return hd * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(0, math.floor(corr(float(meta[f"{a}.rope.scaling.yarn_beta_fast"]))))
        high = min(hd - 1, math.ceil(corr(float(meta[f"{a}.rope.scaling.yarn_beta_slow"]))))
        ramp = 1 - np.clip((np.arange(hd // 2) - low) / max(0.001, high - low), 0, 1)
        freqs = extrap / factor * (1 - ramp) + extrap * ramp
        mscale = 1 + 0.1 * math.log(factor)
    angle = np.arange(L)[:, None] * freqs[None, :]
    cos, sin = (mscale * np.cos(angle))[:, None, :], (mscale * np.sin(angle))[:, None, :]
    u, v = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([u * cos - v * sin, u * sin + v * cos], axis=-1)


def _experts(h: np.ndarray, w: dict, p: str, k: int) -> np.ndarray:
    logits = h @ w[p + "ffn_gate_inp.weight"].T + w[p + "ffn_gate_inp.bias"]
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-logits[t])[:k]
        weights = np.exp(logits[t, top] - logits[t, top].max())
        for e, wt in zip(top, weights / weights.sum(), strict=True):

            def proj(name, x, e=e):
                return x @ w[f"{p}ffn_{name}_exps.weight"][e].T + w[f"{p}ffn_{name}_exps.bias"][e]

            gate = np.minimum(proj("gate", h[t]), _LIMIT)
            up = np.clip(proj("up", h[t]), -_LIMIT, _LIMIT)
            out[t] += wt * proj("down", gate / (1 + np.exp(-_ALPHA * gate)) * (up + 1))
    return out


def logits(path: str, tokens: list[int]) -> np.ndarray:
    """Logits (L, vocab) in float64 for `tokens`, every position (causal)."""
    meta, w = read(path)
    a = "gpt-oss"
    heads, kv = int(meta[f"{a}.attention.head_count"]), int(meta[f"{a}.attention.head_count_kv"])
    hd, eps = (
        int(meta[f"{a}.attention.key_length"]),
        float(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
    )
    window, k = int(meta[f"{a}.attention.sliding_window"]), int(meta[f"{a}.expert_used_count"])
    x = w["token_embd.weight"][tokens]
    L = x.shape[0]
    q_pos, k_pos = np.arange(L)[:, None], np.arange(L)[None, :]
    for i in range(int(meta[f"{a}.block_count"])):
        p = f"blk.{i}."
        seen = k_pos <= q_pos
        if i % 2 == 0:
            seen &= q_pos - k_pos < window
        mask = np.where(seen, 0.0, -np.inf)

        def proj(h, name, n, p=p):
            return (h @ w[p + name + ".weight"].T + w[p + name + ".bias"]).reshape(L, n, hd)

        h = _rms(x, w[p + "attn_norm.weight"], eps)
        q, key, v = proj(h, "attn_q", heads), proj(h, "attn_k", kv), proj(h, "attn_v", kv)
        q, key = _yarn_rope(q, meta), _yarn_rope(key, meta)
        key, v = np.repeat(key, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, key) / np.sqrt(hd) + mask
        sinks = w[p + "attn_sinks.weight"].reshape(heads, 1, 1)
        top = np.maximum(scores.max(axis=-1, keepdims=True), sinks)
        e = np.exp(scores - top)
        probs = e / (e.sum(axis=-1, keepdims=True) + np.exp(sinks - top))
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(L, heads * hd)
        x = x + attn @ w[p + "attn_output.weight"].T + w[p + "attn_output.bias"]
        x = x + _experts(_rms(x, w[p + "post_attention_norm.weight"], eps), w, p, k)
    x = _rms(x, w["output_norm.weight"], eps)
    return x @ w.get("output.weight", w["token_embd.weight"]).T
