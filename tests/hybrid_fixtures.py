"""Tiny random Gated DeltaNet hybrids written by mlx-lm's own classes: Qwen3.5 (dense, its
language model nested in `text_config` beside a vision config as released), Qwen3.5-MoE
and Qwen3-Next (routed experts and a gated shared expert, one dense layer), each also
4-bit as mlx-lm quantizes it; the Hugging Face release layout of the dense one
(zero-centred norms, (C, 1, K) convs, `model.language_model.*` names, a vision tower and
a multi-token prediction layer); GGUF files as llama.cpp's converter writes them.

Every parameter random (mlx-lm's own model, saved by mlx-lm's names). 4 layers: 3 of
Gated DeltaNet, the 4th full attention with an output gate. The linear attention's key
heads do not divide by 3 (4 and 5: 2/1/1 and 2/2/1 over 3 ranks), its value heads follow
them (2 per key head); the full attention's 4 query / 2 KV heads of 32 (KV heads
replicated over 3 and 4 ranks); value heads of 32 values so that quantized `out_proj`
columns split on groups of 32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from fixtures import train_sentencepiece

TEXT = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=128,
    vocab_size=389,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    tie_word_embeddings=False,
)
QWEN3_5 = dict(
    model_type="qwen3_5",
    text_config=dict(
        TEXT,
        model_type="qwen3_5_text",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    ),
    vision_config={"depth": 2, "hidden_size": 32},
    tie_word_embeddings=False,
    eos_token_id=2,
    bos_token_id=1,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
           shared_expert_intermediate_size=128)  # fmt: skip
QWEN3_5_MOE = dict(
    QWEN3_5,
    model_type="qwen3_5_moe",
    text_config=dict(
        QWEN3_5["text_config"],
        model_type="qwen3_5_moe_text",
        linear_num_key_heads=5,
        linear_num_value_heads=10,
        **MOE,
    ),
)
QWEN3_NEXT = dict(
    TEXT,
    model_type="qwen3_next",
    linear_num_key_heads=5,
    linear_num_value_heads=10,
    rope_theta=10000000,
    partial_rotary_factor=0.25,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    norm_topk_prob=True,
    eos_token_id=2,
    bos_token_id=1,
    **MOE,
)
CONFIGS = {"qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5_MOE, "qwen3_next": QWEN3_NEXT}


def mlx_lm_model(config: dict):
    """mlx-lm's own model of `config` (lazily initialised)."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module.Model(module.ModelArgs.from_dict(config))


def write_hybrid(path: Path, family: str, seed: int = 0) -> Path:
    """A float32 folder of `family` (mlx-lm's names, its sanitized layout), all random."""
    from mlx.utils import tree_flatten, tree_unflatten

    config = CONFIGS[family]
    model = mlx_lm_model(config)
    mx.random.seed(seed)
    params = []
    for name, v in tree_flatten(model.parameters()):
        w = mx.random.normal(v.shape) * v.shape[-1] ** -0.5
        if name.endswith("A_log"):
            w = mx.log(mx.random.uniform(1.0, 16.0, v.shape))
        elif name.endswith("dt_bias"):
            w = 0.5 * mx.random.normal(v.shape)
        elif "conv1d" in name:
            w = mx.random.normal(v.shape) * 0.5
        elif "norm" in name:
            w = 1.0 + 0.1 * mx.random.normal(v.shape)
        params.append((name, w.astype(mx.float32)))
    model.update(tree_unflatten(params))
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    train_sentencepiece(path, 389)
    return path


def quantized(src: Path, out: Path, bits: int = 4, group_size: int = 32) -> Path:
    """`src` quantized by mlx-lm (its predicate: the routers 8-bit in groups of 64)."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(src)
    model, config = quantize_model(
        model, config, group_size, bits, quant_predicate=getattr(model, "quant_predicate", None)
    )
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def release(src: Path, out: Path) -> Path:
    """The dense Qwen3.5 folder `src` as the Hugging Face release stores it: the language
    model under `model.language_model.`, norms zero-centred (w - 1: not the linear
    attention's gated norm), convs (C, 1, K), and a vision tower and a multi-token
    prediction layer the text model does not use."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {}
    for name, v in mx.load(str(src / "model.safetensors")).items():
        name = name.replace("language_model.model.", "model.language_model.")
        name = name.replace("language_model.lm_head", "lm_head")
        if "conv1d" in name:
            v = v.swapaxes(1, 2)
        elif name.endswith("norm.weight") and "linear_attn" not in name:
            v = v - 1.0
        weights[name] = v
    weights["model.visual.blocks.0.attn.qkv.weight"] = mx.zeros((96, 32))
    weights["mtp.fc.weight"] = mx.zeros((64, 128))
    weights["mtp.layers.0.input_layernorm.weight"] = mx.zeros((64,))
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "pt"})
    shutil.copy(src / "config.json", out / "config.json")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def hybrids(root: Path) -> dict[str, Path]:
    """{"qwen3_5": float32, "qwen3_5-4bit", "qwen3_5_moe", "qwen3_5_moe-4bit",
    "qwen3_next", "qwen3_next-4bit"}: mlx-lm's folders of the three families."""
    out = {}
    for i, family in enumerate(CONFIGS):
        f32 = write_hybrid(root / family, family, seed=i)
        out[family] = f32
        out[f"{family}-4bit"] = quantized(f32, root / f"{family}-4bit")
    return out


def random_tokens(n: int, seed: int = 0, vocab: int = 389) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()
