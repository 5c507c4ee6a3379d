"""Convert a checkpoint into a Hugging Face / MLX directory or a pre-split one.

Sources: GGUF files, Hugging Face / MLX directories, original Meta checkpoints.
The plain directory (`config.json`, `model.safetensors` by mlx-lm's names: see
`hf_config.py`; `tokenizer.json`, `tokenizer_config.json`) opens with both `llama_tp.load(DIR)` and
`mlx_lm.load(DIR)`. Quantized tensors are copied as they are (GGUF blocks as the
loader converts them: MLX affine group-32 quantization, see `gguf_quants.py`; a
GGUF file is converted tensor by tensor, `stream.py`), with per-module overrides in
`config.json` wherever a tensor's bits or group size differ from the dominant
setting; `--quantize` re-quantizes (MLX affine). GGUF q/k rows keep their
interleaved layout, hence `rope_traditional`. `--shards N` writes one folder
per rank instead (see `split.py`); `open_source`, `write_folders` and `Source.get`
are also what `loading/mesh_split.py` writes the folders of a tp x pp mesh with.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear

from ..parallel.module_swap import swap_modules
from ..parallel.placement import DEFAULT_MOE_SPLIT, Segmented, Slice
from ..parallel.shares import SplitSpec, Weights, fixed_weights
from . import open_checkpoint
from .base import Checkpoint, CheckpointError
from .gated_delta import kda_stored
from .hf_config import hf_config, hf_name, quantized_modules, token_ids

MAX_SHARD_GB = 5  # as mlx_lm.utils.MAX_FILE_SIZE_GB


def requantize(ckpt: Checkpoint, bits: int, group_size: int) -> nn.Module:
    """The checkpoint's model (lazy) with MLX affine `bits`-bit quantization: every
    Linear and Embedding whose input width is a multiple of `group_size`, as
    mlx-lm's convert does; layers quantized in the source are dequantized first."""
    from .build import build_model

    def to_float(path: str, m: nn.Module) -> nn.Module | None:
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedMultiLinear)):
            return None
        w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
        if isinstance(m, QuantizedMultiLinear):  # latent attention's per-head weights
            f = MultiLinear(w.shape[2], w.shape[1], w.shape[0])
        elif isinstance(m, nn.QuantizedEmbedding):
            f = nn.Embedding(*w.shape)
        else:
            f = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                f.bias = m.bias
        f.weight = w
        return f

    model = build_model(ckpt)
    swap_modules(model, to_float)

    def predicate(path: str, m: nn.Module) -> bool:
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size, bits, class_predicate=predicate)
    return model


