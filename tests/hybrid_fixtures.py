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
    linear_key_head_dim=32,
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


# -- GGUF, as llama.cpp's converter writes these families (convert_hf_to_gguf.py) --------

GGUF_ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
_NAMES = [
    (r"^model\.embed_tokens\.", "token_embd."),
    (r"^model\.norm\.", "output_norm."),
    (r"^lm_head\.", "output."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".post_attention_norm."),
    (r"\.self_attn\.q_proj\.", ".attn_q."),
    (r"\.self_attn\.k_proj\.", ".attn_k."),
    (r"\.self_attn\.v_proj\.", ".attn_v."),
    (r"\.self_attn\.o_proj\.", ".attn_output."),
    (r"\.self_attn\.q_norm\.", ".attn_q_norm."),
    (r"\.self_attn\.k_norm\.", ".attn_k_norm."),
    (r"\.mlp\.gate_proj\.", ".ffn_gate."),
    (r"\.mlp\.up_proj\.", ".ffn_up."),
    (r"\.mlp\.down_proj\.", ".ffn_down."),
    (r"\.mlp\.gate\.", ".ffn_gate_inp."),
    (r"\.mlp\.switch_mlp\.(gate|up|down)_proj\.", r".ffn_\1_exps."),
    (r"\.mlp\.shared_expert\.(gate|up|down)_proj\.", r".ffn_\1_shexp."),
    (r"\.mlp\.shared_expert_gate\.", ".ffn_gate_inp_shexp."),
    (r"\.linear_attn\.in_proj_qkv\.", ".attn_qkv."),
    (r"\.linear_attn\.in_proj_z\.", ".attn_gate."),
    (r"\.linear_attn\.in_proj_b\.", ".ssm_beta."),
    (r"\.linear_attn\.in_proj_a\.", ".ssm_alpha."),
    (r"\.linear_attn\.in_proj_ba\.", ".ssm_ba."),
    (r"\.linear_attn\.conv1d\.", ".ssm_conv1d."),
    (r"\.linear_attn\.dt_bias$", ".ssm_dt.bias"),
    (r"\.linear_attn\.A_log$", ".ssm_a"),
    (r"\.linear_attn\.norm\.", ".ssm_norm."),
    (r"\.linear_attn\.out_proj\.", ".ssm_out."),
    (r"^model\.layers\.(\d+)\.", r"blk.\1."),
]


def _tiled(a: np.ndarray, axis: int, nk: int, r: int) -> np.ndarray:
    """Value heads grouped by key head -> tiled (llama.cpp's `_reorder_v_heads`)."""
    shape = list(a.shape)
    a = a.reshape(*shape[:axis], nk, r, -1, *shape[axis + 1 :])
    return np.swapaxes(a, axis, axis + 1).reshape(shape)


