"""A model's `config.json` alone as a checkpoint of lazy placeholders, for `plan` before
anything is downloaded: as its Hugging Face / MLX folder would be held, or as a GGUF of
one of llama.cpp's quantization mixes (`gguf_recipe.py`)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..model_args import ModelArgs
from .base import Checkpoint, CheckpointError
from .hf import args_from_config, language_model, read_config


def read_config_only(config_file: Path, gguf_quant: str | None = None) -> Checkpoint:
    """A `config.json` alone, for `plan` before anything is downloaded: the tensors its
    model holds in its `torch_dtype` (default float32), quantized as its `quantization`
    block says (mlx-lm's way: every layer whose input width is a multiple of the group,
    scales in that dtype; MXFP4, gpt-oss's and Kimi K3's releases: the routed experts
    only), or with `gguf_quant` (e.g. Q4_K_M) as a GGUF of that mix of llama.cpp's
    quantizer would be held (`gguf_recipe.py`), as lazy placeholders never evaluated.
    Their shapes and bytes are the checkpoint's; their values are not: nothing but the
    plan may use them."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from ..models.registry import build

    config = read_config(config_file.parent)
    args = args_from_config(config, config_file.parent)
    model = build(args)
    dtypes = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
    # a release's dtype may be its text_config's only; `dtype` is what newer transformers
    # write in place of `torch_dtype`
    text = language_model(config)
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("dtype")
    model.set_dtype(dtypes.get(dtype, mx.float32))
    quant = config.get("quantization") or {}
    notes = _gguf_mix(model, args, gguf_quant, config_file) if gguf_quant else []
    if _mxfp4_release(config) and not gguf_quant:
        # gpt-oss's and Kimi K3's releases: the routed experts in MXFP4 (mlx-lm reads them
        # as `mxfp4`), the rest in the torch_dtype
        def experts(path: str, m: nn.Module) -> bool:
            return ".switch_mlp." in path and hasattr(m, "to_quantized")

        nn.quantize(model, 32, 4, mode="mxfp4", class_predicate=experts)
    elif quant and not gguf_quant:
        gs, bits = quant["group_size"], quant["bits"]

        def predicate(path: str, m: nn.Module) -> bool:
            return hasattr(m, "to_quantized") and m.weight.shape[-1] % gs == 0

        nn.quantize(model, gs, bits, class_predicate=predicate)
    weights = dict(tree_flatten(model.parameters()))
    ckpt = Checkpoint(config_file.parent, "config", args, weights, config)
    ckpt.notes = notes
    return ckpt


def _mxfp4_release(config: dict) -> bool:
    """A config of MXFP4 experts (Hugging Face's `quant_method` mxfp4, Kimi K3's
    compressed-tensors `mxfp4-pack-quantized`, or mlx-lm's mode)."""
    hf_quant = config.get("quantization_config") or {}
    mode = (config.get("quantization") or {}).get("mode")
    packed = hf_quant.get("format") == "mxfp4-pack-quantized"
    return hf_quant.get("quant_method") == "mxfp4" or packed or mode == "mxfp4"


def _gguf_mix(model, args: ModelArgs, mix: str, config_file: Path) -> list[str]:
    """`model` (lazy) as the GGUF reader holds a `mix` file of it: each tensor of
    llama.cpp's type converted to MLX bits in groups of 32 with float16 scales, F16
    fallbacks as float16, every other tensor float32 (`gguf_reader.py`). A mixture of
    experts only: a dense GGUF keeps its K-quant blocks as stored (plan the file)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    from .gguf_quants import BLOCKS
    from .gguf_recipe import GROUP, MIXES, held_bits, quantized_by, tensor_type

    if mix not in MIXES:
        raise CheckpointError(f"--gguf-quant {mix}: expected one of {', '.join(MIXES)}")
    if not args.n_experts:
        raise CheckpointError(
            f"{config_file}: --gguf-quant plans a mixture of experts (held converted to MLX "
            "as loaded); a dense model's GGUF keeps its blocks as stored: plan the file"
        )
    model.set_dtype(mx.float32)
    kinds: dict[str, str] = {}
    file_bytes: dict[str, int] = {}

    def predicate(path: str, m: nn.Module) -> bool | dict:
        if not hasattr(m, "to_quantized") or not quantized_by(path):
            return False
        cols = m.weight.shape[-1]
        kinds[path] = kind = tensor_type(
            path, cols, mix, args.n_layers, args.n_experts, args.tie_word_embeddings
        )
        per, size = BLOCKS.get(kind, (1, 2))  # F16: 2 bytes a value
        file_bytes[kind] = file_bytes.get(kind, 0) + m.weight.size // per * size
        bits = held_bits(kinds[path])
        return {"group_size": GROUP, "bits": bits} if bits else False

    nn.quantize(model, class_predicate=predicate)
    halves = [
        (k, v.astype(mx.float16))
        for k, v in tree_flatten(model.parameters())
        if (k.endswith((".scales", ".biases")) or kinds.get(k.rsplit(".", 1)[0]) == "F16")
        and k.rsplit(".", 1)[0] in kinds
    ]
    model.update(tree_unflatten(halves))
    floats = sum(
        v.nbytes for k, v in tree_flatten(model.parameters()) if k.rsplit(".", 1)[0] not in kinds
    )
    whole = sum(file_bytes.values()) + floats
    held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    types = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sorted(file_bytes.items()))
    return [
        f"GGUF {mix} as llama.cpp's quantizer writes it: {types}, float32 "
        f"{floats / 2**30:.2f} GiB; {whole / 2**30:.2f} GiB in the file, held converted to "
        f"MLX (4/5/8 bits in groups of {GROUP}): {held / 2**30:.2f} GiB"
    ]
