"""The synthetic models' specs: each size's shape (`SIZES`), the dtypes, the Hugging Face
`config.json` of a spec (Llama, or a Qwen3-MoE, DeepSeek-V3, DeepSeek-V3.2, gpt-oss,
GLM-4.5, Gemma 4, MiniMax-M2, Kimi-Linear, Llama 4, Step-3.5 or Nemotron-H one)
and every tensor it holds, named as Hugging Face names them (`synthetic.py` writes
them; see its docstring for what each size is)."""

from __future__ import annotations

import mlx.core as mx

Q4_GROUP = 64  # q4: MLX 4-bit with mlx-community's group size

# hidden, layers, query heads, KV heads, FFN, vocabulary
SIZES = {
    "0.5b": dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=5632, vocab=32000),
    "0.1b": dict(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=2816, vocab=32000),
    "tiny": dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=96, vocab=512),
    "1b": dict(dim=2048, n_layers=18, n_heads=16, n_kv_heads=8, hidden_dim=5632, vocab=32000),
    # Qwen3 (dense): q/k-normed heads of head_dim 128, Qwen3-0.6B's widths, 8 layers
    "qwen3": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=3072, vocab=32000,
        head_dim=128, qk_norm=True,
    ),
    # Llama-3-70B's shape: for `plan` on a --shapes-only directory (140 GB at fp16)
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672, vocab=128256),
    # Qwen3-MoE: experts, experts per token, expert width (head_dim: qk-norm heads)
    "moe-tiny": dict(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=96, vocab=512,
        experts=8, top_k=2, expert_dim=32, head_dim=16,
    ),
    "moe-a3b": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, hidden_dim=3072, vocab=32000,
        experts=64, top_k=8, expert_dim=384, head_dim=64,
    ),
    # DeepSeek-V3: latent attention (q/kv ranks, nope/rope/v head dims), experts in groups,
    # one shared expert, the first layer dense
    "deepseek-tiny": dict(
        dim=64, n_layers=2, n_heads=5, n_kv_heads=5, hidden_dim=96, vocab=512,
        experts=8, top_k=2, expert_dim=32, latent=(48, 32, 16, 8, 16), groups=(4, 2),
    ),
    "deepseek-v3": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=16, hidden_dim=2560, vocab=32000,
        experts=64, top_k=8, expert_dim=256, latent=(384, 128, 64, 32, 64), groups=(8, 4),
    ),
    # DeepSeek-V3.2: DeepSeek-V3's with the indexer (heads, head dim, top-k keys per query)
    "dsv32-tiny": dict(
        dim=64, n_layers=2, n_heads=5, n_kv_heads=5, hidden_dim=96, vocab=512,
        experts=8, top_k=2, expert_dim=32, latent=(48, 32, 16, 8, 16), groups=(4, 2),
        dsv32=(4, 16, 4),
    ),
    "deepseek-v32": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=16, hidden_dim=2560, vocab=32000,
        experts=64, top_k=8, expert_dim=256, latent=(384, 128, 64, 32, 64), groups=(8, 4),
        dsv32=(16, 64, 16),
    ),
    # MiniMax-M2: q/k norms over all heads, partial RoPE (minimax: rotary values per head),
    # experts behind sigmoid scores with a correction bias (hidden_dim: each expert's width)
    "minimax-tiny": dict(
        dim=64, n_layers=2, n_heads=10, n_kv_heads=2, hidden_dim=64, vocab=512,
        experts=5, top_k=2, expert_dim=64, head_dim=16, minimax=8,
    ),
    "minimax": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, hidden_dim=512, vocab=32000,
        experts=64, top_k=8, expert_dim=512, head_dim=64, minimax=32,
    ),
    # Nemotron-H: one mixer per layer by its pattern (nemotron), Mamba-2 (mamba: heads, head
    # dim, groups, state values), attention without RoPE, relu2 experts + a shared one
    # (shared: its width), relu2 feed-forward layers of hidden_dim
    "nemotron-tiny": dict(
        dim=64, n_layers=4, n_heads=10, n_kv_heads=5, hidden_dim=64, vocab=512, experts=5,
        top_k=2, expert_dim=64, head_dim=16, nemotron="ME*-", mamba=(10, 16, 5, 16), shared=64,
    ),
    "nemotron": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=2, hidden_dim=512, vocab=32000,
        experts=64, top_k=6, expert_dim=512, head_dim=64, nemotron="MEMEM*EM",
        mamba=(32, 64, 8, 64), shared=1024,
    ),
    # Llama 4: chunked RoPE layers and a global NoPE one in every 4 (llama4: chunk size,
    # every how many layers the experts, top-1 beside a shared expert, are)
    "llama4-tiny": dict(
        dim=64, n_layers=4, n_heads=10, n_kv_heads=2, hidden_dim=128, vocab=512,
        experts=5, top_k=1, expert_dim=64, head_dim=16, llama4=(8, 2),
    ),
    "llama4": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, hidden_dim=2048, vocab=32000,
        experts=16, top_k=1, expert_dim=1024, head_dim=64, llama4=(32, 1),
    ),
    # Step-3.5: a global layer then three sliding ones (window) with their own heads
    # (step3p5: sliding query heads, sliding KV heads), gated per head; the first layer dense
    "step3p5-tiny": dict(
        dim=64, n_layers=4, n_heads=8, n_kv_heads=2, hidden_dim=128, vocab=512,
        experts=8, top_k=2, expert_dim=64, head_dim=16, window=8, step3p5=(12, 2),
    ),
    "step3p5": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=2, hidden_dim=3072, vocab=32000,
        experts=64, top_k=8, expert_dim=320, head_dim=64, window=128, step3p5=(24, 2),
    ),
    # Kimi-Linear: KDA layers (kimi: heads, head dim) in 3 of 4, latent attention without
    # RoPE (latent: -, kv rank, nope, rope, v head dims) in the 4th, experts + a shared one
    # after a dense first layer
    "kimi-tiny": dict(
        dim=64, n_layers=4, n_heads=5, n_kv_heads=5, hidden_dim=96, vocab=512,
        experts=8, top_k=2, expert_dim=32, latent=(0, 32, 16, 8, 16), kimi=(5, 16),
    ),
    "kimi-linear": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=16, hidden_dim=2560, vocab=32000,
        experts=64, top_k=8, expert_dim=256, latent=(0, 256, 64, 32, 64), kimi=(16, 64),
    ),
    # Kimi K3: fused KDA (k3: heads, head dim, the experts' latent width, attention-residual
    # block size) in 3 of 4 layers, gated latent attention through q_lora_rank (latent: q
    # rank, kv rank, nope, rope, v head dims) in the 4th, SiTU, latent experts + a shared one
    # after a dense first layer, attention residuals
    "kimi-k3-tiny": dict(
        dim=64, n_layers=4, n_heads=5, n_kv_heads=5, hidden_dim=96, vocab=512,
        experts=8, top_k=2, expert_dim=32, latent=(32, 32, 16, 8, 16), k3=(5, 16, 32, 2),
    ),
    "kimi-k3": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=16, hidden_dim=2560, vocab=32000,
        experts=64, top_k=8, expert_dim=256, latent=(384, 256, 64, 32, 64), k3=(16, 64, 512, 4),
    ),
    # gpt-oss: sinks, sliding-window layers (window), biased experts behind the clamped SwiGLU
    "gpt-oss-tiny": dict(
        dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=64, vocab=512,
        experts=8, top_k=2, expert_dim=64, head_dim=16, window=8,
    ),
    "gpt-oss": dict(
        dim=768, n_layers=8, n_heads=16, n_kv_heads=2, hidden_dim=768, vocab=32000,
        experts=32, top_k=4, expert_dim=768, head_dim=64, window=128,
    ),
    # GLM-4.5: q/k-normed heads of head_dim, half rotated, biases; routed as DeepSeek-V3
    "glm-tiny": dict(
        dim=64, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=96, vocab=512,
        experts=8, top_k=2, expert_dim=32, head_dim=16, glm=True,
    ),
    "glm4-moe": dict(
        dim=1024, n_layers=8, n_heads=24, n_kv_heads=2, hidden_dim=3072, vocab=32000,
        experts=64, top_k=8, expert_dim=384, head_dim=64, glm=True,
    ),
    # Gemma 4 (MoE): sliding (window) and global layers (global_head_dim, global KV
    # heads, keys = values), the dense GeGLU beside the experts, capped logits
    "gemma4-tiny": dict(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab=512,
        experts=8, top_k=2, expert_dim=32, head_dim=16, window=8, pattern=2,
        gemma4=(32, 1),
    ),
    "gemma4-moe": dict(
        dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=1024, vocab=32000,
        experts=32, top_k=4, expert_dim=256, head_dim=64, window=128, pattern=4,
        gemma4=(128, 2),
    ),
}  # fmt: skip
# q4: quantized from float32 (float32 scales: MLX's CPU quantized kernels are slow in float16)
DTYPES = {
    "fp16": mx.float16,
    "bf16": mx.bfloat16,
    "fp32": mx.float32,
    "q4": mx.float32,
    "mxfp4": mx.float32,  # stacked experts in MLX's mxfp4 mode, the rest float32
}


