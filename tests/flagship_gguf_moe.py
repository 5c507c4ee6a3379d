"""MiniMax-M2, GLM-5 / DeepSeek-V3.2, Llama 4 and Step-3.5 (attention beside experts) as
llama.cpp's converter writes their GGUF files (see flagship_gguf.py)."""

from __future__ import annotations

import json
from pathlib import Path

from flagship_gguf_linear import KIMI_GGUF
from gguf_parts import gguf_finish, gguf_folder, gguf_vocabulary

# -- MiniMax-M2 as llama.cpp's converter writes it (conversion/minimax.py's MiniMaxM2Model)
_MINIMAX_GGUF = [
    (r"\.self_attn\.([qk])_norm\.", r".attn_\1_norm."),
    (r"\.block_sparse_moe\.", ".mlp."),
    *KIMI_GGUF,
]


def gguf_minimax(src: Path, out: Path, quantized: int | None = None, stored: bool = True) -> Path:
    """mlx-lm's float32 MiniMax-M2 folder `src` as llama.cpp's converter writes its GGUF
    (`minimax-m2`): q/k/v as the folder's (NEOX RoPE: no permutation), attn_q_norm /
    attn_k_norm one vector of all heads' values each, the experts stacked, the routing
    bias as exp_probs_b.bias; rope.dimension_count = rotary_dim, expert_gating_func 2
    (sigmoid). float32, or with `quantized` (a ggml type) every matrix whose rows take its
    blocks (`stored` False: the same values dequantized, as float32)."""

    import gguf
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
    gguf_vocabulary(w, vocab)
    gguf_folder(w, src, _MINIMAX_GGUF, quantized, stored)
    return gguf_finish(w, out)


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
    *KIMI_GGUF,
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

    import gguf
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
    gguf_vocabulary(w, llama_vocabulary(c["vocab_size"]))
    gguf_folder(w, src, _SPARSE_GGUF, quantized, stored, kept_float=("ffn_gate_inp",))
    return gguf_finish(w, out)


# -- Llama 4 as llama.cpp's converter writes it (conversion/llama.py's Llama4Model)
_LLAMA4_GGUF = [
    (r"^language_model\.", ""),
    (r"\.feed_forward\.router\.", ".ffn_gate_inp."),
    (r"\.feed_forward\.experts\.(gate|up|down)_proj\.", r".ffn_\1_exps."),
    (r"\.feed_forward\.shared_expert\.(gate|up|down)_proj\.", r".ffn_\1_shexp."),
    (r"\.feed_forward\.", ".mlp."),
    *KIMI_GGUF,
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
    gguf_vocabulary(w, llama_vocabulary(c["vocab_size"]))
    scaling = factors(c["rope_theta"], c["head_dim"], c["rope_scaling"])
    w.add_tensor("rope_freqs.weight", scaling.astype(np.float32))
    gguf_folder(w, src, _LLAMA4_GGUF, quantized, stored)
    return gguf_finish(w, out)


# -- Step-3.5 as llama.cpp's converter writes it (conversion/step3.py's Step35Model)
_STEP_GGUF = [
    (r"\.self_attn\.g_proj\.", ".attn_gate."),
    (r"\.self_attn\.([qk])_norm\.", r".attn_\1_norm."),
    (r"\.mlp\.gate\.gate\.", ".ffn_gate_inp."),
    (r"\.mlp\.gate\.router_bias$", ".exp_probs_b.bias"),
    (r"\.mlp\.share_expert\.(gate|up|down)_proj\.", r".ffn_\1_shexp."),
    *KIMI_GGUF,
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

    import gguf
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
    gguf_vocabulary(w, llama_vocabulary(c["vocab_size"]))
    gguf_folder(w, src, _STEP_GGUF, quantized, stored, kept_float=("ffn_gate_inp",))
    return gguf_finish(w, out)
