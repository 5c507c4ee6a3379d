"""Random-weight Llama checkpoints of realistic sizes, for benchmarks.

    python -m llama_tp.benchmarks.synthetic 0.5b-fp16 --out DIR
    python -m llama_tp.benchmarks.synthetic 70b-q4 --shapes-only --out DIR   # for `plan`

writes a Hugging Face directory (config.json, model.safetensors, a word-level
tokenizer.json) that both `llama_tp.load` and `mlx_lm.load` open, so the two
run the same weights. `--shapes-only` writes the safetensors header of every tensor
and leaves the data a sparse file of zeros (no disk space, nothing computed): what
`python -m llama_tp.plan` needs to print how a model of that shape splits (the `70b`
size is Llama-3-70B's shape), never a model to run. Specs are `SIZE-DTYPE`: sizes in
`SIZES`, dtypes fp16, bf16, fp32 and q4 (MLX 4-bit, group 64, as mlx-community
folders, with float32 scales and norms). The `moe-*` sizes are Qwen3-MoE
models with the experts stacked as mlx-lm stores them (`moe-a3b` is Qwen3-30B-A3B's
shape scaled down: 128 -> 64 experts, 8 per token, 48 -> 8 layers, widths / 2). The
`deepseek-*` sizes are DeepSeek-V3 models (latent attention, grouped sigmoid routing, a
shared expert, a dense first layer) stored as mlx-lm's convert writes them (`embed_q` /
`unembed_out`, stacked experts); `deepseek-v3` is its shape scaled down (256 -> 64
experts in 8 groups, 8 per token, 61 -> 8 layers, 128 -> 16 heads, widths / 4 to / 7).
The `gpt-oss-*` sizes are gpt-oss models as mlx-lm stores them (attention sinks and
biases, layers alternating a sliding window of 128 and full attention, biased experts
behind the clamped SwiGLU); `gpt-oss` is gpt-oss-120b's shape scaled down (128 -> 32
experts, 4 per token, 36 -> 8 layers, 64 / 8 -> 16 / 2 heads of 64, widths 2880 -> 768).
The `mxfp4` dtype stores the stacked experts in MLX's `mxfp4` mode (as the gpt-oss
releases) and the rest in float32.
The `glm-*` sizes are GLM-4.5 models (half of each head rotated, q/k norms, q/k/v biases,
DeepSeek-V3's routing and shared expert, a dense first layer); `glm4-moe` is GLM-4.5's
shape scaled down (160 -> 64 experts, 8 per token, 92 -> 8 layers, 96/8 -> 24/2 heads of
128 -> 64, widths / 4 to / 5).
`synthetic_dir(spec)` writes one into the cache once and reuses it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

# hidden, layers, query heads, KV heads, FFN, vocabulary
SIZES = {
    "0.5b": dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=5632, vocab=32000),
    "0.1b": dict(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, hidden_dim=2816, vocab=32000),
    "tiny": dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=96, vocab=512),
    "1b": dict(dim=2048, n_layers=18, n_heads=16, n_kv_heads=8, hidden_dim=5632, vocab=32000),
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
    size, _, dtype = spec.rpartition("-")
    if size not in SIZES or dtype not in DTYPES:
        raise ValueError(
            f"synthetic model {spec!r}: expected SIZE-DTYPE with SIZE in {', '.join(SIZES)} "
            f"and DTYPE in {', '.join(DTYPES)}"
        )
    return SIZES[size], DTYPES[dtype]


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


def hf_config(s: dict, dtype_name: str) -> dict:
    moe = {}
    if "window" in s:
        moe = _gpt_oss_config(s)
    elif "latent" in s:
        moe = _deepseek_config(s)
    elif "glm" in s:
        moe = _glm_config(s)
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


def _tensors(s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Every Hugging Face-named tensor: (name, shape, init: "normal" random, "ones" a norm,
    "zeros" a float32 routing bias), in the order the random ones are drawn."""
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


def _weights(s: dict, dtype: mx.Dtype, seed: int) -> dict[str, mx.array]:
    """Hugging Face-named random weights, scaled so that activations stay O(1)."""
    key = mx.random.key(seed)
    out: dict[str, mx.array] = {}
    for name, shape, init in _tensors(s):
        if init == "normal":
            key, sub = mx.random.split(key)
            out[name] = (mx.random.normal(shape, key=sub) * shape[-1] ** -0.5).astype(dtype)
        elif init == "zeros":  # DeepSeek's routing bias: float32, as mlx-lm keeps it
            out[name] = mx.zeros(shape, mx.float32)
        elif init == "small":  # gpt-oss's biases and sinks
            key, sub = mx.random.split(key)
            out[name] = (mx.random.normal(shape, key=sub) * 0.1).astype(dtype)
        else:
            out[name] = mx.ones(shape, dtype)
    return out


