"""A float64 forward pass over gguf-py's dequantized GGUF weights: the reference
llama_tp's GGUF loading is held to (issues 18 and 26).

It reads the file with llama.cpp's own Python library (`gguf.GGUFReader` and
`gguf.quants.dequantize`), shares no code with llama_tp, and follows llama.cpp's
layout: weights as stored (rows = outputs); RoPE on interleaved pairs for the llama
architecture (its Q and K rows are permuted for it) and on the halves of each head for
qwen2/qwen3/qwen2moe/qwen3moe; q/k biases where the file has them; Qwen3's per-head
q/k RMSNorm; grouped KV heads, RMSNorm, SwiGLU; mixtures of experts as llama.cpp's
build_moe_ffn computes them (softmax over all experts, top-k, renormalised but for
qwen2moe, plus qwen2moe's shared expert behind a sigmoid gate). DeepSeek-V3 (deepseek2) and
GLM-4.5 (glm4moe): sigmoid routing with the `exp_probs_b` bias in groups, scaled, plus
ungated shared experts; deepseek2's latent attention (keys and values expanded per head
from the latent, through attn_kv_b or attn_k_b / attn_v_b; RoPE on adjacent pairs of the
decoupled part); glm4moe's partial RoPE on the halves of the first `rope.dimension_count`
values; multi-token prediction layers (`nextn_predict_layers`) skipped. No YaRN.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf.quants import dequantize


def read(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata key -> value, tensor name -> float64 array in (rows, cols) or, stacked
    experts, (experts, rows, cols))."""
    reader = gguf.GGUFReader(path)
    meta = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            meta[key] = field.contents()
    weights = {}
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float64)
        weights[t.name] = values.reshape(tuple(reversed(t.shape.tolist())))
    return meta, weights


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, theta: float, neox: bool, dims: int = 0) -> np.ndarray:
    """(L, heads, hd) rotated by position: adjacent pairs together (llama.cpp's 'normal',
    the llama architecture) or the two halves of each head ('neox': the Qwen ones); only
    the first `dims` values (0: all), the rest as they are."""
    if dims and dims < x.shape[-1]:
        return np.concatenate([_rope(x[..., :dims], theta, neox), x[..., dims:]], axis=-1)
    L, _, hd = x.shape
    freqs = theta ** (-np.arange(0, hd, 2) / hd)  # (hd/2,)
    angle = np.arange(L)[:, None] * freqs[None, :]  # (L, hd/2)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    if neox:
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def _swiglu(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    g = h @ gate.T
    return (g / (1 + np.exp(-g)) * (h @ up.T)) @ down.T


def _experts(h: np.ndarray, w: dict, p: str, k: int, norm: bool) -> np.ndarray:
    """llama.cpp's build_moe_ffn: softmax over all experts, the top k, their weights
    renormalised (`norm`), each chosen expert's SwiGLU; plus the shared expert behind
    its sigmoid gate (Qwen2-MoE)."""
    logits = h @ w[p + "ffn_gate_inp.weight"].T  # (L, E)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        top = np.argsort(-probs[t])[:k]
        weights = probs[t, top] / (probs[t, top].sum() if norm else 1.0)
        for e, wt in zip(top, weights, strict=True):
            out[t] += (
                wt
                * _swiglu(
                    h[t : t + 1],
                    w[p + "ffn_gate_exps.weight"][e],
                    w[p + "ffn_up_exps.weight"][e],
                    w[p + "ffn_down_exps.weight"][e],
                )[0]
            )
    if p + "ffn_gate_shexp.weight" in w:
        gate = h @ w[p + "ffn_gate_inp_shexp.weight"].reshape(-1)  # (L,)
        shared = _swiglu(
            h, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
            w[p + "ffn_down_shexp.weight"],
        )  # fmt: skip
        out += (1 / (1 + np.exp(-gate)))[:, None] * shared
    return out


def _sigmoid_experts(h: np.ndarray, w: dict, p: str, meta: dict, arch: str) -> np.ndarray:
    """llama.cpp's build_moe_ffn with sigmoid gating: scores plus `exp_probs_b` choose
    the top k among the best `expert_group_used_count` groups (a group scored by its two
    best), the chosen sigmoid scores weigh them (renormalised with expert_weights_norm,
    times expert_weights_scale); the shared experts added without a gate."""
    k = int(meta[f"{arch}.expert_used_count"])
    groups = int(meta.get(f"{arch}.expert_group_count", 1))
    used = int(meta.get(f"{arch}.expert_group_used_count", 1))
    norm = bool(meta.get(f"{arch}.expert_weights_norm", False))
    scale = float(meta.get(f"{arch}.expert_weights_scale", 1.0))
    probs = 1 / (1 + np.exp(-(h @ w[p + "ffn_gate_inp.weight"].T)))  # (L, E)
    choice = probs + w[p + "exp_probs_b.bias"]
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        by_group = choice[t].reshape(groups, -1)
        best = np.argsort(-np.sort(by_group, axis=-1)[:, -2:].sum(-1))[:used]
        masked = np.full_like(by_group, -np.inf)
        masked[best] = by_group[best]
        top = np.argsort(-masked.reshape(-1))[:k]
        weights = probs[t, top] / (probs[t, top].sum() if norm else 1.0) * scale
        for e, wt in zip(top, weights, strict=True):
            out[t] += (
                wt
                * _swiglu(
                    h[t : t + 1],
                    w[p + "ffn_gate_exps.weight"][e],
                    w[p + "ffn_up_exps.weight"][e],
                    w[p + "ffn_down_exps.weight"][e],
                )[0]
            )
    if p + "ffn_gate_shexp.weight" in w:
        out += _swiglu(
            h, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"],
            w[p + "ffn_down_shexp.weight"],
        )  # fmt: skip
    return out


def _latent_attention(h: np.ndarray, w: dict, p: str, meta: dict, mask: np.ndarray) -> np.ndarray:
    """deepseek2's attention: each head's key and value from the normalised latent, its
    query and key RoPE parts (adjacent pairs) apart; (L, dim) -> (L, heads * v)."""
    a = "deepseek2"
    L, heads = h.shape[0], int(meta[f"{a}.attention.head_count"])
    eps = float(meta[f"{a}.attention.layer_norm_rms_epsilon"])
    theta = float(meta.get(f"{a}.rope.freq_base", 10000.0))
    rope, rank = int(meta[f"{a}.rope.dimension_count"]), int(meta[f"{a}.attention.kv_lora_rank"])
    key = int(meta.get(f"{a}.attention.key_length_mla", meta[f"{a}.attention.key_length"]))
    nope = key - rope
    if p + "attn_q_a.weight" in w:
        q = _rms(h @ w[p + "attn_q_a.weight"].T, w[p + "attn_q_a_norm.weight"], eps)
        q = q @ w[p + "attn_q_b.weight"].T
    else:
        q = h @ w[p + "attn_q.weight"].T
    q = q.reshape(L, heads, key)
    kv = h @ w[p + "attn_kv_a_mqa.weight"].T
    c, k_pe = _rms(kv[:, :rank], w[p + "attn_kv_a_norm.weight"], eps), kv[:, rank:]
    if p + "attn_kv_b.weight" in w:
        kv_b = w[p + "attn_kv_b.weight"].reshape(heads, -1, rank)
        k_nope = np.einsum("lr,hnr->lhn", c, kv_b[:, :nope])
        v = np.einsum("lr,hvr->lhv", c, kv_b[:, nope:])
    else:
        k_nope = np.einsum("lr,hrn->lhn", c, w[p + "attn_k_b.weight"])
        v = np.einsum("lr,hvr->lhv", c, w[p + "attn_v_b.weight"])
    q_pe = _rope(q[..., nope:], theta, neox=False)
    k_pe = _rope(k_pe[:, None, :], theta, neox=False)
    scores = np.einsum("qhd,khd->hqk", q[..., :nope], k_nope)
    scores += np.einsum("qhd,kd->hqk", q_pe, k_pe[:, 0])
    scores = scores / np.sqrt(key) + mask
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v).reshape(L, -1)


