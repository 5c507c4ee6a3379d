"""Gemma 4 and Gemma 3 as llama.cpp's converter writes their GGUF files (see
flagship_gguf.py)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from flagship_gguf_linear import KIMI_GGUF
from gguf_parts import gguf_finish, gguf_folder, gguf_tensor, gguf_vocabulary

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
    *KIMI_GGUF,
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
    gguf_vocabulary(w, vocab or llama_vocabulary(d.vocab_size))
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
        gguf_tensor(w, name, a, quantized if fits else None, stored)
    return gguf_finish(w, out)


def gguf_gemma3(src: Path, out: Path, quantized: int | None = None, stored: bool = True) -> Path:
    """mlx-lm's float32 Gemma 3 folder `src` as llama.cpp's converter writes its GGUF
    (`gemma3`): every norm + 1 (Gemma 3's norms scale by 1 + w), rope.freq_base (global)
    and freq_base_swa (sliding), the window, and the layer types as flags per layer
    (attention.sliding_window_pattern: llama.cpp reads them; the converter leaves it out,
    llama.cpp's default being every sixth layer global). Its queries are scaled by
    1/sqrt(head_dim) in llama.cpp: a folder whose query_pre_attn_scalar is another
    number has no such file. float32, or with `quantized` (a ggml type) every matrix
    whose rows take its blocks (`stored` False: the same values dequantized)."""

    import gguf
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
    gguf_vocabulary(w, llama_vocabulary(d.vocab_size))

    def plus_one(name: str, a):  # every norm + 1, as the converter writes Gemma 3's
        return a + 1.0 if name.endswith("norm.weight") else a

    gguf_folder(w, src, _GEMMA4_GGUF, quantized, stored, adjust=plus_one)
    return gguf_finish(w, out)


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
