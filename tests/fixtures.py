"""Tiny random-weight models in real checkpoint formats, for tests and examples.

`write_hf_model(path, ...)` writes a Hugging Face directory (config.json,
model.safetensors, and a sentencepiece tokenizer trained here) that both
llama_tp and mlx-lm load. Run as a script to write one:
    python tests/fixtures.py OUT_DIR [--heads 8 --kv-heads 2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import mlx.core as mx

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Tensor parallel inference runs on many Macs at once.",
    "Ranks share the heads of attention and the columns of the feed-forward block.",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"()-",
    "Où est la gare? Überall schöne Grüße. 東京 and 🙂 go through byte fallback.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_sentencepiece(out: Path, vocab_size: int = 389) -> None:
    """Train a tiny BPE sentencepiece model with byte fallback into out/tokenizer.model."""
    import sentencepiece as spm

    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 4))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(out / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    corpus.unlink()
    (out / "tokenizer.vocab").unlink()
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def hf_config(
    dim: int = 64,
    n_layers: int = 2,
    n_heads: int = 8,
    n_kv_heads: int = 2,
    hidden_dim: int = 96,
    vocab_size: int = 389,
    head_dim: int | None = None,
    model_type: str = "llama",
    tie: bool = False,
    rope_scaling: dict | None = None,
    rope_traditional: bool = False,
    **extra,
) -> dict:
    """config.json of a tiny model; `extra` adds keys (the experts of a MoE family: see
    `moe_config`)."""
    config = {
        "model_type": model_type,
        "architectures": [ARCHITECTURES.get(model_type, "LlamaForCausalLM")],
        "hidden_size": dim,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "intermediate_size": hidden_dim,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if head_dim:
        config["head_dim"] = head_dim
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if rope_traditional:
        config["rope_traditional"] = True
    if model_type in ("qwen3", "qwen3_moe", "glm4_moe") and not head_dim:
        config["head_dim"] = dim // n_heads  # required by mlx-lm's qwen3 and glm4_moe models
    if model_type == "glm4_moe":
        config.setdefault("rope_scaling", None)  # required by mlx-lm's glm4_moe
    return {**config, **extra}


ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}


def moe_config(
    model_type: str,
    experts: int,
    top_k: int,
    expert_dim: int,
    shared_dim: int = 0,
    norm_topk_prob: bool = True,
    dense_layers: tuple[int, ...] = (),
) -> dict:
    """The expert keys of a mixture-of-experts config.json, by family."""
    if model_type == "mixtral":
        return {"num_local_experts": experts, "num_experts_per_tok": top_k}
    out = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_dim,
        "norm_topk_prob": norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(dense_layers),
    }
    if model_type == "qwen2_moe":
        out["shared_expert_intermediate_size"] = shared_dim
    return out


def mla_config(
    experts: int,
    top_k: int,
    expert_dim: int,
    n_group: int = 1,
    topk_group: int = 1,
    shared: int = 1,
    dense_layers: int = 1,
    q_lora_rank: int | None = 48,
    kv_lora_rank: int = 32,
    nope: int = 16,
    rope: int = 8,
    v: int = 16,
) -> dict:
    """The DeepSeek-V3 keys of a config.json: latent attention, grouped sigmoid routing,
    shared experts and `dense_layers` dense layers first."""
    return {
        "n_routed_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_dim,
        "n_shared_experts": shared or None,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "first_k_dense_replace": dense_layers,
        "moe_layer_freq": 1,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
    }


def glm_config(
    experts: int,
    top_k: int,
    expert_dim: int,
    n_group: int = 1,
    topk_group: int = 1,
    shared: int = 1,
    dense_layers: int = 1,
    qk_norm: bool = True,
    bias: bool = True,
    partial_rotary_factor: float = 0.5,
) -> dict:
    """The GLM-4.5 keys of a config.json: partial rotary, q/k norms and q/k/v biases if
    asked, DeepSeek-V3's routing, shared experts and `dense_layers` dense layers first."""
    return {
        "n_routed_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_dim,
        "n_shared_experts": shared or None,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": dense_layers,
        "use_qk_norm": qk_norm,
        "attention_bias": bias,
        "partial_rotary_factor": partial_rotary_factor,
    }


def _experts(config: dict) -> tuple[int, int, int]:
    """(experts, expert width, shared-expert width) of a config (0, 0, 0: dense)."""
    t = config["model_type"]
    if t in ("deepseek_v3", "glm4_moe"):
        dim = config["moe_intermediate_size"]
        return config["n_routed_experts"], dim, (config["n_shared_experts"] or 0) * dim
    if t == "mixtral":
        return config["num_local_experts"], config["intermediate_size"], 0
    if t in ("qwen2_moe", "qwen3_moe"):
        shared = config.get("shared_expert_intermediate_size", 0)
        return config["num_experts"], config["moe_intermediate_size"], shared
    return 0, 0, 0


def _sparse(config: dict, layer: int) -> bool:
    if not _experts(config)[0]:
        return False
    if config["model_type"] == "mixtral":
        return True
    if config["model_type"] in ("deepseek_v3", "glm4_moe"):
        return layer >= config["first_k_dense_replace"]
    step = config.get("decoder_sparse_step", 1)
    return layer not in config.get("mlp_only_layers", []) and (layer + 1) % step == 0


