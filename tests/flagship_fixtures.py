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
    llama4   llama4 (the wrapper's text model): 3 chunked RoPE layers (chunks of 4, q/k
             norms after RoPE) and a global NoPE one (temperature tuning from position
             3: floor_scale 4), 5 experts (top-1, sigmoid, input scaled) + a shared
             one in every second layer; 4 layers (mlx-lm's llama4 needs the fourth)
    llama4_text  llama4_text (MobileLLM-R1's): dense, a RoPE and a NoPE layer, q/k norms
             before RoPE; 2 layers
    step3p5  step3p5: a global layer (10 / 5 heads, partial RoPE, YaRN) and two sliding
             ones with their own 8 / 2 heads, gated per head; 5 experts (sigmoid + bias,
             scaled) + a shared one after a dense layer, clamped SwiGLUs; 3 layers
    kimi_linear  a KDA layer (5 heads of 32) then latent attention without RoPE (10
             heads), 5 experts + a shared one after the dense first layer; 2 layers
    nemotron_h  nemotron_h: one mixer per layer, Mamba-2 / experts / attention / relu2
             feed-forward (M E * -): 10 Mamba heads of 32 in 5 groups of 16 state values
             (groups kept whole: 3/2, 2/2/1, 2/1/1/1), 10 query / 5 KV heads without
             RoPE, 5 relu2 experts + a shared one
    nemotron_g1  the same Mamba-2 with one group (M *): 5 heads split anywhere, the
             group's B and C on every rank, its gated norm's sum all-reduced
    kimi_k3  kimi_k3: fused KDA layers (5 heads of 32, a lower-bounded decay, a
             full-rank output gate) around gated latent attention (10 heads, queries
             through a rank of 64); SiTU everywhere; 5 latent experts (in 32 values, RMS
             normed after their sum) + a shared one after a dense layer; attention
             residuals over blocks of 2 layers; 3 layers
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
# Llama 4: 10 query / 5 KV heads, chunks of 4 positions (the 10-12 token prompts span
# three), the NoPE layer's temperature above 1 from position 3, 5 experts in layers 1, 3
_LLAMA4_TEXT = dict(
    model_type="llama4_text",
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=128,
    intermediate_size_mlp=160,
    num_attention_heads=10,
    num_key_value_heads=5,
    head_dim=16,
    num_local_experts=5,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attention_chunk_size=4,
    attention_bias=False,
    use_qk_norm=True,
    floor_scale=4,
    attn_scale=0.1,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=64),
    **COMMON,
)  # fmt: skip
LLAMA4 = dict(model_type="llama4", text_config=_LLAMA4_TEXT, **COMMON)
LLAMA4_TEXT = dict(
    model_type="llama4_text",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    intermediate_size_mlp=128,
    num_attention_heads=10,
    num_key_value_heads=5,
    head_dim=16,
    no_rope_layers=[1, 0],
    use_qk_norm=True,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    **COMMON,
)
# Step-3.5: a global layer (10 query / 5 KV heads, half of each head rotated, YaRN) then
# two sliding ones (window 4) of their own 8 query / 2 KV heads, each head's output
# gated; a dense first layer, then 5 experts (sigmoid + router bias, scaled by 3) beside
# a shared expert, the SwiGLUs clamped (low limits: the random weights reach them)
STEP3P5 = dict(
    model_type="step3p5",
    hidden_size=64,
    num_hidden_layers=3,
    intermediate_size=128,
    num_attention_heads=10,
    num_attention_groups=5,
    head_dim=32,
    layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    attention_other_setting={"num_attention_heads": 8, "num_attention_groups": 2},
    sliding_window=4,
    rope_theta=[5000000.0, 10000.0, 10000.0],
    partial_rotary_factors=[0.5, 1.0, 1.0],
    yarn_only_types=["full_attention"],
    rope_scaling=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=2048),
    use_head_wise_attn_gate=True,
    moe_num_experts=5,
    moe_top_k=2,
    moe_intermediate_size=128,
    share_expert_dim=128,
    moe_layers_enum="1,2",
    moe_router_scaling_factor=3.0,
    norm_expert_weight=True,
    swiglu_limits=[0.0, 0.5, 0.0],
    swiglu_limits_shared=[0.5, 0.0, 0.5],
    rms_norm_eps=1e-5,
    **COMMON,
)
# Kimi-Linear: a KDA layer (5 heads of 32: per-channel decay, q/k/v short convs of 4
# taps) with a dense feed-forward, then latent attention without RoPE (10 heads) with 5
# experts (sigmoid + correction bias, renormalised, scaled) and a shared one
KIMI_LINEAR = dict(
    model_type="kimi_linear",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=160,
    num_attention_heads=10,
    num_key_value_heads=10,
    head_dim=32,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    mla_use_nope=True,
    linear_attn_config=dict(
        kda_layers=[1], full_attn_layers=[2], num_heads=5, head_dim=32, short_conv_kernel_size=4
    ),  # fmt: skip
    model_max_length=4096,
    num_experts=5,
    num_experts_per_token=2,
    num_shared_experts=1,
    moe_intermediate_size=128,
    first_k_dense_replace=1,
    routed_scaling_factor=2.446,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
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
# Kimi K3: fused KDA (q | k | v in one projection and one conv, the decay bounded below,
# a full-rank output gate) in layers 1 and 3, gated latent attention (queries through
# q_lora_rank) in layer 2; SiTU in the dense layer, the shared and the routed experts;
# the routed experts in a latent width of 32, normed after their sum; every layer's input
# a softmax mix of the block states so far (blocks of 2 layers)
KIMI_K3 = dict(
    model_type="kimi_k3",
    hidden_size=64,
    num_hidden_layers=3,
    intermediate_size=160,
    num_attention_heads=10,
    num_key_value_heads=10,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    mla_use_nope=True,
    mla_use_output_gate=True,
    linear_attn_config=dict(
        kda_layers=[1, 3],
        full_attn_layers=[2],
        num_heads=5,
        head_dim=32,
        short_conv_kernel_size=4,
        gate_lower_bound=-5.0,
        use_full_rank_gate=True,
    ),
    hidden_act="situ",
    activation_situ_beta=2.0,
    activation_situ_linear_beta=4.0,
    attn_res_block_size=2,
    num_experts=5,
    num_experts_per_token=2,
    num_shared_experts=1,
    moe_intermediate_size=128,
    routed_expert_hidden_size=32,
    latent_moe_use_norm=True,
    first_k_dense_replace=1,
    routed_scaling_factor=2.446,
    rms_norm_eps=1e-5,
    **COMMON,
)
NEMOTRON_G1 = dict(NEMOTRON_H, mamba_num_heads=5, n_groups=1, hybrid_override_pattern=["M", "*"])
CONFIGS = {
    "gemma4": GEMMA4,
    "gemma3": GEMMA3,
    "deepseek_v32": DEEPSEEK_V32,
    "glm5": GLM5,
    "minimax": MINIMAX,
    "llama4": LLAMA4,
    "llama4_text": LLAMA4_TEXT,
    "step3p5": STEP3P5,
    "kimi_linear": KIMI_LINEAR,
    "nemotron_h": NEMOTRON_H,
    "nemotron_g1": NEMOTRON_G1,
    "kimi_k3": KIMI_K3,
}
# the families whose 4-bit copy every launch checks too
QUANTIZED = ("gemma4", "deepseek_v32", "minimax", "llama4", "step3p5", "kimi_linear")
QUANTIZED += ("nemotron_h", "kimi_k3")
# the families with a float32 GGUF copy too (as llama.cpp's converter writes it)
GGUF = {
    "kimi_linear": lambda src, out: gguf_kimi(src, out),
    "minimax": lambda src, out: gguf_minimax(src, out),
}
GGUF |= {"nemotron_h": lambda src, out: gguf_nemotron(src, out)}
GGUF |= {"nemotron_g1": lambda src, out: gguf_nemotron(src, out)}
# the families with a float32 copy in their release's own layout too
RELEASE = {"kimi_k3": lambda src, out: release_k3(src, out)}


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
    """{family: float32 folder, "<family>-q4": its 4-bit copy (`QUANTIZED`), "<family>-gguf":
    its float32 GGUF (`GGUF`)}."""
    out = {}
    for i, name in enumerate(names):
        out[name] = write_mlx_lm(root / name, CONFIGS[name], seed=i)
        if name in QUANTIZED:
            out[f"{name}-q4"] = quantized(out[name], root / f"{name}-q4")
        if name in GGUF:
            out[f"{name}-gguf"] = GGUF[name](out[name], root / f"{name}.gguf")
        if name in RELEASE:
            out[f"{name}-release"] = RELEASE[name](out[name], root / f"{name}-release")
    return out


def release_k3(src: Path, out: Path) -> Path:
    """Kimi K3's release layout of mlx-lm's float32 folder `src` (what mlx-lm's sanitize
    undoes): the names at the top (not under `language_model.`), per-expert w1/w2/w3 under
    `block_sparse_moe` with the routing bias in its gate, q/k/v projections and convs
    (C, 1, K) apart, A_log 3 values longer than the heads, the latent's `kv_b_proj`, the
    residual queries as `*_res.proj_weight` / `*_res.norm_weight`."""
    import shutil

    config = json.loads((src / "config.json").read_text())
    first = config["first_k_dense_replace"]
    names = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    rel = {}
    for k, v in mx.load(str(src / "model.safetensors")).items():
        k = k.removeprefix("language_model.")
        layer = int(k.split(".")[2]) if k.startswith("model.layers.") else -1
        if layer >= first:
            k = k.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
            k = k.replace(".mlp.", ".block_sparse_moe.")
        if ".switch_mlp." in k:
            proj = k.split(".")[-2]
            for e in range(v.shape[0]):
                expert = k.replace("switch_mlp", f"experts.{e}").replace(proj, names[proj])
                rel[expert] = v[e]
            continue
        if ".qkv_proj." in k or ".qkv_conv." in k:
            for c, part in zip("qkv", mx.split(v, 3), strict=True):
                if ".qkv_proj." in k:
                    rel[k.replace("qkv_proj", f"{c}_proj")] = part
                else:  # (C, K, 1) -> the release's (C, 1, K)
                    rel[k.replace("qkv_conv.conv", f"{c}_conv1d")] = part.swapaxes(1, 2)
            continue
        if k.endswith("A_log"):
            v = mx.concatenate([v, mx.zeros((3,), v.dtype)])
        if k.endswith("embed_q.weight") and "unembed" not in k:  # (H, rank, nope)
            up = mx.load(str(src / "model.safetensors"))[
                "language_model." + k.replace("embed_q", "unembed_out")
            ]  # (H, v, rank)
            k, v = (
                k.replace("embed_q", "kv_b_proj"),
                mx.concatenate([v.swapaxes(1, 2), up], axis=1).reshape(-1, v.shape[1]),
            )
        elif k.endswith("unembed_out.weight"):
            continue
        for r in ("self_attention_res", "mlp_res", "output_attn_res"):
            for x in ("proj", "norm"):
                k = k.replace(f"{r}_{x}.weight", f"{r}.{x}_weight")
        rel[k] = v
    shutil.copytree(src, out)
    mx.save_safetensors(str(out / "model.safetensors"), rel)
    return out


# -- Kimi-Linear as llama.cpp's converter writes it (convert_hf_to_gguf.py's KimiLinearModel)
_KIMI_GGUF = [
    (r"^model\.embed_tokens\.", "token_embd."),
    (r"^model\.norm\.", "output_norm."),
    (r"^lm_head\.", "output."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.q_proj\.", ".attn_q."),
    (r"\.self_attn\.k_proj\.", ".attn_k."),
    (r"\.self_attn\.v_proj\.", ".attn_v."),
    (r"\.self_attn\.o_proj\.", ".attn_output."),
    (r"\.self_attn\.([qkv])_conv\.conv\.", r".ssm_conv1d_\1."),
    (r"\.self_attn\.f_a_proj\.", ".ssm_f_a."),
    (r"\.self_attn\.f_b_proj\.", ".ssm_f_b."),
    (r"\.self_attn\.b_proj\.", ".ssm_beta."),
    (r"\.self_attn\.g_a_proj\.", ".ssm_g_a."),
    (r"\.self_attn\.g_b_proj\.", ".ssm_g_b."),
    (r"\.self_attn\.o_norm\.", ".ssm_norm."),
    (r"\.self_attn\.dt_bias$", ".ssm_dt.bias"),
    (r"\.self_attn\.A_log$", ".ssm_a"),
    (r"\.self_attn\.kv_a_proj_with_mqa\.", ".attn_kv_a_mqa."),
    (r"\.self_attn\.kv_a_layernorm\.", ".attn_kv_a_norm."),
    (r"\.self_attn\.embed_q\.", ".attn_k_b."),
    (r"\.self_attn\.unembed_out\.", ".attn_v_b."),
    (r"\.mlp\.gate_proj\.", ".ffn_gate."),
    (r"\.mlp\.up_proj\.", ".ffn_up."),
    (r"\.mlp\.down_proj\.", ".ffn_down."),
    (r"\.mlp\.gate\.", ".ffn_gate_inp."),
    (r"\.mlp\.e_score_correction_bias$", ".exp_probs_b.bias"),
    (r"\.mlp\.switch_mlp\.(gate|up|down)_proj\.", r".ffn_\1_exps."),
    (r"\.mlp\.shared_experts\.(gate|up|down)_proj\.", r".ffn_\1_shexp."),
    (r"^model\.layers\.(\d+)\.", r"blk.\1."),
]


def gguf_kimi(src: Path, out: Path, quantized: int | None = None, stored: bool = True) -> Path:
    """mlx-lm's float32 Kimi-Linear folder `src` as llama.cpp's converter writes its GGUF:
    the convs (1, C, 1, K), ssm_a = -exp(A_log) (1, 1, H, 1), dt_bias as ssm_dt.bias, the
    latent's k_b / v_b per head, a KV head count per layer (0: KDA), the experts stacked;
    float32, or with `quantized` (a ggml type) every projection whose rows take its blocks
    (gguf-py's quantization; `stored` False: the same values dequantized, as float32)."""
    import re

    import gguf
    import numpy as np
    from gguf_writer import llama_vocabulary

    c = json.loads((src / "config.json").read_text())
    lin, n = c["linear_attn_config"], c["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), "kimi-linear")
    arch = "kimi-linear"
    ints = {
        "block_count": n,
        "context_length": c["model_max_length"],
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"],
        "vocab_size": c["vocab_size"],
        "ssm.conv_kernel": lin["short_conv_kernel_size"],
        "kda.head_dim": lin["head_dim"],
        "attention.kv_lora_rank": c["kv_lora_rank"],
        "rope.dimension_count": c["qk_rope_head_dim"],
        "attention.key_length": c["kv_lora_rank"] + c["qk_rope_head_dim"],
        "attention.key_length_mla": c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
        "attention.value_length_mla": c["v_head_dim"],
        "expert_count": c["num_experts"],
        "expert_used_count": c["num_experts_per_token"],
        "expert_feed_forward_length": c["moe_intermediate_size"],
        "expert_shared_count": c["num_shared_experts"],
        "leading_dense_block_count": c["first_k_dense_replace"],
    }
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    kv = [0 if i + 1 in lin["kda_layers"] else 1 for i in range(n)]
    w.add_array(f"{arch}.attention.head_count_kv", kv)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_float32(f"{arch}.expert_weights_scale", c["routed_scaling_factor"])
    vocab = llama_vocabulary(c["vocab_size"])
    _gguf_vocabulary(w, vocab)
    for name, v in sorted(mx.load(str(src / "model.safetensors")).items()):
        a = np.array(v.astype(mx.float32))
        if name.endswith("A_log"):
            a = -np.exp(a)
        if "_conv.conv." in name:  # (C, K, 1) -> (1, C, 1, K)
            a = a[..., 0].reshape(1, a.shape[0], 1, a.shape[1])
        for pattern, repl in _KIMI_GGUF:
            name = re.sub(pattern, repl, name)
        a = np.ascontiguousarray(a)
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(quantized)][0] if quantized else 0
        fits = (
            bool(quantized)
            and a.ndim >= 2
            and a.shape[-1] % block == 0
            and "ssm_conv1d" not in name
        )
        _gguf_tensor(w, name, a, quantized if fits else None, stored)
    return _gguf_finish(w, out)


# -- Nemotron-H as llama.cpp's converter writes it (conversion/nemotron.py's NemotronHModel)
_NEMOTRON_GGUF = [
    (r"^backbone\.embeddings\.", "token_embd."),
    (r"^backbone\.norm_f\.", "output_norm."),
    (r"^lm_head\.", "output."),
    (r"\.mixer\.norm\.", ".ssm_norm."),  # the gated norm's, then the block's
    (r"\.norm\.weight$", ".attn_norm.weight"),
    (r"\.mixer\.in_proj\.", ".ssm_in."),
    (r"\.mixer\.conv1d\.", ".ssm_conv1d."),
    (r"\.mixer\.dt_bias$", ".ssm_dt.bias"),
    (r"\.mixer\.A_log$", ".ssm_a"),
    (r"\.mixer\.D$", ".ssm_d"),
    (r"\.mixer\.out_proj\.", ".ssm_out."),
    (r"\.mixer\.([qkv])_proj\.", r".attn_\1."),
    (r"\.mixer\.o_proj\.", ".attn_output."),
    (r"\.mixer\.shared_experts\.(up|down)_proj\.", r".ffn_\1_shexp."),
    (r"\.mixer\.(up|down)_proj\.", r".ffn_\1."),
    (r"\.mixer\.gate\.e_score_correction_bias$", ".exp_probs_b.bias"),
    (r"\.mixer\.gate\.", ".ffn_gate_inp."),
    (r"\.mixer\.switch_mlp\.fc1\.", ".ffn_up_exps."),
    (r"\.mixer\.switch_mlp\.fc2\.", ".ffn_down_exps."),
    (r"^backbone\.layers\.(\d+)\.", r"blk.\1."),
]
# kept float by llama.cpp's quantizer (or by ours: the Mamba-only small tensors)
_NEMOTRON_FLOAT = ("ssm_conv1d", "ssm_norm", "ffn_gate_inp", "ssm_a", "ssm_d")


def gguf_nemotron(src: Path, out: Path, quantized: int | None = None, stored: bool = True) -> Path:
    """mlx-lm's float32 Nemotron-H folder `src` as llama.cpp's converter writes its GGUF
    (`nemotron_h_moe` with experts, else `nemotron_h`): the conv (C, K), ssm_a = -exp(A_log)
    and D as (nh, 1), the gated norm as (groups, width), dt_bias as ssm_dt.bias, the
    experts stacked; per-layer KV head counts (0 but in "*" layers) and feed-forward widths
    (the experts' in "E" layers with experts, the dense one's in "-" layers without; 0
    elsewhere); float32, or with `quantized` (a ggml type) the projections in its blocks
    (`stored` False: the same values dequantized, as float32)."""
    import re

    import gguf
    import numpy as np
    from gguf_writer import llama_vocabulary

    c = json.loads((src / "config.json").read_text())
    # the converter writes nemotron_h_moe for a config with experts; a pattern without "E"
    # here stands for one without (Nemotron-H 8B's, as its `nemotron_h`)
    pattern = "".join(c["hybrid_override_pattern"])
    moe = "E" in pattern
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    w = gguf.GGUFWriter(str(out), arch)
    nh, hd, ng = c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"]
    ints = {
        "block_count": len(pattern),
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "attention.head_count": c["num_attention_heads"],
        "attention.key_length": c["head_dim"],
        "attention.value_length": c["head_dim"],
        "ssm.conv_kernel": c["conv_kernel"],
        "ssm.state_size": c["ssm_state_size"],
        "ssm.group_count": ng,
        "ssm.inner_size": nh * hd,
        "ssm.time_step_rank": nh,
    }
    ff = c["moe_intermediate_size"] if moe else c["intermediate_size"]
    if moe:
        ints |= {
            "expert_used_count": c["num_experts_per_tok"],
            "expert_feed_forward_length": c["moe_intermediate_size"],
            "expert_shared_feed_forward_length": c["moe_shared_expert_intermediate_size"],
            "expert_count": c["n_routed_experts"],
            "expert_shared_count": c["n_shared_experts"],
            "expert_group_count": c["n_group"],
        }
        w.add_bool(f"{arch}.expert_weights_norm", c["norm_topk_prob"])
        w.add_float32(f"{arch}.expert_weights_scale", c["routed_scaling_factor"])
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    mlp = "E" if moe else "-"
    w.add_array(f"{arch}.feed_forward_length", [ff if p == mlp else 0 for p in pattern])
    kv = [c["num_key_value_heads"] if p == "*" else 0 for p in pattern]
    w.add_array(f"{arch}.attention.head_count_kv", kv)
    # the config's layer_norm_epsilon as the plain norm's (the converter's base class)
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", c["layer_norm_epsilon"])
    vocab = llama_vocabulary(c["vocab_size"])
    _gguf_vocabulary(w, vocab)
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(quantized)][0] if quantized else 0
    for name, v in sorted(mx.load(str(src / "model.safetensors")).items()):
        a = np.array(v.astype(mx.float32))
        if name.endswith("A_log"):
            a = -np.exp(a)
        if name.endswith(("A_log", ".D")):
            a = a.reshape(-1, 1)
        elif name.endswith("mixer.norm.weight"):
            a = a.reshape(ng, -1)
        elif name.endswith("conv1d.weight"):  # (C, K, 1) -> (C, K)
            a = a[..., 0]
        for pattern_, repl in _NEMOTRON_GGUF:
            name = re.sub(pattern_, repl, name)
        a = np.ascontiguousarray(a)
        small = any(k in name for k in _NEMOTRON_FLOAT)
        fits = bool(quantized) and a.ndim >= 2 and a.shape[-1] % block == 0 and not small
        _gguf_tensor(w, name, a, quantized if fits else None, stored)
    return _gguf_finish(w, out)


# -- MiniMax-M2 as llama.cpp's converter writes it (conversion/minimax.py's MiniMaxM2Model)
_MINIMAX_GGUF = [
    (r"\.self_attn\.([qk])_norm\.", r".attn_\1_norm."),
    (r"\.block_sparse_moe\.", ".mlp."),
    *_KIMI_GGUF,
]


def gguf_minimax(src: Path, out: Path, quantized: int | None = None, stored: bool = True) -> Path:
    """mlx-lm's float32 MiniMax-M2 folder `src` as llama.cpp's converter writes its GGUF
    (`minimax-m2`): q/k/v as the folder's (NEOX RoPE: no permutation), attn_q_norm /
    attn_k_norm one vector of all heads' values each, the experts stacked, the routing
    bias as exp_probs_b.bias; rope.dimension_count = rotary_dim, expert_gating_func 2
    (sigmoid). float32, or with `quantized` (a ggml type) every matrix whose rows take its
    blocks (`stored` False: the same values dequantized, as float32)."""
    import re

    import gguf
    import numpy as np
    from gguf_writer import llama_vocabulary

    c = json.loads((src / "config.json").read_text())
    arch = "minimax-m2"
    w = gguf.GGUFWriter(str(out), arch)
    ints = {
        "block_count": c["num_hidden_layers"],
        "context_length": c.get("max_position_embeddings", 4096),
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": c["num_key_value_heads"],
        "attention.key_length": c["head_dim"],
        "attention.value_length": c["head_dim"],
        "vocab_size": c["vocab_size"],
        "expert_count": c["num_local_experts"],
        "expert_used_count": c["num_experts_per_tok"],
        "expert_gating_func": 2,
        "expert_feed_forward_length": c["intermediate_size"],
        "rope.dimension_count": c["rotary_dim"],
    }
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", c["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    vocab = llama_vocabulary(c["vocab_size"])
    _gguf_vocabulary(w, vocab)
    qtype = gguf.GGMLQuantizationType(quantized) if quantized else None
    for name, v in sorted(mx.load(str(src / "model.safetensors")).items()):
        a = np.ascontiguousarray(np.array(v.astype(mx.float32)))
        for pattern, repl in _MINIMAX_GGUF:
            name = re.sub(pattern, repl, name)
        fits = (
            qtype is not None and a.ndim >= 2 and a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
        )
        _gguf_tensor(w, name, a, quantized if fits else None, stored)
    return _gguf_finish(w, out)


def _gguf_vocabulary(w, vocab: dict) -> None:
    """The llama-style tokenizer fields of `gguf_writer.llama_vocabulary`'s `vocab`."""
    w.add_string("tokenizer.ggml.model", "llama")
    for key in ("tokens", "scores", "token_type"):
        w.add_array(f"tokenizer.ggml.{key}", vocab[f"tokenizer.ggml.{key}"])
    for key in ("bos", "eos", "unknown"):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab[f"tokenizer.ggml.{key}_token_id"])


def _gguf_tensor(w, name: str, a, quantized: int | None, stored: bool) -> None:
    """Tensor `a` as float32, or in ggml type `quantized` (`stored` False: its values
    dequantized back to float32)."""
    import gguf
    import numpy as np

    if not quantized:
        w.add_tensor(name, a)
        return
    qtype = gguf.GGMLQuantizationType(quantized)
    q = gguf.quants.quantize(a, qtype)
    if stored:
        w.add_tensor(name, q, raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.dequantize(q, qtype).astype(np.float32))


def _gguf_finish(w, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
