"""Convert a GGUF file into a Hugging Face / MLX directory, and `python -m llama_tp.convert`.

    python -m llama_tp.convert --model SmolLM2-135M-Instruct.Q4_1.gguf --out smollm2-mlx

The directory (`config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`) opens with both `llama_tp.load(DIR)` and
`mlx_lm.load(DIR)`. Quantized tensors are copied as they are (MLX reads GGUF
Q4_0/Q4_1/Q8_0 as affine group-32 quantization), with per-module overrides in
`config.json` wherever a tensor's bits or group size differ from the dominant
setting. The q/k rows keep GGUF's interleaved layout, hence `rope_traditional`.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .checkpoints import Checkpoint, CheckpointError, open_checkpoint
from .checkpoints.hf import _RENAMES, to_model_name

MAX_SHARD_GB = 5  # as mlx_lm.utils.MAX_FILE_SIZE_GB


def _invert(pattern: re.Pattern, repl: str) -> tuple[re.Pattern, str]:
    r"""Swap the sides of one rename.

    `^model\.layers\.(\d+)\.x\.` -> `layers.\1.y.` becomes
    `^layers\.(\d+)\.y\.` -> `model.layers.\1.x.`.
    """
    src = "^" + re.escape(repl).replace(re.escape("\\1"), r"(\d+)")
    dst = pattern.pattern.removeprefix("^").replace(r"(\d+)", r"\1").replace("\\.", ".")
    return re.compile(src), dst


# The model's names -> Hugging Face names: the HF reader's table, inverted.
_TO_HF = [_invert(p, r) for p, r in _RENAMES]


def hf_name(name: str) -> str:
    """The Hugging Face name of the model's tensor `name` (checked against the reader)."""
    for pattern, repl in _TO_HF:
        new, n = pattern.subn(repl, name)
        if n and to_model_name(new) == name:
            return new
    raise CheckpointError(f"tensor {name!r} has no Hugging Face name")


def _f32(x: float) -> float:
    """The shortest decimal that is the same float32 (GGUF stores 1e-5 as 9.99999974e-06)."""
    return float(str(np.float32(x)))


def _token_ids(meta: dict[str, Any]) -> tuple[int | None, int | list[int] | None]:
    def get(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if value is None else int(value.item() if hasattr(value, "item") else value)

    eos = list(dict.fromkeys(i for i in map(get, ("eos", "eot", "eom")) if i is not None))
    return get("bos"), (eos[0] if len(eos) == 1 else eos or None)


def quantization(ckpt: Checkpoint) -> dict[str, Any] | None:
    """mlx-lm's `quantization` block: the dominant setting plus per-module overrides."""
    from .loader import build_model

    model = build_model(ckpt)  # also checks that the tensors match the config
    per_module: dict[str, tuple[int, int]] = {}
    params: Counter[tuple[int, int]] = Counter()
    for path, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            if m.mode != "affine":
                raise CheckpointError(f"{ckpt.path}: {path}: unsupported mode {m.mode!r}")
            setting = (m.group_size, m.bits)
            per_module[hf_name(f"{path}.weight").removesuffix(".weight")] = setting
            params[setting] += m.weight.size * 32 // m.bits
    if not params:
        return None
    (group_size, bits), _ = params.most_common(1)[0]
    block: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for path, (g, b) in sorted(per_module.items()):
        if (g, b) != (group_size, bits):
            block[path] = {"group_size": g, "bits": b}
    return block


def hf_config(ckpt: Checkpoint) -> dict[str, Any]:
    """`config.json` for mlx-lm's `llama` model (and llama_tp's HF reader)."""
    a = ckpt.args
    bos, eos = _token_ids(ckpt.metadata)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": a.dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "intermediate_size": a.hidden_dim,
        "vocab_size": a.vocab_size,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(a.norm_eps),
        "rope_theta": _f32(a.rope_theta),
        "rope_traditional": a.rope_traditional,
        "max_position_embeddings": a.max_position_embeddings,
        "tie_word_embeddings": a.tie_word_embeddings,
        "attention_bias": a.qkv_bias,
        "mlp_bias": a.mlp_bias,
    }
    if a.rope_scaling:
        config["rope_scaling"] = a.rope_scaling
    if bos is not None:
        config["bos_token_id"] = bos
    if eos is not None:
        config["eos_token_id"] = eos
    if (quant := quantization(ckpt)) is not None:
        # mlx-lm's save_config writes the block under both names (for HF tooling).
        config["quantization"] = config["quantization_config"] = quant
    return dict(sorted(config.items()))


def _write_weights(weights: dict[str, mx.array], out: Path, progress: bool) -> int:
    """Write `weights` (emptied as it goes) as mlx-lm does; returns the bytes written."""
    from mlx_lm.utils import make_shards
    from tqdm import tqdm  # a dependency of transformers and huggingface_hub

    total = sum(v.nbytes for v in weights.values())
    shards = make_shards(weights, MAX_SHARD_GB)
    weights.clear()  # the shards hold the only references: written shards are freed
    n = len(shards)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    weight_map: dict[str, str] = {}
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="writing",
        file=sys.stderr,
        disable=not progress,
    )
    with bar:
        for i, name in enumerate(names):
            for v in shards[i].values():
                mx.eval(v)  # reads the tensor from the GGUF file
                bar.update(v.nbytes)
            mx.save_safetensors(str(out / name), shards[i], metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(shards[i], name))
            shards[i] = None
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return total


def _save_tokenizer(ckpt: Checkpoint, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat template inside, as older tools expect)."""
    from .tokenizer import load_tokenizer

    # The wrapper passes this on to its transformers tokenizer, as in mlx_lm.utils.save.
    load_tokenizer(ckpt).save_pretrained(str(out), save_jinja_files=False)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    # transformers 5 names its class TokenizersBackend; PreTrainedTokenizerFast is an alias
    # there and the class itself in transformers 4, so this name loads with both.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(src: Path, out: Path, progress: bool = True) -> Path:
    """Convert the GGUF file `src` into the directory `out` (created; weight files in it replaced).

    With `progress`, shows a progress bar and a final `wrote ...` line on stderr.
    """
    src, out = Path(src), Path(out)
    if src.is_dir():
        raise CheckpointError(f"{src}: is a directory; convert reads a .gguf file")
    ckpt = open_checkpoint(src)
    if ckpt.format != "gguf":
        raise CheckpointError(f"{src}: not a GGUF file")
    config = hf_config(ckpt)
    weights = {hf_name(k): ckpt.weights.pop(k) for k in sorted(ckpt.weights)}
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a previous conversion's shards would be loaded too
    (out / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    _save_tokenizer(ckpt, out)
    n_tensors = len(weights)
    nbytes = _write_weights(weights, out, progress)
    if progress:
        print(f"wrote {out} ({n_tensors} tensors, {nbytes / 1e6:.1f} MB)", file=sys.stderr)
    return out


def _parser():
    from .cli import ArgumentParser

    p = ArgumentParser(
        prog="python -m llama_tp.convert",
        description="Convert a GGUF file into a Hugging Face / MLX directory "
        "that llama_tp and mlx-lm both load.",
    )
    p.add_argument("--model", help="GGUF file (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output directory (must be empty or new)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    return p


def main() -> int:
    from .cli import UsageError
    from .loader import default_model

    args = _parser().parse_args()
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(f"--out {out}: directory is not empty (use --force to write into it)")
    convert_gguf(Path(args.model) if args.model else default_model(), out)
    return 0


if __name__ == "__main__":
    from .cli import run

    run(main)