_SAFETENSORS = {mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32", mx.uint32: "U32"}


def _stored(
    s: dict, dtype: mx.Dtype, q4: bool, mxfp4: bool = False
) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """Every stored tensor's (shape, dtype), as `_weights` (and `_quantized`, `_mxfp4`)
    make them."""
    out = {}
    tensors = _tensors(s)
    routers = {n.removesuffix(".e_score_correction_bias") for n, _, i in tensors if i == "zeros"}
    for name, shape, init in tensors:
        router = name.removesuffix(".weight") in routers  # DeepSeek's gate: float, as _quantized
        if init == "zeros":
            out[name] = (shape, mx.float32)
        elif mxfp4 and _expert_weight(name, shape):
            out[name] = ((*shape[:-1], shape[-1] // 8), mx.uint32)
            out[name.removesuffix(".weight") + ".scales"] = (
                (*shape[:-1], shape[-1] // 32),
                mx.uint8,
            )
        elif q4 and len(shape) >= 2 and shape[-1] % Q4_GROUP == 0 and not router:
            base = name.removesuffix(".weight")
            out[name] = ((*shape[:-1], shape[-1] // 8), mx.uint32)  # 8 4-bit values per uint32
            for k in ("scales", "biases"):
                out[f"{base}.{k}"] = ((*shape[:-1], shape[-1] // Q4_GROUP), dtype)
        else:
            out[name] = (shape, dtype)
    return out


def _write_shapes_only(tensors: dict[str, tuple[tuple[int, ...], mx.Dtype]], path: Path) -> None:
    """A safetensors file of `tensors` whose data is a hole: the header, then the file
    extended to its full size (zeros; sparse where the file system allows it)."""
    from ..checkpoints.stream import header

    start, nbytes = header([(name, *tensors[name]) for name in sorted(tensors)])
    with open(path, "wb") as f:
        f.write(start)
        f.truncate(len(start) + nbytes)


Q4_GROUP = 64


def _quantized(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """MLX affine 4-bit (group 64) of every projection, expert and embedding table whose
    width is a multiple of the group, as mlx-lm's convert does; norms stay as they are."""
    out = {}
    for name, v in weights.items():
        router = f"{name.removesuffix('.weight')}.e_score_correction_bias" in weights
        if v.ndim >= 2 and v.shape[-1] % Q4_GROUP == 0 and not router:  # DeepSeek's: float
            base = name.removesuffix(".weight")
            out[name], out[f"{base}.scales"], out[f"{base}.biases"] = mx.quantize(v, Q4_GROUP, 4)
        else:
            out[name] = v
    return out


def _expert_weight(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 3 and name.endswith(".weight") and shape[-1] % 32 == 0


def _mxfp4(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The stacked experts in MLX's mxfp4 mode (4-bit values, one uint8 exponent per 32
    values, no biases), as the gpt-oss releases store them; the rest as it is."""
    out = {}
    for name, v in weights.items():
        if _expert_weight(name, v.shape):
            base = name.removesuffix(".weight")
            out[name], out[f"{base}.scales"] = mx.quantize(v, 32, 4, mode="mxfp4")
        else:
            out[name] = v
    return out


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer (`<unk> <s> </s> w3 w4 ...`): benchmarks feed token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_synthetic(
    spec: str, out: str | os.PathLike, seed: int = 0, shapes_only: bool = False
) -> Path:
    """Write the synthetic checkpoint `spec` (e.g. `0.5b-fp16`) into directory `out`;
    `shapes_only`: every tensor's shape, its data left zeros (see the module docstring)."""
    s, dtype = parse_spec(spec)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if shapes_only:
        stored = _stored(s, dtype, spec.endswith("-q4"), spec.endswith("-mxfp4"))
        _write_shapes_only(stored, out / "model.safetensors")
    else:
        weights = _weights(s, dtype, seed)
        if spec.endswith("-q4"):
            weights = _quantized(weights)
        if spec.endswith("-mxfp4"):
            weights = _mxfp4(weights)
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
    config = hf_config(s, spec.rpartition("-")[2])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(out, s["vocab"])
    return out


# The version of what write_synthetic stores (the scales' dtype, tensor names): part of a
# weights folder's name, so that one written by an older version is never reused (q4
# scales were float16 before version 2). Shapes-only folders hold no values.
FORMAT = 2


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llama_tp" / "synthetic"


def synthetic_dir(spec: str, seed: int = 0, shapes_only: bool = False) -> Path:
    """The cached directory of `spec` (`shapes_only`: its shapes, for `plan`), written
    first if missing.

    Written into a temporary directory and renamed, so that ranks racing to
    write it (each writes the same bytes) never see a half-written one.
    """
    parse_spec(spec)
    name = f"{spec}-shapes" if shapes_only else f"{spec}-seed{seed}-v{FORMAT}"
    path = cache_root() / name
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec}-", dir=path.parent))
    try:
        write_synthetic(spec, tmp, seed, shapes_only)
        os.rename(tmp, path)
    except OSError:
        if not (path / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main() -> int:
    from ..console.cli import ArgumentParser

    p = ArgumentParser(prog="python -m llama_tp.synthetic", description=__doc__.splitlines()[0])
    p.add_argument("spec", help=f"SIZE-DTYPE, SIZE in {', '.join(SIZES)}; e.g. 0.5b-fp16")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shapes-only",
        action="store_true",
        help="write the tensors' shapes, their data a sparse file of zeros: for `plan`",
    )
    args = p.parse_args()
    path = write_synthetic(args.spec, args.out, args.seed, args.shapes_only)
    print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    from ..console.cli import run

    run(main)
