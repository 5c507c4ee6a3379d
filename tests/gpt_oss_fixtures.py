"""Tiny random gpt-oss checkpoints: float32, and MXFP4 experts as mlx-lm quantizes them.

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
