"""Tiny random checkpoints of 2026's flagship families, written by mlx-lm's own classes.

Each family's config below is mlx-lm's model class (`mlx_lm.models.<model_type>`) at a
tiny size, every parameter random (norms about 1), saved as mlx-lm saves it, with a
sentencepiece tokenizer (flagship_writers.py; `QUANTIZED`'s also as mlx-lm's own convert
at 4 bits in groups of 32; Kimi K3's in its release layout too, flagship_release.py).
Head and expert counts do not divide by 3 (nor, for most, by 2 or 4): 10 query heads
over 5 KV groups (3/2 on 2 ranks, 2/2/1 on 3, 2/1/1/1 on 4), 5 experts.

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
