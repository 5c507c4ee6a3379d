"""Flagship families' tiny folders as llama.cpp's converter writes their GGUF files.

Each writer takes mlx-lm's float32 folder (flagship_fixtures.py) and writes the file
convert_hf_to_gguf.py would: llama.cpp's tensor names and metadata keys, float32, or
with `quantized` (a ggml type) every projection whose rows take its blocks (gguf-py's
quantization; `stored` False: the same values dequantized, as float32).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

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


# -- GLM-5 / DeepSeek-V3.2 as llama.cpp's converter writes them (conversion/glm.py's
# GlmMoeDsaModel, conversion/deepseek.py's DeepseekV32Model: DeepseekV2Model's layout)
_SPARSE_GGUF = [
    (r"\.self_attn\.q_a_proj\.", ".attn_q_a."),
    (r"\.self_attn\.q_a_layernorm\.", ".attn_q_a_norm."),
    (r"\.self_attn\.q_b_proj\.", ".attn_q_b."),
    (r"\.self_attn\.indexer\.wq_b\.", ".indexer.attn_q_b."),
    (r"\.self_attn\.indexer\.wk\.", ".indexer.attn_k."),
    (r"\.self_attn\.indexer\.k_norm\.", ".indexer.k_norm."),
    (r"\.self_attn\.indexer\.weights_proj\.", ".indexer.proj."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".exp_probs_b.bias"),
    *_KIMI_GGUF,
]


def gguf_sparse(src: Path, out: Path, quantized: int | None = None, stored: bool = True) -> Path:
    """mlx-lm's float32 GLM-5 (`glm-dsa`) or DeepSeek-V3.2 (`deepseek32`) folder `src` as
    llama.cpp's converter writes its GGUF: deepseek2's newer layout (the latent as MQA over
    kv_lora_rank + rope values, attn_k_b / attn_v_b per head, the experts stacked, the
    routing bias as exp_probs_b.bias) plus the indexer's four tensors as stored and
    `attention.indexer.{head_count,key_length,top_k}`; YaRN as rope.scaling.* (the log
    multiplier 0.1 * mscale_all_dim). deepseek32 is not in the installed gguf package's
    names: its keys are written literally. float32, or with `quantized` (a ggml type)
    every matrix whose rows take its blocks but the routers, as llama.cpp's quantizer
    (`stored` False: the same values dequantized)."""
    import re

    import gguf
    import numpy as np
    from gguf_writer import llama_vocabulary

    c = json.loads((src / "config.json").read_text())
    arch = {"glm_moe_dsa": "glm-dsa", "deepseek_v32": "deepseek32"}[c["model_type"]]
    rope = c.get("rope_parameters") or {"rope_theta": c["rope_theta"]}
    w = gguf.GGUFWriter(str(out), arch)
    rank, rope_dim = c["kv_lora_rank"], c["qk_rope_head_dim"]
    ints = {
        "block_count": c["num_hidden_layers"],
        "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": 1,  # MQA over the latent
        "attention.key_length": rank + rope_dim,
        "attention.value_length": rank,
        "attention.key_length_mla": c["qk_nope_head_dim"] + rope_dim,
        "attention.value_length_mla": c["v_head_dim"],
        "attention.q_lora_rank": c["q_lora_rank"],
        "attention.kv_lora_rank": rank,
        "rope.dimension_count": rope_dim,
        "vocab_size": c["vocab_size"],
        "leading_dense_block_count": c["first_k_dense_replace"],
        "expert_count": c["n_routed_experts"],
        "expert_used_count": c["num_experts_per_tok"],
        "expert_feed_forward_length": c["moe_intermediate_size"],
        "expert_shared_count": c["n_shared_experts"],
        "expert_group_count": c["n_group"],
        "expert_group_used_count": c["topk_group"],
        "expert_gating_func": 2,  # scoring_func sigmoid
        "attention.indexer.head_count": c["index_n_heads"],
        "attention.indexer.key_length": c["index_head_dim"],
        "attention.indexer.top_k": c["index_topk"],
    }
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_float32(f"{arch}.expert_weights_scale", c["routed_scaling_factor"])
    if c["norm_topk_prob"]:
        w.add_bool(f"{arch}.expert_weights_norm", True)
    yarn = c.get("rope_scaling") or {}
    if yarn.get("type", yarn.get("rope_type")) == "yarn":
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", yarn["factor"])
        orig = yarn["original_max_position_embeddings"]
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", orig)
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1 * yarn["mscale_all_dim"])
    _gguf_vocabulary(w, llama_vocabulary(c["vocab_size"]))
    qtype = gguf.GGMLQuantizationType(quantized) if quantized else None
    for name, v in sorted(mx.load(str(src / "model.safetensors")).items()):
        a = np.ascontiguousarray(np.array(v.astype(mx.float32)))
        for pattern, repl in _SPARSE_GGUF:
            name = re.sub(pattern, repl, name)
        fits = (  # llama.cpp's quantizer keeps the routers (ffn_gate_inp) and norms
            qtype is not None
            and a.ndim >= 2
            and a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
            and "ffn_gate_inp" not in name
        )
        _gguf_tensor(w, name, a, quantized if fits else None, stored)
    return _gguf_finish(w, out)


# -- Llama 4 as llama.cpp's converter writes it (conversion/llama.py's Llama4Model)
_LLAMA4_GGUF = [
    (r"^language_model\.", ""),
    (r"\.feed_forward\.router\.", ".ffn_gate_inp."),
    (r"\.feed_forward\.experts\.(gate|up|down)_proj\.", r".ffn_\1_exps."),
    (r"\.feed_forward\.shared_expert\.(gate|up|down)_proj\.", r".ffn_\1_shexp."),
    (r"\.feed_forward\.", ".mlp."),
    *_KIMI_GGUF,
]


def gguf_llama4(src: Path, out: Path, quantized: int | None = None, stored: bool = True) -> Path:
    """mlx-lm's float32 Llama 4 folder `src` (the wrapper's text model) as llama.cpp's
    converter writes its GGUF (`llama4`): q/k as the folder's (the converter does not
    permute Llama 4's: interleaved already), the experts stacked (E, out, in), the dense
    width as feed_forward_length, the experts' as expert_feed_forward_length, the llama3
    RoPE scaling as its per-frequency factors (`rope_freqs`). Beyond the converter (which
    leaves llama.cpp's constants: chunks of 8192, floor_scale 8192, attn_scale 0.1): the
    tiny chunks and temperature floor as attention.sliding_window / temperature_length /
    temperature_scale. float32, or with `quantized` (a ggml type) every matrix whose rows
    take its blocks (`stored` False: the same values dequantized, as float32)."""
    import re

    import gguf
    import numpy as np
    from gguf_writer import llama_vocabulary

    from llama_tp.checkpoints.gguf_rope import factors

    c = json.loads((src / "config.json").read_text())["text_config"]
    arch = "llama4"
    w = gguf.GGUFWriter(str(out), arch)
    ints = {
        "block_count": c["num_hidden_layers"],
        "context_length": c.get("max_position_embeddings", 4096),
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size_mlp"],
        "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": c["num_key_value_heads"],
        "attention.key_length": c["head_dim"],
        "attention.value_length": c["head_dim"],
        "rope.dimension_count": c["head_dim"],
        "vocab_size": c["vocab_size"],
        "expert_count": c["num_local_experts"],
        "expert_used_count": c["num_experts_per_tok"],
        "interleave_moe_layer_step": c["interleave_moe_layer_step"],
        "expert_feed_forward_length": c["intermediate_size"],
        "attention.sliding_window": c["attention_chunk_size"],
        "attention.temperature_length": c["floor_scale"],
    }
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.temperature_scale", c["attn_scale"])
    w.add_float32(f"{arch}.rope.freq_base", c["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    _gguf_vocabulary(w, llama_vocabulary(c["vocab_size"]))
    scaling = factors(c["rope_theta"], c["head_dim"], c["rope_scaling"])
    w.add_tensor("rope_freqs.weight", scaling.astype(np.float32))
    qtype = gguf.GGMLQuantizationType(quantized) if quantized else None
    for name, v in sorted(mx.load(str(src / "model.safetensors")).items()):
        a = np.ascontiguousarray(np.array(v.astype(mx.float32)))
        for pattern, repl in _LLAMA4_GGUF:
            name = re.sub(pattern, repl, name)
        fits = (
            qtype is not None and a.ndim >= 2 and a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
        )
        _gguf_tensor(w, name, a, quantized if fits else None, stored)
    return _gguf_finish(w, out)


# -- Step-3.5 as llama.cpp's converter writes it (conversion/step3.py's Step35Model)
_STEP_GGUF = [
    (r"\.self_attn\.g_proj\.", ".attn_gate."),
    (r"\.self_attn\.([qk])_norm\.", r".attn_\1_norm."),
    (r"\.mlp\.gate\.gate\.", ".ffn_gate_inp."),
    (r"\.mlp\.gate\.router_bias$", ".exp_probs_b.bias"),
    (r"\.mlp\.share_expert\.(gate|up|down)_proj\.", r".ffn_\1_shexp."),
    *_KIMI_GGUF,
]


def gguf_step(src: Path, out: Path, quantized: int | None = None, stored: bool = True) -> Path:
    """mlx-lm's float32 Step-3.5 folder `src` as llama.cpp's converter writes its GGUF
    (`step35`): q/k as the folder's (NEOX RoPE), the norms as the folder's (mlx-lm and the
    converter both add Step's 1), the heads' gate as attn_gate, the routing bias as
    exp_probs_b.bias, the experts stacked; per-layer head / KV head counts, the
    sliding-window pattern, rope.freq_base (the first layer's) and freq_base_swa (the
    second's), YaRN as rope.scaling.*, the per-layer clamps. float32, or with `quantized`
    (a ggml type) every matrix whose rows take its blocks (`stored` False: the same
    values dequantized, as float32)."""
    import re

    import gguf
    import numpy as np
    from gguf_writer import llama_vocabulary

    c = json.loads((src / "config.json").read_text())
    arch, n = "step35", c["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), arch)
    other = c["attention_other_setting"]
    sliding = [t == "sliding_attention" for t in c["layer_types"]]
    assert [1.0 if x else 0.5 for x in sliding] == c["partial_rotary_factors"]  # as the converter
    ints = {
        "block_count": n,
        "context_length": c.get("max_position_embeddings", 4096),
        "embedding_length": c["hidden_size"],
        "feed_forward_length": c["intermediate_size"],
        "attention.key_length": c["head_dim"],
        "attention.value_length": c["head_dim"],
        "attention.sliding_window": c["sliding_window"],
        "expert_count": c["moe_num_experts"],
        "expert_used_count": c["moe_top_k"],
        "expert_feed_forward_length": c["moe_intermediate_size"],
        "expert_shared_feed_forward_length": c["share_expert_dim"],
        "leading_dense_block_count": min(int(i) for i in c["moe_layers_enum"].split(",")),
        "moe_every_n_layers": 1,
        "rope.scaling.original_context_length": c["rope_scaling"][
            "original_max_position_embeddings"
        ],
    }
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    heads = [other["num_attention_heads"] if x else c["num_attention_heads"] for x in sliding]
    kv = [other["num_attention_groups"] if x else c["num_attention_groups"] for x in sliding]
    w.add_array(f"{arch}.attention.head_count", heads)
    w.add_array(f"{arch}.attention.head_count_kv", kv)
    w.add_array(f"{arch}.attention.sliding_window_pattern", sliding)
    w.add_float32(f"{arch}.rope.freq_base", c["rope_theta"][0])
    w.add_float32(f"{arch}.rope.freq_base_swa", c["rope_theta"][1])
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    w.add_float32(f"{arch}.rope.scaling.factor", c["rope_scaling"]["factor"])
    w.add_float32(f"{arch}.expert_weights_scale", c["moe_router_scaling_factor"])
    w.add_bool(f"{arch}.expert_weights_norm", c["norm_expert_weight"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_array(f"{arch}.swiglu_clamp_exp", [float(v) for v in c["swiglu_limits"]])
    w.add_array(f"{arch}.swiglu_clamp_shexp", [float(v) for v in c["swiglu_limits_shared"]])
    _gguf_vocabulary(w, llama_vocabulary(c["vocab_size"]))
    qtype = gguf.GGMLQuantizationType(quantized) if quantized else None
    for name, v in sorted(mx.load(str(src / "model.safetensors")).items()):
        a = np.ascontiguousarray(np.array(v.astype(mx.float32)))
        for pattern, repl in _STEP_GGUF:
            name = re.sub(pattern, repl, name)
        fits = (
            qtype is not None
            and a.ndim >= 2
            and a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
            and "ffn_gate_inp" not in name
        )
        _gguf_tensor(w, name, a, quantized if fits else None, stored)
    return _gguf_finish(w, out)


# -- Gemma 4 as llama.cpp's converter writes it (conversion/gemma.py's Gemma4Model)
_GEMMA4_GGUF = [
    (r"^model\.embed_tokens_per_layer\.", "per_layer_token_embd."),
    (r"^model\.per_layer_model_projection\.", "per_layer_model_proj."),
    (r"^model\.per_layer_projection_norm\.", "per_layer_proj_norm."),
    (r"\.self_attn\.([qk])_norm\.", r".attn_\1_norm."),
    (r"\.pre_feedforward_layernorm_2\.", ".pre_ffw_norm_2."),
    (r"\.post_feedforward_layernorm(_[12])?\.", r".post_ffw_norm\1."),
    (r"\.post_attention_layernorm\.", ".post_attention_norm."),
    (r"\.pre_feedforward_layernorm\.", ".ffn_norm."),
    (r"\.router\.proj\.", ".ffn_gate_inp."),
    (r"\.router\.scale$", ".ffn_gate_inp.scale"),
    (r"\.router\.per_expert_scale$", ".ffn_down_exps.scale"),
    (r"\.experts\.switch_glu\.down_proj\.", ".ffn_down_exps."),
    (r"\.per_layer_input_gate\.", ".inp_gate."),
    (r"\.per_layer_projection\.", ".proj."),
    (r"\.post_per_layer_input_norm\.", ".post_norm."),
    (r"\.layer_scalar$", ".layer_output_scale.weight"),
    (r"\.input_layernorm\.", ".attn_norm."),
    *_KIMI_GGUF,
]


def gguf_gemma4(
    src: Path,
    out: Path,
    quantized: int | None = None,
    stored: bool = True,
    vocab: dict | None = None,
) -> Path:
    """mlx-lm's float32 Gemma 4 folder `src` as llama.cpp's converter writes its GGUF
    (`gemma4`): the norms as they are (no +1), the experts' gate and up stacked as
    ffn_gate_up_exps (E, 2 I, dim), the router's scale and per-expert scale as
    ffn_gate_inp.scale and ffn_down_exps.scale, the per-layer inputs' tensors, rope_freqs
    (1 for the global layers' rotated pairs, 1e30 for the others); per-layer KV heads
    and feed-forward widths, the sliding-window flags, shared_kv_layers, both head sizes.
    float32, or with `quantized` (a ggml type) every matrix whose rows take its blocks
    (`stored` False: the same values dequantized, as float32). `vocab`: tokenizer fields
    (`gemma4_vocabulary`'s), else a made-up sentencepiece one."""
    import re

    import gguf
    import numpy as np
    from gguf_writer import llama_vocabulary
    from mlx_lm.models.gemma4_text import ModelArgs

    d = ModelArgs.from_dict(json.loads((src / "config.json").read_text()))
    arch, n = "gemma4", d.num_hidden_layers
    first = n - d.num_kv_shared_layers
    swa = [t == "sliding_attention" for t in d.layer_types]
    w = gguf.GGUFWriter(str(out), arch)
    ints = {
        "block_count": n,
        "context_length": d.max_position_embeddings,
        "embedding_length": d.hidden_size,
        "attention.head_count": d.num_attention_heads,
        "attention.key_length": d.global_head_dim,
        "attention.value_length": d.global_head_dim,
        "attention.key_length_swa": d.head_dim,
        "attention.value_length_swa": d.head_dim,
        "attention.sliding_window": d.sliding_window,
        "attention.shared_kv_layers": d.num_kv_shared_layers,
        "embedding_length_per_layer_input": d.hidden_size_per_layer_input,
        "expert_count": d.num_experts,
        "expert_used_count": d.top_k_experts,
        "expert_feed_forward_length": d.moe_intermediate_size,
        "rope.dimension_count": d.global_head_dim,
        "rope.dimension_count_swa": d.head_dim,
    }
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    ff = [
        d.intermediate_size * (2 if d.use_double_wide_mlp and i >= first else 1) for i in range(n)
    ]
    w.add_array(f"{arch}.feed_forward_length", ff)
    kv = [d.num_key_value_heads if s else d.num_global_key_value_heads for s in swa]
    w.add_array(f"{arch}.attention.head_count_kv", kv)
    w.add_array(f"{arch}.attention.sliding_window_pattern", swa)
    rope = d.rope_parameters
    w.add_float32(f"{arch}.rope.freq_base", rope["full_attention"]["rope_theta"])
    w.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", d.rms_norm_eps)
    w.add_float32(f"{arch}.final_logit_softcapping", d.final_logit_softcapping)
    _gguf_vocabulary(w, vocab or llama_vocabulary(d.vocab_size))
    rotated = int(d.global_head_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    freqs = [1.0] * rotated + [1e30] * (d.global_head_dim // 2 - rotated)
    w.add_tensor("rope_freqs.weight", np.array(freqs, np.float32))
    weights = {
        k: np.array(v.astype(mx.float32))
        for k, v in mx.load(str(src / "model.safetensors")).items()
    }
    for name in sorted(weights):
        a = weights[name]
        if ".experts.switch_glu.up_proj." in name:
            continue
        if ".experts.switch_glu.gate_proj." in name:  # HF's gate_up_proj, as stored
            up = weights[name.replace("gate_proj", "up_proj")]
            a, name = (
                np.concatenate([a, up], axis=1),
                name.replace("experts.switch_glu.gate_proj", "ffn_gate_up_exps"),
            )
        for pattern, repl in _GEMMA4_GGUF:
            name = re.sub(pattern, repl, name)
        a = np.ascontiguousarray(a)
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(quantized)][0] if quantized else 0
        fits = bool(quantized) and a.ndim >= 2 and a.shape[-1] % block == 0
        _gguf_tensor(w, name, a, quantized if fits else None, stored)
    return _gguf_finish(w, out)


def gguf_gemma3(src: Path, out: Path, quantized: int | None = None, stored: bool = True) -> Path:
    """mlx-lm's float32 Gemma 3 folder `src` as llama.cpp's converter writes its GGUF
    (`gemma3`): every norm + 1 (Gemma 3's norms scale by 1 + w), rope.freq_base (global)
    and freq_base_swa (sliding), the window, and the layer types as flags per layer
    (attention.sliding_window_pattern: llama.cpp reads them; the converter leaves it out,
    llama.cpp's default being every sixth layer global). Its queries are scaled by
    1/sqrt(head_dim) in llama.cpp: a folder whose query_pre_attn_scalar is another
    number has no such file. float32, or with `quantized` (a ggml type) every matrix
    whose rows take its blocks (`stored` False: the same values dequantized)."""
    import re

    import gguf
    import numpy as np
    from gguf_writer import llama_vocabulary
    from mlx_lm.models.gemma3_text import ModelArgs

    d = ModelArgs.from_dict(json.loads((src / "config.json").read_text()))
    arch, n, p = "gemma3", d.num_hidden_layers, d.sliding_window_pattern
    w = gguf.GGUFWriter(str(out), arch)
    ints = {
        "block_count": n,
        "context_length": d.max_position_embeddings,
        "embedding_length": d.hidden_size,
        "feed_forward_length": d.intermediate_size,
        "attention.head_count": d.num_attention_heads,
        "attention.head_count_kv": d.num_key_value_heads,
        "attention.key_length": d.head_dim,
        "attention.value_length": d.head_dim,
        "attention.sliding_window": d.sliding_window,
    }
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_array(f"{arch}.attention.sliding_window_pattern", [(i + 1) % p != 0 for i in range(n)])
    w.add_float32(f"{arch}.rope.freq_base", d.rope_theta)
    w.add_float32(f"{arch}.rope.freq_base_swa", d.rope_local_base_freq)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", d.rms_norm_eps)
    _gguf_vocabulary(w, llama_vocabulary(d.vocab_size))
    for name, v in sorted(mx.load(str(src / "model.safetensors")).items()):
        a = np.array(v.astype(mx.float32))
        if name.endswith("norm.weight"):
            a = a + 1.0
        for pattern, repl in _GEMMA4_GGUF:
            name = re.sub(pattern, repl, name)
        a = np.ascontiguousarray(a)
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(quantized)][0] if quantized else 0
        fits = bool(quantized) and a.ndim >= 2 and a.shape[-1] % block == 0
        _gguf_tensor(w, name, a, quantized if fits else None, stored)
    return _gguf_finish(w, out)


def _gguf_vocabulary(w, vocab: dict) -> None:
    """The tokenizer fields of `gguf_writer.llama_vocabulary`'s or `gemma4_vocabulary`'s
    `vocab`."""
    w.add_string("tokenizer.ggml.model", vocab["tokenizer.ggml.model"])
    for key in ("tokens", "scores", "token_type", "merges"):
        if f"tokenizer.ggml.{key}" in vocab:
            w.add_array(f"tokenizer.ggml.{key}", vocab[f"tokenizer.ggml.{key}"])
    for key in ("bos", "eos", "unknown", "padding"):
        if f"tokenizer.ggml.{key}_token_id" in vocab:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab[f"tokenizer.ggml.{key}_token_id"])
    for key in ("add_space_prefix", "add_bos_token"):
        if f"tokenizer.ggml.{key}" in vocab:
            w.add_bool(f"tokenizer.ggml.{key}", vocab[f"tokenizer.ggml.{key}"])
    if "tokenizer.chat_template" in vocab:
        w.add_string("tokenizer.chat_template", vocab["tokenizer.chat_template"])


GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
GEMMA4_VISIBLE = ["<|channel>", "<channel|>"]  # USER_DEFINED, as llama.cpp's converter
GEMMA4_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Hello, world! Hello there, how are you today? I am fine, thank you.",
    "def hello():\n    return 'world'\n\n\nclass Thing:\n    pass\n",
    "Ça va? Déjà vu, naïve façade. Über straße.",
    "user\nWhat is the capital of France?\nmodel\nParis is the capital of France.\n\n",
]
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def gemma4_vocabulary(size: int) -> dict:
    """Tokenizer fields of a tiny Gemma-4-style vocabulary of `size` tokens as llama.cpp's
    converter writes them (`tokenizer.ggml.model` "gemma4"): the special tokens
    (CONTROL), two visible ones (USER_DEFINED), the 256 `<0xNN>` byte tokens, runs of 1
    to 3 newlines, then a BPE trained by `tokenizers` on spaces written as U+2581 and
    text cut at newlines, padded with `<unusedN>`; the merges, scores -1000, add_bos."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokens = GEMMA4_SPECIALS + GEMMA4_VISIBLE + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["\n", "\n\n", "\n\n\n"]
    types = [3] * len(GEMMA4_SPECIALS) + [4] * len(GEMMA4_VISIBLE) + [6] * 256 + [1] * 3
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    bpe.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated")
    trainer = trainers.BpeTrainer(vocab_size=size - len(tokens), show_progress=False)
    bpe.train_from_iterator(GEMMA4_CORPUS * 4, trainer)
    trained = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    tokens += [t for t, _ in trained if t not in tokens]
    types += [1] * (len(tokens) - len(types))
    while len(tokens) < size:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(5)
    merges = [" ".join(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens[:size],
        "tokenizer.ggml.scores": [-1000.0] * size,
        "tokenizer.ggml.token_type": types[:size],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": GEMMA4_TEMPLATE,
    }


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


# the families with a float32 GGUF copy too (as llama.cpp's converter writes it)
GGUF = {
    "kimi_linear": lambda src, out: gguf_kimi(src, out),
    "minimax": lambda src, out: gguf_minimax(src, out),
}
GGUF |= {"nemotron_h": lambda src, out: gguf_nemotron(src, out)}
GGUF |= {"nemotron_g1": lambda src, out: gguf_nemotron(src, out)}
GGUF |= {"glm5": lambda src, out: gguf_sparse(src, out)}
GGUF |= {"llama4": lambda src, out: gguf_llama4(src, out)}
GGUF |= {"step3p5": lambda src, out: gguf_step(src, out)}
GGUF |= {"gemma4": lambda src, out: gguf_gemma4(src, out)}
