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
`qwen3` size is a dense Qwen3 (q/k norms, heads of 128) with Qwen3-0.6B's widths and 8
layers. The `deepseek-*` sizes are DeepSeek-V3 models (latent attention, grouped sigmoid routing, a
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
The `qwen35*` and `qwen3-next` sizes are Gated DeltaNet hybrids (`synthetic_hybrid.py`).
The `gemma4-*` sizes are Gemma 4 MoE models as mlx-lm's own `gemma4_text` class holds
them (the tensors listed from it): sliding and global layers (global heads twice as wide,
2 global KV heads whose keys are the values), the dense GeGLU beside the experts, capped
logits; `gemma4-moe` is Gemma 4 26B-A4B's layout scaled down (128 -> 32 experts, 4 per
token, 30 -> 8 layers with every fourth global, window 1024 -> 128, widths / 2 to / 4).
The `dsv32-tiny` / `deepseek-v32` sizes are DeepSeek-V3.2 models as mlx-lm's own
`deepseek_v32` class holds them: the `deepseek-*` sizes' layers with the lightning
indexer beside the latent attention; `deepseek-v32` is `deepseek-v3` with an indexer of
16 heads of 64 (64 of 128 scaled down) picking each query's top 16 keys (2048 scaled
down to what a benchmark's prompt passes: longer prompts attend sparsely).
The `minimax-tiny` / `minimax` sizes are MiniMax-M2 models as mlx-lm's own `minimax`
class holds them: q/k norms over all heads, partial RoPE, experts behind sigmoid scores
with a correction bias; `minimax` is MiniMax-M2's layout scaled down (256 -> 64 experts,
8 per token, 48/8 -> 16/4 heads of 128 -> 64 with half of each rotated, 62 -> 8 layers).
The `llama4-tiny` / `llama4` sizes are Llama 4 models as mlx-lm's own `llama4` class
holds them (the wrapper's text model): chunked local attention on three of every four
layers (q/k norms after RoPE), a global NoPE layer, experts top-1 by sigmoid beside a
shared expert; `llama4` is Llama 4 Scout's layout scaled down (16 experts in every
layer, 40/8 -> 16/4 heads of 128 -> 64, 48 -> 8 layers, chunks of 8192 -> 32 positions:
what a benchmark's prompt passes).
The `step3p5-tiny` / `step3p5` sizes are Step-3.5 models as mlx-lm's own `step3p5`
class holds them: a global layer then three sliding ones with heads of their own, each
head's output gated, experts behind sigmoid scores plus a router bias beside a shared
expert, clamped SwiGLUs in the last layers; `step3p5` is Step-3.5-Flash's layout scaled
down (288 -> 64 experts, 8 per token, 64/96 -> 16/24 query heads over 8 -> 2 KV heads of
128 -> 64, 45 -> 8 layers, window 512 -> 128).
The `nemotron-tiny` / `nemotron` sizes are Nemotron-H models as mlx-lm's own
`nemotron_h` class holds them: one mixer per layer (Mamba-2, experts, attention without
RoPE, relu2 feed-forward); `nemotron` is Nemotron 3 Nano's layout scaled down (52 -> 8
layers of its pattern's start, MEMEM*EM; 64 heads of 64 in 8 groups of 128 state values
-> 32 in 8 of 64; 128 -> 64 relu2 experts, 6 per token, and a shared one; 32/2 heads).
The `kimi-tiny` / `kimi-linear` sizes are Kimi-Linear models as mlx-lm's own
`kimi_linear` class holds them: KDA layers (3 of 4) beside latent attention without RoPE,
experts and a shared one after a dense first layer; `kimi-linear` is Kimi-Linear-48B-A3B's
layout scaled down (256 -> 64 experts, 8 per token, 32 KDA heads of 128 -> 16 of 64,
32 latent heads -> 16 with kv rank 512 -> 256, 27 -> 8 layers).
The `kimi-k3-tiny` / `kimi-k3` sizes are Kimi K3 models as mlx-lm's own `kimi_k3` class
holds them: fused KDA layers (3 of 4, a lower-bounded decay, a full-rank gate) beside
gated latent attention through q_lora_rank, SiTU, latent experts (normed after their sum)
and a shared one after a dense first layer, attention residuals over blocks of layers;
`kimi-k3` is the kimi-linear size with K3's parts (experts in 512 latent values, blocks
of 4 layers).
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

from .synthetic_specs import DTYPES, Q4_GROUP, SIZES, hf_config, parse_spec, tensor_list

__all__ = ["DTYPES", "SIZES", "hf_config", "parse_spec", "synthetic_dir", "write_synthetic"]


def _weights(s: dict, dtype: mx.Dtype, seed: int) -> dict[str, mx.array]:
    """Hugging Face-named random weights, scaled so that activations stay O(1)."""
    key = mx.random.key(seed)
    out: dict[str, mx.array] = {}
    for name, shape, init in tensor_list(s):
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
    tensors = tensor_list(s)
    routers = {n.removesuffix(".e_score_correction_bias") for n, _, i in tensors if i == "zeros"}
    for name, shape, init in tensors:
        router = name.removesuffix(".weight") in routers  # DeepSeek's gate: float, as _quantized
        router = router or name.endswith(_FLOAT)
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


# Kept float as mlx-lm's quant_predicate keeps them (Kimi K3's attention-residual queries)
_FLOAT = ("res_proj.weight",)


def _quantized(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """MLX affine 4-bit (group 64) of every projection, expert and embedding table whose
    width is a multiple of the group, as mlx-lm's convert does; norms stay as they are."""
    out = {}
    for name, v in weights.items():
        router = f"{name.removesuffix('.weight')}.e_score_correction_bias" in weights
        router = router or name.endswith(_FLOAT)
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
    if "hybrid" in s:  # Gated DeltaNet hybrids: written by mlx-lm's own classes
        from .synthetic_hybrid import HYBRIDS, write_hybrid

        config = write_hybrid(s["hybrid"], spec.rpartition("-")[2], dtype, out, seed)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        _write_tokenizer(out, HYBRIDS[s["hybrid"]][1]["vocab_size"])
        return out
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
    from ..console.command import start

    p = ArgumentParser(prog="python -m llama_tp.synthetic", description=__doc__.splitlines()[0])
    p.add_argument("spec", help=f"SIZE-DTYPE, SIZE in {', '.join(SIZES)}; e.g. 0.5b-fp16")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shapes-only",
        action="store_true",
        help="write the tensors' shapes, their data a sparse file of zeros: for `plan`",
    )
    args = start(p)
    path = write_synthetic(args.spec, args.out, args.seed, args.shapes_only)
    print(path, file=sys.stderr)
    return 0


if __name__ == "__main__":
    from ..console.command import script

    script(main)()
