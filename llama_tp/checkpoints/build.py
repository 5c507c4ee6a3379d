"""A model from a checkpoint: the right (quantized) layers, the weights put in."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..cluster.distributed import first_line
from ..model import Transformer
from ..models.registry import build
from ..parallel.module_swap import swap_modules
from . import quantization_of
from .base import Checkpoint, CheckpointError


def _quantize_like(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Turn every Linear/Embedding whose checkpoint tensor is quantized into
    its quantized counterpart, with bits and group size read per tensor."""

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):
            return False
        return quantization_of(weights, path, module.weight.shape[-1]) or False

    nn.quantize(model, class_predicate=predicate)


def _blocks_like(model: nn.Module, blocks: dict[str, str]) -> None:
    """Turn every Linear/Embedding whose checkpoint tensor is kept as GGUF blocks
    (`ckpt.blocks`, weight name -> type) into the native kernels' block layer."""
    from ..kernels.layers import GGUFEmbedding, GGUFLinear

    def block_layer(path: str, module: nn.Module) -> nn.Module | None:
        kind = blocks.get(f"{path}.weight")
        if kind is None:
            return None
        rows, cols = module.weight.shape
        if isinstance(module, nn.Embedding):
            return GGUFEmbedding(rows, cols, kind)
        return GGUFLinear(cols, rows, kind, bias="bias" in module)

    swap_modules(model, block_layer)


def build_model(ckpt: Checkpoint, whole: bool = True) -> Transformer:
    """The model with the checkpoint's (still lazy) weights in place.

    A GGUF checkpoint's weights are placeholders read only through `ckpt.sources`:
    with `whole` they are read (whole) here; the loader passes False and reads each
    rank's slices after sharding, and shape-only users (the plan) read nothing.
    """
    model = build(ckpt.args)
    model.ffn_block = ckpt.ffn_block  # the plan splits the feed-forward on file blocks
    _blocks_like(model, ckpt.blocks)
    _quantize_like(model, ckpt.weights)
    load_weights(model, ckpt, list(ckpt.weights.items()))
    if whole:
        read_all(model, ckpt)
    return model


def skeleton(ckpt: Checkpoint) -> Transformer:
    """The checkpoint's model with nothing read (lazy placeholders of the stored shapes,
    quantized where the checkpoint is), for the loader to shard and fill with the slices
    each rank reads. A pre-split folder's is the whole model its slices were cut from."""
    return empty_split_model(ckpt) if ckpt.format == "split" else build_model(ckpt, whole=False)


def read_all(model: nn.Module, ckpt: Checkpoint) -> None:
    """Put every tensor of a checkpoint whose weights are placeholders (GGUF: read only
    through `ckpt.sources`) into the unsharded model, whole, for whole-model work
    (re-quantizing, casting)."""
    if ckpt.format != "gguf":
        return
    from mlx.utils import tree_flatten

    names = [k for k, _ in tree_flatten(model.parameters())]
    load_weights(model, ckpt, [(k, ckpt.sources[k][0].read(ckpt.sources[k][1])) for k in names])


def load_weights(model: nn.Module, ckpt: Checkpoint, weights: list[tuple[str, mx.array]]) -> None:
    try:
        model.load_weights(weights, strict=True)
    except ValueError as e:
        # mlx lists every mismatching name; keep the first line, it names the problem.
        raise CheckpointError(
            f"{ckpt.path}: weights do not match the config: {first_line(e)}"
        ) from None


def empty_split_model(ckpt: Checkpoint) -> Transformer:
    """The whole model of a pre-split folder, lazily initialized (never evaluated: the
    stored slices replace what a rank keeps), quantized where the folder's is, with the
    source file's feed-forward block (GGUF K-quants: 256) for the plan's split."""
    model = build(ckpt.args)
    model.ffn_block = ckpt.metadata.get("ffn_block")  # as the plan that wrote the folder
    quantized = ckpt.metadata.get("quantized", {})

    def predicate(path: str, module: nn.Module):
        q = quantized.get(path)
        return {"bits": q[0], "group_size": q[1]} if q else False

    nn.quantize(model, class_predicate=predicate)
    return model