def parse_spec(spec: str) -> tuple[dict, mx.Dtype]:
    """`0.5b-fp16` -> (size dict, dtype); ValueError naming the choices otherwise."""
    from .synthetic_hybrid import HYBRIDS

    size, _, dtype = spec.rpartition("-")
    if (size not in SIZES and size not in HYBRIDS) or dtype not in DTYPES:
        raise ValueError(
            f"synthetic model {spec!r}: expected SIZE-DTYPE with SIZE in "
            f"{', '.join([*SIZES, *HYBRIDS])} and DTYPE in {', '.join(DTYPES)}"
        )
    return SIZES.get(size, {"hybrid": size}), DTYPES[dtype]


def _deepseek_config(s: dict) -> dict:
    q_rank, kv_rank, nope, rope, v = s["latent"]
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "n_routed_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "moe_intermediate_size": s["expert_dim"],
        "n_shared_experts": 1,
        "n_group": s["groups"][0],
        "topk_group": s["groups"][1],
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "q_lora_rank": q_rank,
        "kv_lora_rank": kv_rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
    }


def _deepseek_v32_config(s: dict) -> dict:
    heads, head_dim, topk = s["dsv32"]
    return _deepseek_config(s) | {
        "model_type": "deepseek_v32",
        "architectures": ["DeepseekV32ForCausalLM"],
        "index_n_heads": heads,
        "index_head_dim": head_dim,
        "index_topk": topk,
    }