def gguf_hybrid(src: Path, out: Path, quantized: dict[str, int] | None = None) -> Path:
    """mlx-lm's float32 folder `src` as llama.cpp's converter writes its GGUF: the norms as
    they are (the converter adds the 1 a release leaves out, mlx-lm's folder holds it),
    A_log as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the conv (C, K); Qwen3-Next's
    in_proj_qkvz split into attn_qkv (q | k | v of all heads) and attn_gate; Qwen3.5's value
    heads tiled when there are more than key heads; one multi-token prediction layer
    after the last (never used). Float32 but for `quantized` (name pattern, `blk.*.` for
    every layer -> ggml type, quantized by gguf-py)."""
    import re

    import gguf

    config = json.loads((src / "config.json").read_text())
    family = config["model_type"]
    text = config.get("text_config", config)
    arch = GGUF_ARCH[family]
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv, r = text["linear_key_head_dim"], text["linear_value_head_dim"], nv // nk
    tiled = arch != "qwen3next" and r > 1
    n_layers, dim = text["num_hidden_layers"], text["hidden_size"]
    heads, hd = text["num_attention_heads"], text["head_dim"]
    rope = text.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(out), arch)
    ints = {
        "block_count": n_layers + 1,
        "nextn_predict_layers": 1,
        "context_length": text["max_position_embeddings"],
        "embedding_length": dim,
        "feed_forward_length": text["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": text["num_key_value_heads"],
        "attention.key_length": hd,
        "attention.value_length": hd,
        "rope.dimension_count": int(
            hd * text.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
        ),
        "ssm.conv_kernel": text["linear_conv_kernel_dim"],
        "ssm.state_size": dk,
        "ssm.group_count": nk,
        "ssm.time_step_rank": nv,
        "ssm.inner_size": nv * dv,
        "full_attention_interval": text["full_attention_interval"],
        "expert_count": text.get("num_experts", 0),
        "expert_used_count": text.get("num_experts_per_tok", 0),
        "expert_feed_forward_length": text.get("moe_intermediate_size", 0),
        "expert_shared_feed_forward_length": text.get("shared_expert_intermediate_size", 0),
    }
    for key, value in ints.items():
        if value:
            w.add_uint32(f"{arch}.{key}", value)
    if arch != "qwen3next":
        w.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", text["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", float(text.get("rope_theta", rope.get("rope_theta"))))
    from gguf_writer import llama_vocabulary

    vocab = llama_vocabulary(text["vocab_size"])
    w.add_string("tokenizer.ggml.model", "llama")
    for key in ("tokens", "scores", "token_type"):
        w.add_array(f"tokenizer.ggml.{key}", vocab[f"tokenizer.ggml.{key}"])
    for key in ("bos", "eos", "unknown"):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab[f"tokenizer.ggml.{key}_token_id"])
    tensors: dict[str, np.ndarray] = {}
    for name, v in mx.load(str(src / "model.safetensors")).items():
        a = np.array(v.astype(mx.float32))
        name = name.replace("language_model.model.", "model.").replace("language_model.", "")
        if name.endswith("in_proj_qkvz.weight"):  # per key head q, k, v, z -> sections
            per = a.T.reshape(dim, nk, -1)
            q, k = per[..., :dk], per[..., dk : 2 * dk]
            v, z = per[..., 2 * dk : 2 * dk + r * dv], per[..., 2 * dk + r * dv :]
            qkv = np.concatenate([x.reshape(dim, -1) for x in (q, k, v)], -1).T
            base = name.removesuffix("in_proj_qkvz.weight")
            pairs = [
                (base + "in_proj_qkv.weight", qkv),
                (base + "in_proj_z.weight", z.reshape(dim, -1).T),
            ]
        else:
            pairs = [(name, a)]
        for name, a in pairs:
            if name.endswith("A_log"):
                a = -np.exp(a)
            if "conv1d" in name:
                a = a[..., 0]
            if tiled and ".linear_attn." in name:
                if "in_proj_qkv" in name or "conv1d" in name:
                    a = np.concatenate([a[: 2 * nk * dk], _tiled(a[2 * nk * dk :], 0, nk, r)])
                elif "out_proj" in name:
                    a = _tiled(a, 1, nk, r)
                elif any(
                    s in name for s in ("in_proj_z", "in_proj_b", "in_proj_a", "A_log", "dt_bias")
                ):
                    a = _tiled(a, 0, nk, r)
            if name.endswith("shared_expert_gate.weight"):
                a = a.reshape(-1)
            for pattern, repl in _NAMES:
                name = re.sub(pattern, repl, name)
            tensors[name] = np.ascontiguousarray(a)
    rng = np.random.default_rng(7)
    for part, shape in (("nextn.eh_proj.weight", (dim, 2 * dim)), ("nextn.enorm.weight", (dim,)),
                        ("attn_norm.weight", (dim,))):  # fmt: skip
        tensors[f"blk.{n_layers}.{part}"] = rng.normal(0, 1, shape).astype(np.float32)
    quantized = quantized or {}
    for name, a in tensors.items():
        kind = quantized.get(name, quantized.get(re.sub(r"^blk\.\d+\.", "blk.*.", name)))
        if kind is None:
            w.add_tensor(name, a.astype(np.float32))
        else:
            qtype = gguf.GGMLQuantizationType(kind)
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
