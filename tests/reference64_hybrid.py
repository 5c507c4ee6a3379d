"""A float64 forward pass over gguf-py's dequantized weights of a Gated DeltaNet hybrid
GGUF file (`qwen35`, `qwen35moe`, `qwen3next`), as llama.cpp computes it (its
src/models/qwen35.cpp / qwen3next.cpp), sharing no code with llama_tp.

Linear-attention layers (those with `ssm_a`): q | k | v from `attn_qkv` (qwen3next: and
the gate `z` from `attn_gate`, b and a interleaved per key head in `ssm_ba`; qwen35:
`ssm_beta`, `ssm_alpha`) through a causal depthwise conv of `ssm_conv1d` and SiLU; q and k
L2-normalised, q scaled by 1/sqrt(dk); per value head the gated delta rule over a (dv, dk)
state from zero: g = exp(ssm_a * softplus(a + ssm_dt)), beta = sigmoid(b), S <- g S,
S <- S + k (beta (v - S k))^T, y = S q; RMSNorm(y) * silu(z) per head; `ssm_out`. The key
heads repeat for their value heads: tiled in qwen35 files (llama.cpp's converter reorders
the value heads so), grouped in qwen3next files. Full-attention layers: `attn_q` gives
each head its queries and a gate; q/k RMSNorm per head, RoPE (NEOX) on the first
`rope.dimension_count` values, softmax attention, times sigmoid(gate). Then
`post_attention_norm` and the SwiGLU, or the experts plus the gated shared expert
(`reference64._experts`). Multi-token prediction layers skipped.
"""

from __future__ import annotations

import numpy as np
from reference64 import _experts, _rms, _rope, _swiglu, read


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def _linear_attention(h: np.ndarray, w: dict, p: str, meta: dict, arch: str) -> np.ndarray:
    L = h.shape[0]
    nk = int(meta[f"{arch}.ssm.group_count"])
    nv = int(meta[f"{arch}.ssm.time_step_rank"])
    dk = int(meta[f"{arch}.ssm.state_size"])
    dv = int(meta[f"{arch}.ssm.inner_size"]) // nv
    eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
    r = nv // nk
    qkv = h @ w[p + "attn_qkv.weight"].T  # (L, 2 nk dk + nv dv)
    z = (h @ w[p + "attn_gate.weight"].T).reshape(L, nv, dv)
    if p + "ssm_ba.weight" in w:
        ba = (h @ w[p + "ssm_ba.weight"].T).reshape(L, nk, 2 * r)
        b, a = ba[..., :r].reshape(L, nv), ba[..., r:].reshape(L, nv)
    else:
        b, a = h @ w[p + "ssm_beta.weight"].T, h @ w[p + "ssm_alpha.weight"].T
    kernel = w[p + "ssm_conv1d.weight"]  # (C, K)
    K = kernel.shape[1]
    padded = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv])
    conv = np.stack([(padded[t : t + K] * kernel.T).sum(0) for t in range(L)])
    conv = conv * _sigmoid(conv)  # SiLU
    q = conv[:, : nk * dk].reshape(L, nk, dk)
    k = conv[:, nk * dk : 2 * nk * dk].reshape(L, nk, dk)
    v = conv[:, 2 * nk * dk :].reshape(L, nv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + eps) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + eps)
    tiled = arch in ("qwen35", "qwen35moe")
    q = np.tile(q, (1, r, 1)) if tiled else np.repeat(q, r, axis=1)  # (L, nv, dk)
    k = np.tile(k, (1, r, 1)) if tiled else np.repeat(k, r, axis=1)
    sp = np.log1p(np.exp(a + w[p + "ssm_dt.bias"]))  # softplus
    g = np.exp(sp * w[p + "ssm_a"])  # (L, nv)
    beta = _sigmoid(b)
    S = np.zeros((nv, dv, dk))
    ys = []
    for t in range(L):
        S = S * g[t][:, None, None]
        delta = (v[t] - np.einsum("hvk,hk->hv", S, k[t])) * beta[t][:, None]
        S = S + delta[:, :, None] * k[t][:, None, :]
        ys.append(np.einsum("hvk,hk->hv", S, q[t]))
    y = np.stack(ys)  # (L, nv, dv)
    y = _rms(y, w[p + "ssm_norm.weight"], eps) * (z * _sigmoid(z))
    return y.reshape(L, -1) @ w[p + "ssm_out.weight"].T


def _gated_attention(h: np.ndarray, w: dict, p: str, meta: dict, arch: str) -> np.ndarray:
    L = h.shape[0]
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta[f"{arch}.attention.head_count_kv"])
    hd = int(meta[f"{arch}.attention.key_length"])
    eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
    theta = float(meta[f"{arch}.rope.freq_base"])
    dims = int(meta[f"{arch}.rope.dimension_count"])
    qg = (h @ w[p + "attn_q.weight"].T).reshape(L, heads, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(L, heads * hd)
    k = (h @ w[p + "attn_k.weight"].T).reshape(L, kv_heads, hd)
    v = (h @ w[p + "attn_v.weight"].T).reshape(L, kv_heads, hd)
    q = _rope(_rms(q, w[p + "attn_q_norm.weight"], eps), theta, True, dims)
    k = _rope(_rms(k, w[p + "attn_k_norm.weight"], eps), theta, True, dims)
    k = np.repeat(k, heads // kv_heads, axis=1)
    v = np.repeat(v, heads // kv_heads, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + np.triu(np.full((L, L), -np.inf), 1)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", probs, v).reshape(L, heads * hd)
    return (out * _sigmoid(gate)) @ w[p + "attn_output.weight"].T


def logits(path: str, tokens: list[int]) -> np.ndarray:
    """Logits (L, vocab) in float64 for `tokens`, every position (causal)."""
    meta, w = read(path)
    arch = meta["general.architecture"]
    eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
    layers = int(meta[f"{arch}.block_count"]) - int(meta.get(f"{arch}.nextn_predict_layers", 0))
    top_k = int(meta.get(f"{arch}.expert_used_count", 0))
    x = w["token_embd.weight"][tokens]
    for i in range(layers):
        p = f"blk.{i}."
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        mixer = _linear_attention if p + "ssm_a" in w else _gated_attention
        x = x + mixer(h, w, p, meta, arch)
        h = _rms(x, w[p + "post_attention_norm.weight"], eps)
        if p + "ffn_gate_exps.weight" in w:
            x = x + _experts(h, w, p, top_k, True)
        else:
            x = x + _swiglu(
                h, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"]
            )
    x = _rms(x, w["output_norm.weight"], eps)
    return x @ w.get("output.weight", w["token_embd.weight"]).T