def _minimax_config(s: dict) -> dict:
    return {
        "model_type": "minimax",
        "architectures": ["MiniMaxM2ForCausalLM"],
        "num_local_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "shared_intermediate_size": 0,
        "head_dim": s["head_dim"],
        "rotary_dim": s["minimax"],
        "rope_theta": 5000000.0,
        "use_qk_norm": True,
        "scoring_func": "sigmoid",
    }


def _nemotron_config(s: dict) -> dict:
    nh, hd, ng, ds = s["mamba"]
    return {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "hybrid_override_pattern": list(s["nemotron"]),
        "head_dim": s["head_dim"],
        "attention_bias": False,
        "mamba_num_heads": nh,
        "mamba_head_dim": hd,
        "n_groups": ng,
        "ssm_state_size": ds,
        "conv_kernel": 4,
        "mamba_proj_bias": False,
        "use_conv_bias": True,
        "mlp_bias": False,
        "use_bias": False,
        "layer_norm_epsilon": 1e-5,
        "n_routed_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "moe_intermediate_size": s["expert_dim"],
        "moe_shared_expert_intermediate_size": s["shared"],
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    }


def _llama4_config(s: dict) -> dict:
    """The wrapper's config (mlx-lm's llama4 reads `text_config`), Llama 4 Scout's RoPE."""
    chunk, step = s["llama4"]
    text = {
        "model_type": "llama4_text",
        "hidden_size": s["dim"],
        "num_hidden_layers": s["n_layers"],
        "num_attention_heads": s["n_heads"],
        "num_key_value_heads": s["n_kv_heads"],
        "head_dim": s["head_dim"],
        "intermediate_size": s["expert_dim"],
        "intermediate_size_mlp": s["hidden_dim"],
        "vocab_size": s["vocab"],
        "num_local_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "interleave_moe_layer_step": step,
        "attention_chunk_size": chunk,
        "attention_bias": False,
        "use_qk_norm": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 4096,
    }
    return {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text,
    }


