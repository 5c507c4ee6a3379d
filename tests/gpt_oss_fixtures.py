"""Tiny random gpt-oss checkpoints: float32, MXFP4 experts as mlx-lm quantizes them, the
Hugging Face release's layout, and a GGUF `gpt-oss` file as llama.cpp's converter writes it.

mlx-lm's own gpt_oss model (its names: `mlp.experts.{gate,up,down}_proj` stacked with
biases, `mlp.router`, `self_attn.sinks`) with every parameter random, sinks and biases
included, saved by mlx-lm. Dimensions split unevenly: 10 query / 5 KV heads of 16
(3/2 KV heads on 2 ranks, 2/2/1 on 3, 2/1/1/1 on 4), 5 experts of 160 columns (5 groups
of 32: 3/2, 2/2/1, 2/1/1/1), top-2; 4 layers alternating a sliding window of 4 and
full attention; YaRN RoPE as gpt-oss's config has it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from fixtures import train_sentencepiece

GPT_OSS = dict(
    model_type="gpt_oss",
    architectures=["GptOssForCausalLM"],
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=10,
    num_key_value_heads=5,
    head_dim=16,
    intermediate_size=160,
    num_local_experts=5,
    num_experts_per_tok=2,
    vocab_size=389,
    rms_norm_eps=1e-5,
    rope_theta=150000,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
    },
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    swiglu_limit=7.0,
    attention_bias=True,
    tie_word_embeddings=False,
    max_position_embeddings=131072,
    eos_token_id=2,
    bos_token_id=1,
)


def write_gpt_oss(path: Path, seed: int = 0, **changes) -> Path:
    """A float32 gpt-oss folder (mlx-lm's names), every parameter random."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models.gpt_oss import Model, ModelArgs

    config = {**GPT_OSS, **changes}
    model = Model(ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = []
    for name, v in tree_flatten(model.parameters()):
        scale = 0.5 if name.endswith(("sinks", "bias")) else v.shape[-1] ** -0.5
        w = mx.random.normal(v.shape) * scale
        if "norm" in name:
            w = 1.0 + 0.1 * w
        params.append((name, w.astype(mx.float32)))
    model.update(tree_unflatten(params))
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"}
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    train_sentencepiece(path, config["vocab_size"])
    return path


def mxfp4(src: Path, out: Path) -> Path:
    """`src` quantized as the MXFP4 gpt-oss releases are: the experts in MLX's `mxfp4`
    mode (4-bit values, one uint8 exponent per 32), the router at 8 bits in groups of 64
    (mlx-lm's gpt_oss predicate), everything else 8-bit affine in groups of 32."""
    import shutil

    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(src)

    def predicate(path: str, module) -> bool | dict:
        if ".experts." in path:
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        return model.quant_predicate(path, module)

    model, config = quantize_model(model, config, 32, 8, quant_predicate=predicate)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def gpt_oss_models(root: Path) -> dict[str, Path]:
    """{"gpt_oss": float32 folder, "gpt_oss-mxfp4": its MXFP4 quantization by mlx-lm,
    "gpt_oss-hf": its experts in MXFP4 as the Hugging Face release stores them}."""
    f32 = write_gpt_oss(root / "gpt_oss")
    return {
        "gpt_oss": f32,
        "gpt_oss-mxfp4": mxfp4(f32, root / "gpt_oss-mxfp4"),
        "gpt_oss-hf": hf_release(f32, root / "gpt_oss-hf"),
    }


def hf_release(src: Path, out: Path) -> Path:
    """`src` in the layout of OpenAI's Hugging Face release: the experts' gate and up rows
    interleaved in `gate_up_proj`, MXFP4 as `*_blocks` (16 bytes per 32 values) and
    `*_scales` (uint8), their biases `*_bias`; `quantization_config` says `mxfp4`."""
    import shutil

    weights = mx.load(str(src / "model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    stored = {}
    for name, v in weights.items():
        if ".experts." not in name:
            stored[name] = v
            continue
        prefix = name[: name.index(".experts.") + len(".experts.")]
        proj, part = name[len(prefix) :].split(".")
        if proj == "up_proj":
            continue  # with gate_proj
        if proj == "gate_proj":
            up = weights[f"{prefix}up_proj.{part}"]
            v = mx.stack([v, up], axis=2).reshape(v.shape[0], -1, *v.shape[2:])
            proj = "gate_up_proj"
        if part == "bias":
            stored[f"{prefix}{proj}_bias"] = v
            continue
        w, scales = mx.quantize(v, 32, 4, mode="mxfp4")
        stored[f"{prefix}{proj}_blocks"] = w.view(mx.uint8).reshape(*w.shape[:2], -1, 16)
        stored[f"{prefix}{proj}_scales"] = scales
    mx.save_safetensors(str(out / "model.safetensors"), stored)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


# llama.cpp's names for the release's own tensors (convert_hf_to_gguf.py's GptOssModel),
# ahead of the names every architecture shares (gguf_writer's)
_GPT_OSS_NAMES = [
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"blk.\1.post_attention_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.sinks$", r"blk.\1.attn_sinks.weight"),
    (r"^model\.layers\.(\d+)\.mlp\.router\.", r"blk.\1.ffn_gate_inp."),
    (r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj_", r"blk.\1.ffn_\2_exps."),
]


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The release's MXFP4 (..., n, 16) bytes (values 2i, 2i+1 in byte i, low first) and
    (..., n) exponents -> ggml's blocks (..., n * 17): the exponent, then 16 bytes whose
    low nibbles are values 0..15 and high nibbles 16..31 (the converter's
    transform_nibble_layout)."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*scales.shape[:-1], -1)


def gguf_release(release: Path, out: Path, **overrides) -> Path:
    """The Hugging Face release layout `release` (see `hf_release`) as llama.cpp's converter
    writes it (`gpt-oss`): gate_up_proj split into ffn_gate_exps (even rows) and
    ffn_up_exps (odd rows), the MXFP4 blocks repacked to ggml's layout unchanged in value,
    the rest float32; its metadata. `overrides`: `gpt-oss.*` values to write instead or
    besides (integers as uint32, floats as float32)."""
    import re

    import gguf
    from gguf_writer import _HF_TO_GGUF, llama_vocabulary

    config = json.loads((release / "config.json").read_text())
    MXFP4 = gguf.GGMLQuantizationType.MXFP4
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    ints = {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.key_length": config["head_dim"],
        "attention.value_length": config["head_dim"],
        "attention.sliding_window": config["sliding_window"],
        "expert_count": config["num_local_experts"],
        "expert_used_count": config["num_experts_per_tok"],
        "expert_feed_forward_length": config["intermediate_size"],
        "rope.scaling.original_context_length": config["rope_scaling"][
            "original_max_position_embeddings"
        ],
        **overrides,
    }
    for key, value in ints.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"gpt-oss.{key}", value)
    floats = {
        "attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        "rope.freq_base": config["rope_theta"],
        "rope.scaling.factor": config["rope_scaling"]["factor"],
        "rope.scaling.yarn_beta_fast": config["rope_scaling"]["beta_fast"],
        "rope.scaling.yarn_beta_slow": config["rope_scaling"]["beta_slow"],
    }
    for key, value in floats.items():
        w.add_float32(f"gpt-oss.{key}", value)
    w.add_string("gpt-oss.rope.scaling.type", "yarn")
    vocab = llama_vocabulary(config["vocab_size"])
    w.add_string("tokenizer.ggml.model", "llama")
    for key in ("tokens", "scores", "token_type"):
        w.add_array(f"tokenizer.ggml.{key}", vocab[f"tokenizer.ggml.{key}"])
    stored = {k: np.array(v) for k, v in mx.load(str(release / "model.safetensors")).items()}
    for name, a in sorted(stored.items()):
        if name.endswith("_scales"):
            continue  # with its blocks
        new = name
        for pattern, repl in [*_GPT_OSS_NAMES, *_HF_TO_GGUF]:
            new, hit = re.subn(pattern, repl, name)
            if hit:
                break
        if name.endswith("_blocks"):
            a = _ggml_mxfp4(a, stored[name.replace("_blocks", "_scales")])
        new = new.replace("_exps.blocks", "_exps.weight")
        parts = {new: a}
        if ".ffn_gate_up_exps." in new:  # the converter's split: gate even rows, up odd
            base, part = new.split(".ffn_gate_up_exps.")
            parts = {
                f"{base}.ffn_gate_exps.{part}": a[:, 0::2],
                f"{base}.ffn_up_exps.{part}": a[:, 1::2],
            }
        for key, value in parts.items():
            if key.endswith("_exps.weight"):
                w.add_tensor(key, np.ascontiguousarray(value), raw_dtype=MXFP4)
            else:
                w.add_tensor(key, np.ascontiguousarray(value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
