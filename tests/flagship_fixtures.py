"""Tiny random checkpoints of 2026's flagship families, written by mlx-lm's own classes.

Each family's config below is mlx-lm's model class (`mlx_lm.models.<model_type>`) at a
tiny size, every parameter random (norms about 1), saved as mlx-lm saves it, with a
sentencepiece tokenizer; `quantized` is mlx-lm's own convert of one at 4 bits in groups
of 32. Head and expert counts do not divide by 3 (nor, for most, by 2 or 4): 10 query
heads over 5 KV groups (3/2 on 2 ranks, 2/2/1 on 3, 2/1/1/1 on 4), 5 experts.

    gemma4   gemma4_text: sliding (window 4) and global layers (heads of 32, keys =
             values over 2 KV heads: a rank's query heads may need both), the last two
             layers KV-shared (one of each kind), per-layer inputs of 8, the last two
             layers' feed-forward double-wide, experts beside the dense GeGLU
    gemma3   gemma3_text: every third layer global, the others sliding (window 4)
    deepseek_v32  sparse attention: 10 latent-attention heads each over the indexer's
             top 4 keys (5 indexer heads), YaRN RoPE, 5 experts + a shared one after a
             dense first layer
    glm5     glm_moe_dsa: the same with GLM-5's interleaved indexer RoPE and
             `rope_parameters`, 4 indexer heads, 7 experts
    minimax  minimax: q/k norms over all heads' values, partial RoPE (16 of 32), 5
             experts (sigmoid scores + correction bias), 2 KV heads; 2 layers
    nemotron_h  nemotron_h: one mixer per layer, Mamba-2 / experts / attention / relu2
             feed-forward (M E * -): 10 Mamba heads of 32 in 5 groups of 16 state values
             (groups kept whole: 3/2, 2/2/1, 2/1/1/1), 10 query / 5 KV heads without
             RoPE, 5 relu2 experts + a shared one
    nemotron_g1  the same Mamba-2 with one group (M *): 5 heads split anywhere, the
             group's B and C on every rank, its gated norm's sum all-reduced
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
from fixtures import train_sentencepiece

COMMON = dict(vocab_size=389, eos_token_id=2, bos_token_id=1, max_position_embeddings=4096)
GEMMA4 = dict(
    model_type="gemma4_text",
    hidden_size=128,
    num_hidden_layers=6,
    intermediate_size=160,
    num_attention_heads=10,
    head_dim=16,
    global_head_dim=32,
    num_key_value_heads=5,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=389,
    sliding_window=4,
    sliding_window_pattern=3,
    enable_moe_block=True,
    num_experts=5,
    top_k_experts=2,
    moe_intermediate_size=128,
    use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
    **COMMON,
)
GEMMA3 = dict(
    model_type="gemma3_text",
    hidden_size=128,
    num_hidden_layers=5,
    intermediate_size=160,
    num_attention_heads=10,
    head_dim=32,
    num_key_value_heads=5,
    sliding_window=4,
    sliding_window_pattern=3,
    query_pre_attn_scalar=24,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    **COMMON,
)
# DeepSeek-V3.2 / GLM-5: sparse attention (latent attention over the indexer's top 4 keys
# of each query: the tests' prompts of 10-12 tokens are past it), experts after a dense
# first layer
_SPARSE = dict(
    hidden_size=128,
    num_hidden_layers=4,
    intermediate_size=160,
    num_attention_heads=10,
    num_key_value_heads=10,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=5,
    index_head_dim=32,
    index_topk=4,
    n_routed_experts=5,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=128,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    rms_norm_eps=1e-6,
    attention_bias=False,
    **COMMON,
)
_YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=1024, mscale=1.0,
             mscale_all_dim=1.0, beta_fast=32, beta_slow=1)  # fmt: skip
DEEPSEEK_V32 = dict(_SPARSE, model_type="deepseek_v32", rope_theta=10000.0, rope_scaling=_YARN)
GLM5 = dict(
    _SPARSE,
    model_type="glm_moe_dsa",
    n_routed_experts=7,
    index_n_heads=4,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
)
# MiniMax-M2: q/k norms over all 10 query / 2 KV heads' values (across ranks when split;
# on 3 and 4 ranks a KV head is held by two ranks and counted by the first), partial RoPE
# (16 of 32 values), 5 experts behind sigmoid scores with a correction bias
MINIMAX = dict(
    model_type="minimax",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=10,
    num_key_value_heads=2,
    head_dim=32,
    rotary_dim=16,
    num_local_experts=5,
    num_experts_per_tok=2,
    shared_intermediate_size=0,
    rms_norm_eps=1e-6,
    rope_theta=5000000.0,
    **COMMON,
)
# Nemotron-H: one mixer per layer (Mamba-2, experts, attention without RoPE, relu2)
NEMOTRON_H = dict(
    model_type="nemotron_h",
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=10,
    num_key_value_heads=5,
    head_dim=32,
    attention_bias=False,
    mamba_num_heads=10,
    mamba_head_dim=32,
    mamba_proj_bias=False,
    ssm_state_size=16,
    conv_kernel=4,
    n_groups=5,
    use_conv_bias=True,
    mlp_bias=False,
    use_bias=False,
    layer_norm_epsilon=1e-5,
    hybrid_override_pattern=["M", "E", "*", "-"],
    n_routed_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    moe_shared_expert_intermediate_size=128,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    **COMMON,
)
NEMOTRON_G1 = dict(NEMOTRON_H, mamba_num_heads=5, n_groups=1, hybrid_override_pattern=["M", "*"])
CONFIGS = {
    "gemma4": GEMMA4,
    "gemma3": GEMMA3,
    "deepseek_v32": DEEPSEEK_V32,
    "glm5": GLM5,
    "minimax": MINIMAX,
    "nemotron_h": NEMOTRON_H,
    "nemotron_g1": NEMOTRON_G1,
}
# the families whose 4-bit copy every launch checks too
QUANTIZED = ("gemma4", "deepseek_v32", "minimax", "nemotron_h")


def write_mlx_lm(path: Path, config: dict, seed: int = 0) -> Path:
    """A float32 folder of mlx-lm's model for `config`, every parameter random."""
    from mlx.utils import tree_flatten, tree_unflatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = []
    for name, v in tree_flatten(model.parameters()):
        w = mx.random.normal(v.shape) * v.shape[-1] ** -0.5
        if "norm" in name or name.endswith(("scale", "layer_scalar")):
            w = 1.0 + 0.1 * mx.random.normal(v.shape)
        params.append((name, w.astype(mx.float32)))
    model.update(tree_unflatten(params))
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    train_sentencepiece(path, config["vocab_size"])
    return path


def quantized(src: Path, out: Path, bits: int = 4) -> Path:
    """mlx-lm's convert of `src`: `bits` bits in groups of 32."""
    from mlx_lm import convert

    convert(str(src), str(out), quantize=True, q_bits=bits, q_group_size=32)
    return out


def flagship_models(root: Path, names=tuple(CONFIGS)) -> dict[str, Path]:
    """{family: float32 folder, "<family>-q4": its 4-bit copy (`QUANTIZED`)}."""
    out = {}
    for i, name in enumerate(names):
        out[name] = write_mlx_lm(root / name, CONFIGS[name], seed=i)
        if name in QUANTIZED:
            out[f"{name}-q4"] = quantized(out[name], root / f"{name}-q4")
    return out