def _step3p5_config(s: dict) -> dict:
    """Step-3.5-Flash's layout (a global layer then three sliding ones, partial RoPE on
    the global ones, YaRN only there, clamps on the last layers' SwiGLUs)."""
    n, (swa_heads, swa_kv) = s["n_layers"], s["step3p5"]
    types = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(n)]
    return {
        "model_type": "step3p5",
        "architectures": ["Step3p5ForCausalLM"],
        "num_attention_groups": s["n_kv_heads"],
        "head_dim": s["head_dim"],
        "layer_types": types,
        "attention_other_setting": {
            "num_attention_heads": swa_heads,
            "num_attention_groups": swa_kv,
        },
        "sliding_window": s["window"],
        "rope_theta": [5000000.0 if t == "full_attention" else 10000.0 for t in types],
        "partial_rotary_factors": [0.5 if t == "full_attention" else 1.0 for t in types],
        "yarn_only_types": ["full_attention"],
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 131072,
        },
        "use_head_wise_attn_gate": True,
        "moe_num_experts": s["experts"],
        "moe_top_k": s["top_k"],
        "moe_intermediate_size": s["expert_dim"],
        "share_expert_dim": s["expert_dim"],
        "moe_layers_enum": ",".join(str(i) for i in range(1, n)),
        "moe_router_scaling_factor": 3.0,
        "norm_expert_weight": True,
        "swiglu_limits": [0.0] * (n - 2) + [7.0, 7.0],
        "swiglu_limits_shared": [0.0] * (n - 2) + [16.0, 16.0],
        "max_position_embeddings": 4096,
    }


def _kimi_k3_config(s: dict) -> dict:
    q_rank, kv_rank, nope, rope, v = s["latent"]
    heads, head_dim, latent, block = s["k3"]
    layers = range(1, s["n_layers"] + 1)
    return {
        "model_type": "kimi_k3",
        "q_lora_rank": q_rank,
        "kv_lora_rank": kv_rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {
            "kda_layers": [i for i in layers if i % 4],
            "full_attn_layers": [i for i in layers if i % 4 == 0],
            "num_heads": heads,
            "head_dim": head_dim,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "hidden_act": "situ",
        "activation_situ_beta": 2.0,
        "activation_situ_linear_beta": 4.0,
        "attn_res_block_size": block,
        "num_experts": s["experts"],
        "num_experts_per_token": s["top_k"],
        "num_shared_experts": 1,
        "moe_intermediate_size": s["expert_dim"],
        "routed_expert_hidden_size": latent,
        "latent_moe_use_norm": True,
        "first_k_dense_replace": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 2.5,
    }


def _kimi_config(s: dict) -> dict:
    _, kv_rank, nope, rope, v = s["latent"]
    heads, head_dim = s["kimi"]
    layers = range(1, s["n_layers"] + 1)
    return {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "head_dim": v,
        "kv_lora_rank": kv_rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
        "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": [i for i in layers if i % 4],
            "full_attn_layers": [i for i in layers if i % 4 == 0],
            "num_heads": heads,
            "head_dim": head_dim,
            "short_conv_kernel_size": 4,
        },
        "model_max_length": 4096,
        "num_experts": s["experts"],
        "num_experts_per_token": s["top_k"],
        "num_shared_experts": 1,
        "moe_intermediate_size": s["expert_dim"],
        "first_k_dense_replace": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
    }


def _gpt_oss_config(s: dict) -> dict:
    return {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "num_local_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "head_dim": s["head_dim"],
        "sliding_window": s["window"],
        "layer_types": ["sliding_attention", "full_attention"] * (s["n_layers"] // 2),
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
        },
        "swiglu_limit": 7.0,
        "attention_bias": True,
    }


def _glm_config(s: dict) -> dict:
    return {
        "model_type": "glm4_moe",
        "architectures": ["Glm4MoeForCausalLM"],
        "n_routed_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "moe_intermediate_size": s["expert_dim"],
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "head_dim": s["head_dim"],
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "attention_bias": True,
        "rope_scaling": None,
    }


def _gemma4_config(s: dict) -> dict:
    global_head_dim, global_kv_heads = s["gemma4"]
    return {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "head_dim": s["head_dim"],
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": global_kv_heads,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "sliding_window": s["window"],
        "sliding_window_pattern": s["pattern"],
        "enable_moe_block": True,
        "num_experts": s["experts"],
        "top_k_experts": s["top_k"],
        "moe_intermediate_size": s["expert_dim"],
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }


def _mlx_lm_tensors(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors mlx-lm's own model class for `config` holds, by the names it saves
    (built lazily: nothing computed); norms and scales "ones", the rest "normal"."""
    import importlib

    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    return [
        (name, tuple(v.shape), "ones" if "norm" in name or "scal" in name else "normal")
        for name, v in tree_flatten(model.parameters())
    ]


def hf_config(s: dict, dtype_name: str) -> dict:
    moe = {}
    if "gemma4" in s:
        moe = _gemma4_config(s)
    elif "k3" in s:
        moe = _kimi_k3_config(s)
    elif "kimi" in s:
        moe = _kimi_config(s)
    elif "dsv32" in s:
        moe = _deepseek_v32_config(s)
    elif "minimax" in s:
        moe = _minimax_config(s)
    elif "nemotron" in s:
        moe = _nemotron_config(s)
    elif "llama4" in s:
        moe = _llama4_config(s)
    elif "step3p5" in s:
        moe = _step3p5_config(s)
    elif "window" in s:
        moe = _gpt_oss_config(s)
    elif "latent" in s:
        moe = _deepseek_config(s)
    elif "glm" in s:
        moe = _glm_config(s)
    elif "qk_norm" in s:
        moe = {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "head_dim": s["head_dim"],
        }
    elif "experts" in s:
        moe = {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": s["experts"],
            "num_experts_per_tok": s["top_k"],
            "moe_intermediate_size": s["expert_dim"],
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "head_dim": s["head_dim"],
        }
    if dtype_name == "q4":
        moe["quantization"] = {"group_size": Q4_GROUP, "bits": 4, "mode": "affine"}
    if dtype_name == "mxfp4":
        moe["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": s["dim"],
        "num_hidden_layers": s["n_layers"],
        "num_attention_heads": s["n_heads"],
        "num_key_value_heads": s["n_kv_heads"],
        "intermediate_size": s["hidden_dim"],
        "vocab_size": s["vocab"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": {"fp16": "float16", "bf16": "bfloat16"}.get(dtype_name, "float32"),
        "bos_token_id": 1,
        "eos_token_id": 2,
        **moe,
    }


def tensor_list(s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Every Hugging Face-named tensor: (name, shape, init: "normal" random, "ones" a norm,
    "zeros" a float32 routing bias), in the order the random ones are drawn."""
    # mlx-lm's own class lists their tensors
    own = ("gemma4", "dsv32", "minimax", "kimi", "k3", "llama4", "step3p5", "nemotron")
    if any(k in s for k in own):
        return _mlx_lm_tensors(hf_config(s, "fp32"))
    d, h, hd = s["dim"], s["hidden_dim"], s.get("head_dim") or s["dim"] // s["n_heads"]
    nh, nkv = s["n_heads"], s["n_kv_heads"]
    out = [("model.embed_tokens.weight", (s["vocab"], d), "normal")]
    out += [("lm_head.weight", (s["vocab"], d), "normal"), ("model.norm.weight", (d,), "ones")]
    for i in range(s["n_layers"]):
        p = f"model.layers.{i}."
        if "latent" in s:
            out += _latent_attention(s, p + "self_attn.")
        elif "window" in s:
            out += _gpt_oss_layer(s, p)
        else:
            out += [
                (p + "self_attn.q_proj.weight", (nh * hd, d), "normal"),
                (p + "self_attn.k_proj.weight", (nkv * hd, d), "normal"),
                (p + "self_attn.v_proj.weight", (nkv * hd, d), "normal"),
                (p + "self_attn.o_proj.weight", (d, nh * hd), "normal"),
            ]
        if "glm" in s:  # q/k/v biases and q/k norms
            out += [
                (p + "self_attn.q_proj.bias", (nh * hd,), "normal"),
                (p + "self_attn.k_proj.bias", (nkv * hd,), "normal"),
                (p + "self_attn.v_proj.bias", (nkv * hd,), "normal"),
                (p + "self_attn.q_norm.weight", (hd,), "ones"),
                (p + "self_attn.k_norm.weight", (hd,), "ones"),
            ]
        sigmoid_group = "latent" in s or "glm" in s
        if "window" in s:
            pass  # attention and experts above
        elif sigmoid_group and i == 0:  # DeepSeek-V3's and GLM-4.5's dense first layer
            out += _dense(p, d, h)
        elif sigmoid_group:  # grouped routing with its bias, the experts, a shared expert
            e, m = s["experts"], s["expert_dim"]
            out += [
                (p + "mlp.gate.weight", (e, d), "normal"),
                (p + "mlp.gate.e_score_correction_bias", (e,), "zeros"),
                (p + "mlp.switch_mlp.gate_proj.weight", (e, m, d), "normal"),
                (p + "mlp.switch_mlp.up_proj.weight", (e, m, d), "normal"),
                (p + "mlp.switch_mlp.down_proj.weight", (e, d, m), "normal"),
                (p + "mlp.shared_experts.gate_proj.weight", (m, d), "normal"),
                (p + "mlp.shared_experts.up_proj.weight", (m, d), "normal"),
                (p + "mlp.shared_experts.down_proj.weight", (d, m), "normal"),
            ]
        elif "experts" in s:  # stacked, as mlx-lm stores them
            e, m = s["experts"], s["expert_dim"]
            out += [
                (p + "mlp.gate.weight", (e, d), "normal"),
                (p + "mlp.switch_mlp.gate_proj.weight", (e, m, d), "normal"),
                (p + "mlp.switch_mlp.up_proj.weight", (e, m, d), "normal"),
                (p + "mlp.switch_mlp.down_proj.weight", (e, d, m), "normal"),
                (p + "self_attn.q_norm.weight", (hd,), "ones"),
                (p + "self_attn.k_norm.weight", (hd,), "ones"),
            ]
        else:
            out += _dense(p, d, h)
            if "qk_norm" in s:
                out += [
                    (p + "self_attn.q_norm.weight", (hd,), "ones"),
                    (p + "self_attn.k_norm.weight", (hd,), "ones"),
                ]
        out += [(p + "input_layernorm.weight", (d,), "ones")]
        out += [(p + "post_attention_layernorm.weight", (d,), "ones")]
    return out


def _dense(p: str, d: int, h: int) -> list[tuple[str, tuple[int, ...], str]]:
    return [
        (p + "mlp.gate_proj.weight", (h, d), "normal"),
        (p + "mlp.up_proj.weight", (h, d), "normal"),
        (p + "mlp.down_proj.weight", (d, h), "normal"),
    ]


def _gpt_oss_layer(s: dict, p: str) -> list[tuple[str, tuple[int, ...], str]]:
    """gpt-oss's attention (biases, sinks) and experts as mlx-lm stores them."""
    d, nh, nkv, hd = s["dim"], s["n_heads"], s["n_kv_heads"], s["head_dim"]
    e, m = s["experts"], s["expert_dim"]
    out = []
    for name, rows, cols in (
        ("q_proj", nh * hd, d), ("k_proj", nkv * hd, d), ("v_proj", nkv * hd, d),
        ("o_proj", d, nh * hd),
    ):  # fmt: skip
        out += [(f"{p}self_attn.{name}.weight", (rows, cols), "normal")]
        out += [(f"{p}self_attn.{name}.bias", (rows,), "small")]
    out += [(p + "self_attn.sinks", (nh,), "small")]
    out += [(p + "mlp.router.weight", (e, d), "normal"), (p + "mlp.router.bias", (e,), "small")]
    for name, rows, cols in (("gate_proj", m, d), ("up_proj", m, d), ("down_proj", d, m)):
        out += [(f"{p}mlp.experts.{name}.weight", (e, rows, cols), "normal")]
        out += [(f"{p}mlp.experts.{name}.bias", (e, rows), "small")]
    return out


def _latent_attention(s: dict, p: str) -> list[tuple[str, tuple[int, ...], str]]:
    """DeepSeek-V3's attention as mlx-lm stores it (kv_b_proj split per head)."""
    d, nh = s["dim"], s["n_heads"]
    q_rank, kv_rank, nope, rope, v = s["latent"]
    return [
        (p + "q_a_proj.weight", (q_rank, d), "normal"),
        (p + "q_a_layernorm.weight", (q_rank,), "ones"),
        (p + "q_b_proj.weight", (nh * (nope + rope), q_rank), "normal"),
        (p + "kv_a_proj_with_mqa.weight", (kv_rank + rope, d), "normal"),
        (p + "kv_a_layernorm.weight", (kv_rank,), "ones"),
        (p + "embed_q.weight", (nh, kv_rank, nope), "normal"),
        (p + "unembed_out.weight", (nh, v, kv_rank), "normal"),
        (p + "o_proj.weight", (d, nh * v), "normal"),
    ]
