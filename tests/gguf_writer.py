"""A minimal GGUF writer for tests: tiny Llama files with chosen tensor types.

Only what the tests need: scalar/string metadata and F32 or raw-block tensors.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

F32, F16 = 0, 1  # ggml type ids
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL = 20
NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K"}
NAMES.update({12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 0: "F32", 1: "F16"})
# type -> (values per block, bytes per block, {offset of a float16 field: its typical size})
# The float16 scales are set so that weights come out about 0.1 at most.
BLOCKS = {
    Q4_0: (32, 18, {0: 0.1 / 8}),
    Q4_1: (32, 20, {0: 0.1 / 15, 2: -0.05}),
    Q5_0: (32, 22, {0: 0.1 / 16}),
    Q5_1: (32, 24, {0: 0.1 / 31, 2: -0.05}),
    Q8_0: (32, 34, {0: 0.1 / 127}),
    Q2_K: (256, 84, {80: 0.1 / 45, 82: 0.05 / 15}),
    Q3_K: (256, 110, {108: 0.1 / 128}),
    Q4_K: (256, 144, {0: 0.1 / 945, 2: 0.05 / 63}),
    Q5_K: (256, 176, {0: 0.1 / 1953, 2: 0.05 / 63}),
    Q6_K: (256, 210, {208: 0.1 / 4096}),
    IQ4_NL: (32, 18, {0: 0.01}),
}


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(v) -> bytes:
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, list):  # arrays of strings, float32 or int32
        if all(isinstance(x, str) for x in v):
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(map(_string, v))
        if any(isinstance(x, float) for x in v):
            return struct.pack("<IIQ", 9, 6, len(v)) + np.asarray(v, "<f4").tobytes()
        return struct.pack("<IIQ", 9, 5, len(v)) + np.asarray(v, "<i4").tobytes()
    return struct.pack("<II", 4, v)  # uint32


def llama_vocabulary(size: int) -> dict:
    """Tokenizer metadata of a made-up sentencepiece ("llama") vocabulary of `size` tokens:
    <unk>, <s>, </s>, the 256 byte tokens, then pieces `▁t3`, `▁t4`, ..."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581t{i}" for i in range(len(tokens), size)]
    types = [2, 3, 3] + [6] * 256 + [1] * (size - 259)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-float(i) for i in range(size)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def write_gguf(path: Path, metadata: dict, tensors: dict[str, tuple[int, tuple, bytes]]) -> None:
    """tensors: name -> (ggml type, shape in ggml order (fastest first), raw bytes, or a
    function returning them: called once, as the file is written, for large files)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _string(key) + _value(value)
    offset, sizes = 0, []
    for name, (kind, shape, _) in tensors.items():
        out += _string(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in shape)
        out += struct.pack("<IQ", kind, offset)
        per, size = (1, 2 if kind == F16 else 4) if kind in (F32, F16) else BLOCKS[kind][:2]
        nbytes = int(np.prod(shape)) // per * size
        sizes.append(nbytes)
        offset += nbytes + (-nbytes) % 32
    out += b"\0" * ((-len(out)) % 32)
    with open(path, "wb") as f:
        f.write(out)
        for (name, (_, _, data)), nbytes in zip(tensors.items(), sizes, strict=True):
            data = data() if callable(data) else data
            if len(data) != nbytes:
                raise ValueError(f"{name}: {len(data)} bytes given, {nbytes} expected")
            f.write(data + b"\0" * ((-len(data)) % 32))


def random_blocks(kind: int, rows: int, cols: int, rng: np.random.Generator) -> bytes:
    """Random but well-formed blocks of a quantized type: random bits, and float16
    scales (and minimums) between 0.5 and 1 times the type's typical size."""
    per, size, fields = BLOCKS[kind]
    n = rows * cols // per
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at, typical in fields.items():
        values = (typical * rng.uniform(0.5, 1.0, n)).astype(np.float16)
        blocks[:, at : at + 2] = values.view(np.uint8).reshape(n, 2)
    return blocks.tobytes()


