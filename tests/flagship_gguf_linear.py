"""Kimi-Linear, Kimi K3 and Nemotron-H (the linear-attention and Mamba families) as
llama.cpp's converter writes their GGUF files (see flagship_gguf.py)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from gguf_parts import gguf_finish, gguf_folder, gguf_tensor, gguf_vocabulary

# -- Kimi-Linear as llama.cpp's converter writes it (convert_hf_to_gguf.py's KimiLinearModel)
KIMI_GGUF = [
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

    import gguf
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
    gguf_vocabulary(w, vocab)
    gguf_folder(w, src, KIMI_GGUF, quantized, stored, ("ssm_conv1d",), _kda_as_stored)
    return gguf_finish(w, out)


def _kda_as_stored(name: str, a):
    """A KDA tensor as llama.cpp's converter stores it: ssm_a = -exp(A_log), the convs
    (C, K, 1) as (1, C, 1, K)."""
    import numpy as np

    if name.endswith("A_log"):
        return -np.exp(a)
    if "_conv.conv." in name:
        return a[..., 0].reshape(1, a.shape[0], 1, a.shape[1])
    return a


# -- Kimi K3 as llama.cpp's converter writes it (conversion/kimi_k3.py's KimiK3Model)
_K3_GGUF = [
    (r"\.self_attn\.q_a_proj\.", ".attn_q_a."),
    (r"\.self_attn\.q_a_layernorm\.", ".attn_q_a_norm."),
    (r"\.self_attn\.q_b_proj\.", ".attn_q_b."),
    (r"\.mlp\.routed_expert_(down|up)_proj\.", r".ffn_routed_\1."),
    (r"\.mlp\.routed_expert_norm\.", ".ffn_routed_norm."),
    *KIMI_GGUF,
]


def gguf_k3(
    src: Path, out: Path, quantized: int | None = None, stored: bool = True, experts: bool = False
) -> Path:
    """mlx-lm's float32 Kimi K3 folder `src` as llama.cpp's converter writes its GGUF
    (`kimi-k3`): Kimi-Linear's layout (the convs (1, C, 1, K), ssm_a = -exp(A_log),
    dt_bias as ssm_dt.bias, k_b / v_b per head, a KV head count per layer, 0 in a KDA
    layer, the experts stacked) with the release's q/k/v projections and convs apart, the
    KDA gate as ssm_g and the latent attention's as attn_gate, each residual query's norm
    * proj fused into one vector (attn_res_score, ffn_res_score, output_res_score), the
    latent experts' ffn_routed_{down,up,norm} and the K3 keys (kda.gate_lower_bound,
    activation.situ_*, expert_latent_length, attn_res.block_size). Not in the installed
    gguf package: its keys are written literally. float32, or with `quantized` every
    matrix whose rows take its blocks but the routers (`stored` False: dequantized); with
    `experts`, the stacked experts only (as the converter writes the release's packed
    experts: MXFP4)."""
    import re

    import gguf
    import numpy as np
    from gguf_writer import llama_vocabulary

    c = json.loads((src / "config.json").read_text())
    lin, n, arch = c["linear_attn_config"], c["num_hidden_layers"], "kimi-k3"
    rank, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    w = gguf.GGUFWriter(str(out), arch)
    ints = {
        "block_count": n,
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"],
        "vocab_size": c["vocab_size"],
        "expert_count": c["num_experts"],
        "expert_used_count": c["num_experts_per_token"],
        "ssm.conv_kernel": lin["short_conv_kernel_size"],
        "kda.head_dim": lin["head_dim"],
        "attention.q_lora_rank": c["q_lora_rank"],
        "attention.kv_lora_rank": rank,
        "rope.dimension_count": rope,
        "attention.key_length": rank + rope,
        "attention.value_length": rank,
        "attention.key_length_mla": c["qk_nope_head_dim"] + rope,
        "attention.value_length_mla": c["v_head_dim"],
        "expert_feed_forward_length": c["moe_intermediate_size"],
        "expert_shared_count": c["num_shared_experts"],
        "leading_dense_block_count": c["first_k_dense_replace"],
        "expert_gating_func": 2,  # sigmoid
        "expert_latent_length": c["routed_expert_hidden_size"],
        "attn_res.block_size": c["attn_res_block_size"],
    }
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    kv = [1 if i + 1 in lin["full_attn_layers"] else 0 for i in range(n)]
    w.add_array(f"{arch}.attention.head_count_kv", kv)
    floats = {
        "attention.layer_norm_rms_epsilon": c["rms_norm_eps"],
        "kda.gate_lower_bound": lin["gate_lower_bound"],
        "expert_weights_scale": c["routed_scaling_factor"],
        "activation.situ_beta": c["activation_situ_beta"],
        "activation.situ_linear_beta": c["activation_situ_linear_beta"],
    }
    for key, value in floats.items():
        w.add_float32(f"{arch}.{key}", value)
    w.add_bool(f"{arch}.expert_weights_norm", c.get("moe_renormalize", True))
    gguf_vocabulary(w, llama_vocabulary(c["vocab_size"]))
    qtype = gguf.GGMLQuantizationType(quantized) if quantized else None
    weights = {
        k.removeprefix("language_model."): np.array(v.astype(mx.float32))
        for k, v in mx.load(str(src / "model.safetensors")).items()
    }
    tensors = {}
    for name, a in weights.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        kda = layer + 1 in lin["kda_layers"]
        if "_res_proj." in name:
            continue  # fused with its norm
        if "_res_norm." in name:  # norm * proj -> one vector
            a = a * weights[name.replace("_res_norm.", "_res_proj.")].reshape(-1)
            name = re.sub(r"self_attention_res_norm", "attn_res_score", name)
            name = re.sub(r"mlp_res_norm", "ffn_res_score", name)
            name = re.sub(r"^model\.output_attn_res_norm", "output_res_score", name)
        elif name.endswith("A_log"):
            a = -np.exp(a)
        elif ".g_proj." in name:
            name = name.replace(".self_attn.g_proj.", ".ssm_g." if kda else ".attn_gate.")
        if ".qkv_proj." in name or ".qkv_conv." in name:
            for x, part in zip("qkv", np.split(a, 3), strict=True):
                if ".qkv_proj." in name:
                    tensors[name.replace("self_attn.qkv_proj", f"attn_{x}")] = part
                else:  # (C, K, 1) -> (1, C, 1, K)
                    part = part[..., 0].reshape(1, part.shape[0], 1, part.shape[1])
                    tensors[name.replace("self_attn.qkv_conv.conv", f"ssm_conv1d_{x}")] = part
            continue
        tensors[name] = a
    for name, a in sorted(tensors.items()):
        for pattern, repl in _K3_GGUF:
            name = re.sub(pattern, repl, name)
        a = np.ascontiguousarray(a)
        fits = (  # llama.cpp's quantizer keeps the routers (ffn_gate_inp), convs and norms
            qtype is not None
            and a.ndim >= 2
            and a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
            and "ffn_gate_inp" not in name
            and "ssm_conv1d" not in name
            and (not experts or "_exps." in name)
        )
        gguf_tensor(w, name, a, quantized if fits else None, stored)
    return gguf_finish(w, out)


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
    gguf_vocabulary(w, vocab)

    def as_stored(name: str, a):
        if name.endswith("A_log"):
            a = -np.exp(a)
        if name.endswith(("A_log", ".D")):
            return a.reshape(-1, 1)
        if name.endswith("mixer.norm.weight"):
            return a.reshape(ng, -1)
        if name.endswith("conv1d.weight"):  # (C, K, 1) -> (C, K)
            return a[..., 0]
        return a

    gguf_folder(w, src, _NEMOTRON_GGUF, quantized, stored, _NEMOTRON_FLOAT, as_stored)
    return gguf_finish(w, out)