def _write_weights(
    weights: dict[str, mx.array], out: Path, progress: bool
) -> tuple[int, list[str]]:
    """Write `weights` (emptied as it goes) as mlx-lm does; returns (bytes, file names)."""
    from mlx_lm.utils import make_shards

    from ..cluster.progress import progress as bar_for

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
    bar = bar_for(
        desc=f"writing {out.name}", total=total, unit="B", unit_scale=True, enabled=progress
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
    return total, names


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


@dataclass
class Source:
    """A checkpoint opened for conversion: its model (lazy; re-quantized or cast as
    asked) and the tensors to write, by the model's names."""

    ckpt: Checkpoint
    model: nn.Module
    weights: dict[str, mx.array]
    changed: str  # what the conversion does to the weights ("-q8g32", "-float16"; "")

    @cached_property
    def from_file(self) -> bool:
        """The tensors are the file's own, readable in slices (not re-quantized or cast)."""
        return not self.changed and all(k in self.ckpt.sources for k in self.weights)

    def get(self, name: str, s: Slice | Segmented | None) -> mx.array:
        """Tensor `name`, or its (axis, start, stop) slice (a fused tensor's: one per
        segment): read as a slice from the file (nothing else held), else sliced from
        the lazy tensor."""
        from .slices import read_tensor, sliced

        if self.from_file:
            return read_tensor(self.ckpt, name, s)
        return sliced(self.weights[name], s)


def open_source(
    src: Path, quantize: int | None = None, group_size: int = 64, dtype: str | None = None
) -> Source:
    """The checkpoint `src` ready to convert (see `convert`); nothing written yet."""
    from .build import build_model

    ckpt = open_checkpoint(Path(src))
    if ckpt.format == "split":
        raise CheckpointError(f"{src}: already split; convert the original checkpoint")
    if quantize is not None and dtype is not None:
        raise ValueError("quantize and dtype exclude each other: pick one")
    # GGUF tensors are read from the file as they are written (whole: to re-quantize or cast)
    whole = quantize is not None or dtype is not None
    model = build_model(ckpt, whole) if quantize is None else requantize(ckpt, quantize, group_size)
    if dtype is not None:
        from ..parallel.cast import cast_model

        cast_model(model, dtype)
    from mlx.utils import tree_flatten

    changed = (f"-q{quantize}g{group_size}" if quantize else "") + (f"-{dtype}" if dtype else "")
    return Source(ckpt, model, dict(tree_flatten(model.parameters())), changed)


def clear_out(out: Path) -> None:
    """Create `out`; remove a previous conversion's weight files (they would be loaded too)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)


def convert(
    src: Path,
    out: Path,
    *,
    quantize: int | None = None,
    group_size: int = 64,
    shards: int | None = None,
    vocab_parallel: bool = True,
    progress: bool = True,
    dtype: str | None = None,
    moe_split: str = DEFAULT_MOE_SPLIT,
    split: SplitSpec = None,
) -> Path:
    """Convert the checkpoint `src` into the directory `out` (created; weight files replaced).

    `quantize` (4 or 8 bits, `group_size` values per scale) re-quantizes it;
    `shards` writes one folder per rank of a `shards`-rank run instead of one
    mlx-lm directory (for a tp x pp mesh: `loading.mesh_split.convert_mesh`). `dtype`
    ("float32", "float16", "bfloat16") dequantizes every quantized tensor and casts
    all weights to it. `moe_split` ("tensor" or "expert"): how `shards` split a
    mixture-of-experts model's experts; `split` ("3:1" or (3, 1): one weight per rank) how
    much of every layer each folder takes (recorded: loading refuses another). With
    `progress`, shows progress and a `wrote ...` line on stderr.
    """
    src, out = Path(src), Path(out)
    if split is not None and shards is None:
        raise ValueError("split only applies with shards (one folder per rank)")
    split_weights = fixed_weights(split, shards, "convert") if shards else None
    source = open_source(src, quantize, group_size, dtype)
    ckpt, model, weights = source.ckpt, source.model, source.weights
    clear_out(out)
    if shards is not None:
        _write_split(source, out, shards, vocab_parallel, progress, moe_split, split_weights)
        if progress:
            print(f"wrote {out} ({shards} rank folders)", file=sys.stderr)
        return out
    config = hf_config(ckpt, model)
    hf_weights = {hf_name(k, ckpt.args.model_type): weights.pop(k) for k in sorted(weights)}
    if "kda_layers" in ckpt.args.extra:  # Kimi-Linear: A_log as mlx-lm holds it
        hf_weights = kda_stored(hf_weights)
    (out / "config.json").write_text(json.dumps(config, indent=4) + "\n")
    _save_tokenizer(ckpt, out)
    n_tensors = len(hf_weights)
    if ckpt.format == "gguf" and not source.changed:
        # Tensor by tensor from the file: peak memory about the largest tensor.
        from .stream import write_streaming

        def reader(name: str):
            file, stored = ckpt.sources[name]
            return lambda: file.read(stored)

        streamed = {
            hf_name(k, ckpt.args.model_type): (tuple(v.shape), v.dtype, reader(k))
            for k, v in ckpt.weights.items()
            if k in ckpt.sources
        }
        hf_weights.clear()
        nbytes, _ = write_streaming(streamed, out, MAX_SHARD_GB << 30, progress)
    else:
        nbytes, _ = _write_weights(hf_weights, out, progress)
    if progress:
        print(f"wrote {out} ({n_tensors} tensors, {nbytes / 1e6:.1f} MB)", file=sys.stderr)
    return out


def write_folders(
    source: Source,
    out: Path,
    folders: list,
    placement: Any,
    progress: bool,
    mesh: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the rank folders `folders` (`split.Folder`) of `source`'s `placement` into
    `out`, each with the tokenizer, and the manifest (see `split.write`); returns the
    manifest."""
    from . import split
    from .fingerprint import weights_fingerprint

    ckpt = source.ckpt
    bos, eos = token_ids(ckpt)
    config = {
        "quantized": {p: [b, g] for p, (g, b) in quantized_modules(source.model).items()},
        "bos_token_id": bos,
        "eos_token_id": eos,
        "source": ckpt.path.name,
        # The plan split the feed-forward on the file's blocks: loading must too.
        "ffn_block": getattr(source.model, "ffn_block", None),
        "moe_split": placement.moe_split,  # as the experts were cut
        "split": list(placement.plan.weights) if placement.plan.weights else None,  # --split
        "llama_tp": {"fingerprint": weights_fingerprint(ckpt) + source.changed},
    }
    return split.write(
        out,
        ckpt.args,
        folders,
        placement.vocab_parallel,
        config,
        lambda tensors, folder: _write_weights(tensors, folder, progress),
        lambda folder: _save_tokenizer(ckpt, folder),
        mesh,
    )


def _write_split(
    source: Source,
    out: Path,
    n: int,
    vocab_parallel: bool,
    progress: bool,
    moe_split: str,
    weights: Weights | None,
) -> None:
    """One folder per rank: its placement's slices of every tensor (`Source.get`)."""
    from ..parallel.placement import place
    from ..parallel.shard import model_shape_of
    from .split import placement_folders

    shape = model_shape_of(source.model)
    placement = place(shape, n, vocab_parallel=vocab_parallel, moe_split=moe_split, split=weights)
    folders = placement_folders(placement, source.get)
    write_folders(source, out, folders, placement, progress)


def convert_gguf(src: Path, out: Path, progress: bool = True) -> Path:
    """Convert the GGUF file `src` into an mlx-lm directory `out` (see `convert`)."""
    if Path(src).is_dir():
        raise CheckpointError(f"{src}: is a directory; convert reads a .gguf file")
    return convert(src, out, progress=progress)