def tiny_llama_gguf(
    path: Path,
    quantized: dict[str, int] | None = None,
    seed: int = 0,
    dim: int = 64,
    hidden: int = 256,
    vocab: int = 64,
    heads: int = 4,
    kv_heads: int | None = None,
    layers: int = 1,
    metadata: dict | None = None,
) -> Path:
    """A small Llama in GGUF (default: 1 layer, dim 64, 4 heads, vocab 64), F32 but for
    `quantized` tensors (GGUF name -> type; `blk.*.` names apply to every layer)."""
    rng = np.random.default_rng(seed)
    quantized = quantized or {}
    kv_heads = kv_heads or heads
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": dim,
        "llama.block_count": layers,
        "llama.feed_forward_length": hidden,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 128,
        **(metadata or {}),
    }
    kv = dim // heads * kv_heads
    layer = {
        "attn_norm.weight": (dim,),
        "ffn_norm.weight": (dim,),
        "attn_q.weight": (dim, dim),
        "attn_k.weight": (kv, dim),
        "attn_v.weight": (kv, dim),
        "attn_output.weight": (dim, dim),
        "ffn_gate.weight": (hidden, dim),
        "ffn_up.weight": (hidden, dim),
        "ffn_down.weight": (dim, hidden),
    }
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,)}
    shapes["output.weight"] = (vocab, dim)
    for i in range(layers):
        shapes.update({f"blk.{i}.{k}": v for k, v in layer.items()})
    tensors = {}
    for name, shape in shapes.items():
        ggml_shape = tuple(reversed(shape))
        generic = re.sub(r"^blk\.\d+\.", "blk.*.", name)
        kind = quantized.get(name, quantized.get(generic))
        if kind == F16:
            values = rng.normal(0, shape[-1] ** -0.5, shape).astype(np.float16)
            tensors[name] = (F16, ggml_shape, values.tobytes())
        elif kind is not None:
            tensors[name] = (kind, ggml_shape, random_blocks(kind, shape[0], shape[-1], rng))
        else:
            values = rng.normal(0, shape[-1] ** -0.5, shape).astype(np.float32)
            if name.endswith("norm.weight"):
                values = np.ones(shape, np.float32)
            tensors[name] = (F32, ggml_shape, values.tobytes())
    write_gguf(path, meta, tensors)
    return path


# --- any supported family, from a Hugging Face fixture, with the gguf package ------------

