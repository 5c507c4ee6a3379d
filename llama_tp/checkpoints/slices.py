"""A checkpoint as a placement sees it (`model_shape`), and a rank's slices read from it.

    shape = model_shape(ckpt)                       # config + stored shapes, nothing read
    placement = place(shape, tp=2)                  # parallel/placement.py
    weights = read_slices(ckpt, placement.at(0, rank).slices)

Safetensors and GGUF tensors are read straight from the file, only the bytes of the
slice (`ckpt.sources`: the sliced readers count every byte in `safetensors.READ`);
tensors held in memory (original Meta checkpoints) are sliced there. A pre-split
folder's tensors are its rank's slices already: they are read whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import mlx.core as mx

from ..models.registry import layer_specs
from ..parallel.placement import ModelShape, Segmented, Slice
from .base import Checkpoint, CheckpointError


def model_shape(ckpt: Checkpoint) -> ModelShape:
    """The checkpoint's config and every tensor's stored (whole) shape and bytes. A
    pre-split folder holds slices: its whole shapes are the model's it was cut from."""
    if ckpt.format == "split":
        from mlx.utils import tree_flatten

        from .build import empty_split_model

        params = tree_flatten(empty_split_model(ckpt).parameters())  # lazy, never evaluated
        tensors = {k: (tuple(v.shape), v.nbytes) for k, v in params}
        return ModelShape(
            ckpt.args, tensors, ckpt.metadata.get("ffn_block"), layer_specs(ckpt.args)
        )
    tensors = {k: (_stored(ckpt, k, v), v.nbytes) for k, v in ckpt.weights.items()}
    return ModelShape(ckpt.args, tensors, ckpt.ffn_block, layer_specs(ckpt.args))


def _stored(ckpt: Checkpoint, name: str, v: mx.array) -> tuple[int, ...]:
    """The shape a placement slices: GGUF blocks kept as stored (`ckpt.blocks`, uint8
    (rows, blocks * bytes)) in values (rows, columns), since a column slice of them may
    start inside a block (the reader then reads the blocks covering it)."""
    kind = ckpt.blocks.get(name)
    if kind is None:
        return tuple(v.shape)
    from ..kernels.blocks import GGUF_TYPES

    _, per, size = GGUF_TYPES[kind]
    return (v.shape[0], v.shape[1] // size * per)


def read_tensor(ckpt: Checkpoint, name: str, s: Slice | Segmented | None = None) -> mx.array:
    """Tensor `name` of the checkpoint, whole (`s` None) or its (axis, start, stop) slice
    (a fused tensor's segments: each read, concatenated): only those bytes read where
    the file allows it."""
    if s is not None and isinstance(s[0], tuple):
        return mx.concatenate([read_tensor(ckpt, name, one) for one in s], axis=s[0][0])
    if name in ckpt.sources:
        file, stored = ckpt.sources[name]
        return file.read(stored) if s is None else file.read(stored, *s)
    if name not in ckpt.weights:
        raise CheckpointError(f"{ckpt.path}: no tensor {name}")
    return sliced(ckpt.weights[name], s)


def sliced(v: mx.array, s: Slice | Segmented | None) -> mx.array:
    """`v`, or its (axis, start, stop) slice as its own (lazy) buffer."""
    if s is None:
        return v
    if isinstance(s[0], tuple):
        return mx.concatenate([sliced(v, one) for one in s], axis=s[0][0])
    axis, start, stop = s
    index = [slice(None)] * v.ndim
    index[axis] = slice(start, stop)
    return mx.contiguous(v[tuple(index)])  # a plain slice would keep all of `v` alive


def read_slices(
    ckpt: Checkpoint,
    slices: Mapping[str, Slice | Segmented | None],
    done: Callable[[int], None] | None = None,
) -> list[tuple[str, mx.array]]:
    """Every tensor of `slices` (a rank's placement), read and evaluated one at a time
    (`done(nbytes)` after each, for a progress bar). A pre-split folder's tensors are
    read whole: the folder holds the slices; it must hold exactly those tensors."""
    split = ckpt.format == "split"
    if split:
        missing = sorted(set(slices) - set(ckpt.weights))
        extra = sorted(set(ckpt.weights) - set(slices))
        if missing or extra:
            what = f"is missing {missing[0]}" if missing else f"holds {extra[0]}"
            raise CheckpointError(
                f"{ckpt.path}: {what}, which this rank's placement does not match; "
                "convert the checkpoint again"
            )
    out = []
    for name, s in slices.items():
        v = read_tensor(ckpt, name, None if split else s)
        mx.eval(v)
        out.append((name, v))
        if done is not None:
            done(v.nbytes)
    return out