def random_weights(config: dict, seed: int = 0, dtype=mx.float32) -> dict[str, mx.array]:
    """Hugging Face-named random weights for `config` (scaled so activations stay O(1))."""
    mx.random.seed(seed)
    d, h = config["hidden_size"], config["intermediate_size"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // nh
    bias = config["model_type"] in ("qwen2", "qwen2_moe") or config.get("attention_bias")
    qk_norm = config["model_type"] in ("qwen3", "qwen3_moe") or config.get("use_qk_norm")
    n_experts, expert_dim, shared_dim = _experts(config)
    moe = "block_sparse_moe" if config["model_type"] == "mixtral" else "mlp"
    # Mixtral names its experts' projections as Meta does
    projs = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"} if moe != "mlp" else {}

    def w(*shape):
        return (mx.random.normal(shape) * shape[-1] ** -0.5).astype(dtype)

    out = {"model.embed_tokens.weight": w(config["vocab_size"], d)}
    out["model.norm.weight"] = (1 + 0.1 * mx.random.normal((d,))).astype(dtype)
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = w(config["vocab_size"], d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if "kv_lora_rank" in config:
            out |= _latent_attention(config, p + "self_attn.", w, dtype)
        else:
            out[p + "self_attn.q_proj.weight"] = w(nh * hd, d)
            out[p + "self_attn.k_proj.weight"] = w(nkv * hd, d)
            out[p + "self_attn.v_proj.weight"] = w(nkv * hd, d)
            out[p + "self_attn.o_proj.weight"] = w(d, nh * hd)
        if bias:
            for n, size in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
                out[p + f"self_attn.{n}_proj.bias"] = (0.1 * mx.random.normal((size,))).astype(
                    dtype
                )
        if qk_norm:
            for n in ("q_norm", "k_norm"):
                out[p + f"self_attn.{n}.weight"] = (1 + 0.1 * mx.random.normal((hd,))).astype(dtype)
        if _sparse(config, i):
            out[p + f"{moe}.gate.weight"] = w(n_experts, d)
            for e in range(n_experts):
                for proj, shape in (
                    ("gate_proj", (expert_dim, d)),
                    ("up_proj", (expert_dim, d)),
                    ("down_proj", (d, expert_dim)),
                ):
                    out[p + f"{moe}.experts.{e}.{projs.get(proj, proj)}.weight"] = w(*shape)
            if config["model_type"] in ("deepseek_v3", "glm4_moe"):  # ungated shared, bias
                out[p + "mlp.gate.e_score_correction_bias"] = 0.1 * mx.random.normal((n_experts,))
                shared = p + "mlp.shared_experts."
            else:
                shared = p + "mlp.shared_expert."
                if shared_dim:
                    out[p + "mlp.shared_expert_gate.weight"] = w(1, d)
            if shared_dim:
                out[shared + "gate_proj.weight"] = w(shared_dim, d)
                out[shared + "up_proj.weight"] = w(shared_dim, d)
                out[shared + "down_proj.weight"] = w(d, shared_dim)
        else:
            out[p + "mlp.gate_proj.weight"] = w(h, d)
            out[p + "mlp.up_proj.weight"] = w(h, d)
            out[p + "mlp.down_proj.weight"] = w(d, h)
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + f"{n}.weight"] = (1 + 0.1 * mx.random.normal((d,))).astype(dtype)
    return out


def _latent_attention(config: dict, p: str, w, dtype) -> dict[str, mx.array]:
    """DeepSeek-V3's attention tensors (prefix `p`), Hugging Face names."""
    d, nh = config["hidden_size"], config["num_attention_heads"]
    r, q_rank = config["kv_lora_rank"], config["q_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    out = {}
    if q_rank:
        out[p + "q_a_proj.weight"] = w(q_rank, d)
        out[p + "q_a_layernorm.weight"] = (1 + 0.1 * mx.random.normal((q_rank,))).astype(dtype)
        out[p + "q_b_proj.weight"] = w(nh * (nope + rope), q_rank)
    else:
        out[p + "q_proj.weight"] = w(nh * (nope + rope), d)
    out[p + "kv_a_proj_with_mqa.weight"] = w(r + rope, d)
    out[p + "kv_a_layernorm.weight"] = (1 + 0.1 * mx.random.normal((r,))).astype(dtype)
    out[p + "kv_b_proj.weight"] = w(nh * (nope + v), r)
    out[p + "o_proj.weight"] = w(d, nh * v)
    return out


def quantize_weights(
    weights: dict[str, mx.array], bits: int, group_size: int
) -> dict[str, mx.array]:
    """MLX affine quantization of every 2-D projection and the embedding, as mlx_lm.convert does."""
    out = {}
    for name, value in weights.items():
        if value.ndim == 2 and value.shape[-1] % group_size == 0:
            base = name[: -len(".weight")]
            wq, scales, biases = mx.quantize(value, group_size=group_size, bits=bits)
            out[name], out[base + ".scales"], out[base + ".biases"] = wq, scales, biases
        else:
            out[name] = value
    return out


def write_hf_model(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    dtype=mx.float32,
    quantize: tuple[int, int] | None = None,
    tokenizer: bool = True,
    **config_kwargs,
) -> Path:
    """Write a random-weight Hugging Face directory; returns its path.

    `quantize=(bits, group_size)` writes an MLX-quantized checkpoint instead.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config(**config_kwargs)
    weights = random_weights(config, seed, dtype)
    if quantize:
        bits, group_size = quantize
        weights = quantize_weights(weights, bits, group_size)
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        train_sentencepiece(path, config["vocab_size"])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--hidden-dim", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_hf_model(
        args.out,
        seed=args.seed,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        hidden_dim=args.hidden_dim,
    )
    print(args.out)


if __name__ == "__main__":
    main()