GGUF_ARCH = {
    "llama": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "deepseek_v3": "deepseek2",
    "glm4_moe": "glm4moe",
}
_HF_TO_GGUF = [
    # DeepSeek-V3's latent attention and routing bias, shared experts (llama.cpp's names)
    (r"^model\.layers\.(\d+)\.self_attn\.q_a_proj\.", r"blk.\1.attn_q_a."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_a_layernorm\.", r"blk.\1.attn_q_a_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_b_proj\.", r"blk.\1.attn_q_b."),
    (r"^model\.layers\.(\d+)\.self_attn\.kv_a_proj_with_mqa\.", r"blk.\1.attn_kv_a_mqa."),
    (r"^model\.layers\.(\d+)\.self_attn\.kv_a_layernorm\.", r"blk.\1.attn_kv_a_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.kv_b_proj\.", r"blk.\1.attn_kv_b."),
    (r"^model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$", r"blk.\1.exp_probs_b.bias"),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.", r"blk.\1.ffn_gate_shexp."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.up_proj\.", r"blk.\1.ffn_up_shexp."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_experts\.down_proj\.", r"blk.\1.ffn_down_shexp."),
    (r"^model\.embed_tokens\.", "token_embd."),
    (r"^model\.norm\.", "output_norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_proj\.", r"blk.\1.attn_q."),
    (r"^model\.layers\.(\d+)\.self_attn\.k_proj\.", r"blk.\1.attn_k."),
    (r"^model\.layers\.(\d+)\.self_attn\.v_proj\.", r"blk.\1.attn_v."),
    (r"^model\.layers\.(\d+)\.self_attn\.o_proj\.", r"blk.\1.attn_output."),
    (r"^model\.layers\.(\d+)\.self_attn\.q_norm\.", r"blk.\1.attn_q_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.k_norm\.", r"blk.\1.attn_k_norm."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"blk.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"blk.\1.ffn_norm."),
    (r"^model\.layers\.(\d+)\.mlp\.gate_proj\.", r"blk.\1.ffn_gate."),
    (r"^model\.layers\.(\d+)\.mlp\.up_proj\.", r"blk.\1.ffn_up."),
    (r"^model\.layers\.(\d+)\.mlp\.down_proj\.", r"blk.\1.ffn_down."),
    (r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.", r"blk.\1.ffn_gate_inp."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert\.gate_proj\.", r"blk.\1.ffn_gate_shexp."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert\.up_proj\.", r"blk.\1.ffn_up_shexp."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert\.down_proj\.", r"blk.\1.ffn_down_shexp."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert_gate\.", r"blk.\1.ffn_gate_inp_shexp."),
]
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)
_EXPERT_GGUF = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}
_EXPERT_GGUF |= {"down_proj": "down", "w2": "down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: q/k rows reordered for interleaved (GGUF llama) RoPE."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _routed_meta(config: dict, arch: str, split_kv_b: bool) -> dict:
    """The `{arch}.*` keys llama.cpp's converter writes for deepseek2 / glm4moe beyond the
    common ones (integers; the floats and flags are written by `gguf_from_hf`)."""
    meta = {
        "expert_count": config["n_routed_experts"],
        "expert_used_count": config["num_experts_per_tok"],
        "expert_feed_forward_length": config["moe_intermediate_size"],
        "expert_shared_count": config["n_shared_experts"] or 0,
        "leading_dense_block_count": config["first_k_dense_replace"],
        "expert_gating_func": 2,  # sigmoid
        "expert_group_count": config["n_group"],
        "expert_group_used_count": config["topk_group"],
    }
    if arch == "glm4moe":
        head_dim = config["head_dim"]
        rope = int(head_dim * config["partial_rotary_factor"])
        return meta | {"rope.dimension_count": rope, "nextn_predict_layers": 1}
    rank, rope = config["kv_lora_rank"], config["qk_rope_head_dim"]
    key, value = config["qk_nope_head_dim"] + rope, config["v_head_dim"]
    meta |= {"rope.dimension_count": rope, "attention.kv_lora_rank": rank}
    meta["attention.q_lora_rank"] = config["q_lora_rank"] or 0
    if split_kv_b:  # the newer conversion: MQA over the latent, per-head sizes apart
        return meta | {
            "attention.head_count_kv": 1,
            "attention.key_length": rank + rope,
            "attention.value_length": rank,
            "attention.key_length_mla": key,
            "attention.value_length_mla": value,
        }
    return meta | {"attention.key_length": key, "attention.value_length": value}


def _split_kv_b(tensors: dict[str, np.ndarray], config: dict) -> None:
    """llama.cpp's newer deepseek2 conversion: attn_kv_b as attn_k_b (H, rank, nope), the
    key rows transposed, and attn_v_b (H, v, rank)."""
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    for name in [k for k in tensors if k.endswith("attn_kv_b.weight")]:
        kv_b = tensors.pop(name).reshape(heads, nope + config["v_head_dim"], -1)
        tensors[name.replace("kv_b", "k_b")] = np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2))
        tensors[name.replace("kv_b", "v_b")] = np.ascontiguousarray(kv_b[:, nope:])


def _nextn_layer(tensors: dict[str, np.ndarray], n: int, dim: int) -> None:
    """A multi-token prediction layer `n` as GLM-4.5's conversions carry (never used)."""
    rng = np.random.default_rng(n)
    for name, shape in (
        ("attn_norm.weight", (dim,)),
        ("nextn.eh_proj.weight", (dim, 2 * dim)),
        ("nextn.enorm.weight", (dim,)),
        ("nextn.hnorm.weight", (dim,)),
        ("nextn.shared_head_norm.weight", (dim,)),
    ):
        tensors[f"blk.{n}.{name}"] = rng.normal(0, 1, shape).astype(np.float32)