def logits(path: str, tokens: list[int]) -> np.ndarray:
    """Logits (L, vocab) in float64 for `tokens`, every position (causal)."""
    meta, w = read(path)
    arch = meta["general.architecture"]
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    layers = int(meta[f"{arch}.block_count"]) - int(meta.get(f"{arch}.nextn_predict_layers", 0))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", 0))
    top_k = int(meta.get(f"{arch}.expert_used_count", 0))
    norm_topk = arch != "qwen2moe"  # llama.cpp: Mixtral and Qwen3-MoE renormalise
    neox = arch != "llama"
    x = w["token_embd.weight"][tokens]  # (L, dim)
    L, dim = x.shape
    hd = int(meta.get(f"{arch}.attention.key_length", dim // heads))
    mask = np.triu(np.full((L, L), -np.inf), 1)
    for i in range(layers):
        p = f"blk.{i}."

        def proj(h, name, out_heads, p=p):
            y = h @ w[p + name + ".weight"].T + w.get(p + name + ".bias", 0.0)
            return y.reshape(L, out_heads, hd)

        h = _rms(x, w[p + "attn_norm.weight"], eps)
        if arch == "deepseek2":
            x = x + _latent_attention(h, w, p, meta, mask) @ w[p + "attn_output.weight"].T
            x = x + _feed_forward(_rms(x, w[p + "ffn_norm.weight"], eps), w, p, meta, arch)
            continue
        q, k, v = proj(h, "attn_q", heads), proj(h, "attn_k", kv_heads), proj(h, "attn_v", kv_heads)
        if p + "attn_q_norm.weight" in w:  # Qwen3: each head normalised before RoPE
            q = _rms(q, w[p + "attn_q_norm.weight"], eps)
            k = _rms(k, w[p + "attn_k_norm.weight"], eps)
        q, k = _rope(q, theta, neox, rope_dims), _rope(k, theta, neox, rope_dims)
        k = np.repeat(k, heads // kv_heads, axis=1)
        v = np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(L, heads * hd)
        x = x + attn @ w[p + "attn_output.weight"].T
        norm = w.get(p + "ffn_norm.weight", w.get(p + "post_attention_norm.weight"))
        h = _rms(x, norm, eps)  # glm4moe names it post_attention_norm
        if p + "ffn_gate_exps.weight" in w and p + "exp_probs_b.bias" not in w:
            x = x + _experts(h, w, p, top_k, norm_topk)
        else:
            x = x + _feed_forward(h, w, p, meta, arch)
    x = _rms(x, w["output_norm.weight"], eps)
    head = w.get("output.weight", w["token_embd.weight"])
    return x @ head.T


def _feed_forward(h: np.ndarray, w: dict, p: str, meta: dict, arch: str) -> np.ndarray:
    """A dense SwiGLU, or the sigmoid-routed experts of deepseek2 / glm4moe."""
    if p + "ffn_gate_exps.weight" in w:
        return _sigmoid_experts(h, w, p, meta, arch)
    return _swiglu(h, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def top5_gap(got: np.ndarray, ref: np.ndarray) -> float:
    """Largest |log p| difference (nats) at the reference's top 5 tokens, any position."""
    got, ref = log_softmax(got.astype(np.float64)), log_softmax(ref)
    top = np.argsort(-ref, axis=-1)[:, :5]
    return float(np.abs(np.take_along_axis(got, top, -1) - np.take_along_axis(ref, top, -1)).max())