def gguf_from_hf(
    hf_dir: Path,
    out: Path,
    quantized: dict[str, int] | None = None,
    split_kv_b: bool = True,
    **overrides: int,
) -> Path:
    """The Hugging Face fixture `hf_dir` (float32, per-expert tensors) as a GGUF file of its
    family, written with the gguf package: float32 tensors but for `quantized` (GGUF name
    pattern, `blk.*.` for every layer -> type id, quantized by gguf-py), the experts
    stacked as llama.cpp stores them, q/k permuted for the llama architecture.
    DeepSeek-V3 (deepseek2) and GLM-4.5 (glm4moe) as llama.cpp's converter writes them:
    deepseek2's attn_kv_b split into attn_k_b / attn_v_b (the newer conversion) unless
    not `split_kv_b`; glm4moe with a multi-token prediction layer after the last.
    `overrides`: `{arch}.*` integers to write instead (e.g. expert_count=8)."""
    import json

    import gguf
    import mlx.core as mx

    config = json.loads((hf_dir / "config.json").read_text())
    mtype = config["model_type"]
    arch = GGUF_ARCH[mtype]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    meta = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "expert_count": config.get("num_experts", config.get("num_local_experts", 0)),
        "expert_used_count": config.get("num_experts_per_tok", 0),
        "expert_feed_forward_length": config.get("moe_intermediate_size", 0),
        "expert_shared_feed_forward_length": config.get("shared_expert_intermediate_size", 0),
    }
    routed = arch in ("deepseek2", "glm4moe")
    if routed:
        meta |= _routed_meta(config, arch, split_kv_b)
        meta["block_count"] += meta.get("nextn_predict_layers", 0)
    meta |= overrides
    for key, value in meta.items():
        if value:
            w.add_uint32(f"{arch}.{key}", value)
    if routed:
        w.add_float32(f"{arch}.expert_weights_scale", config["routed_scaling_factor"])
        w.add_bool(f"{arch}.expert_weights_norm", config["norm_topk_prob"])
        w.add_uint32(f"{arch}.vocab_size", config["vocab_size"])
    if (config.get("rope_scaling") or {}).get("type") == "yarn":
        yarn = config["rope_scaling"]
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", yarn["factor"])
        orig = yarn["original_max_position_embeddings"]
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", orig)
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1 * yarn["mscale_all_dim"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", config["rope_theta"])
    vocab = llama_vocabulary(config["vocab_size"])
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", vocab["tokenizer.ggml.tokens"])
    w.add_array("tokenizer.ggml.scores", vocab["tokenizer.ggml.scores"])
    w.add_array("tokenizer.ggml.token_type", vocab["tokenizer.ggml.token_type"])
    for key in ("bos", "eos", "unknown"):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab[f"tokenizer.ggml.{key}_token_id"])
    tensors: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, v in mx.load(str(hf_dir / "model.safetensors")).items():
        a = np.array(v.astype(mx.float32))
        if m := _EXPERT.match(name):
            layer, e, proj = m.groups()
            experts.setdefault((layer, _EXPERT_GGUF[proj]), {})[int(e)] = a
            continue
        new = name
        for pat, repl in _HF_TO_GGUF:
            new, hit = re.subn(pat, repl, name)
            if hit:
                break
        if arch == "llama" and new.endswith(("attn_q.weight", "attn_k.weight")):
            a = _permute(a, heads if "attn_q" in new else kv)
        if new.endswith("ffn_gate_inp_shexp.weight"):
            a = a.reshape(-1)  # llama.cpp's (n_embd,) vector
        if arch == "glm4moe":  # its feed-forward norm, by llama.cpp's tensor map
            new = new.replace(".ffn_norm.", ".post_attention_norm.")
        tensors[new] = a
    for (layer, proj), by_expert in experts.items():
        tensors[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack(
            [by_expert[e] for e in range(len(by_expert))]
        )
    if arch == "deepseek2" and split_kv_b:
        _split_kv_b(tensors, config)
    if arch == "glm4moe":
        _nextn_layer(tensors, config["num_hidden_layers"], config["hidden_size"])
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
