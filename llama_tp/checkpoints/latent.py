"""Multi-head latent attention tensors in Hugging Face checkpoints (DeepSeek-V3, Kimi K2).

The checkpoint stores each head's key and value up-projections together:
`kv_b_proj` (H * (qk_nope_head_dim + v_head_dim), kv_lora_rank), each head's key rows
then its value rows. The model holds them as mlx-lm does (`models/latent_attention.py`):
`embed_q` (H, kv_lora_rank, qk_nope_head_dim), the key rows transposed, and
`unembed_out` (H, v_head_dim, kv_lora_rank). A `HeadRows` source reads either for any
range of heads straight from the file, one contiguous run of rows per head, so a rank
split by heads reads exactly its heads' bytes of `kv_b_proj`, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .base import CheckpointError


@dataclass(frozen=True)
class _Info:
    shape: tuple[int, ...]


class HeadRows:
    """`embed_q` (`keys`) or `unembed_out` of a `kv_b_proj` stored in `file` as `stored`:
    `read` as the sliced readers do, whole or a range of heads (axis 0)."""

    def __init__(
        self, name: str, file: Any, stored: str, heads: int, nope: int, v: int, keys: bool
    ):
        self.name, self.file, self.stored = name, file, stored
        self.heads, self.width = heads, nope + v
        self.offset, self.rows = (0, nope) if keys else (nope, v)
        self.keys = keys
        rank = file.tensors[stored].shape[1]
        shape = (heads, rank, nope) if keys else (heads, v, rank)
        self.tensors = {name: _Info(shape)}

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        if axis is None:
            start, stop = 0, self.heads
        elif axis != 0:
            raise ValueError(f"{name}: splits by heads (axis 0), not axis {axis}")
        first = [h * self.width + self.offset for h in range(start, stop)]
        w = mx.stack([self.file.read(self.stored, 0, a, a + self.rows) for a in first])
        return mx.contiguous(w.swapaxes(1, 2)) if self.keys else w


def split_kv_b(
    weights: dict[str, mx.array], sources: dict[str, tuple[Any, str]], args: Any, where: str
) -> None:
    """Replace every `layers.N.attention.kv_b_proj.weight` of `weights` (lazy) and
    `sources` by the layer's `embed_q` and `unembed_out`, in place."""
    nope, v, heads = args.qk_nope_head_dim, args.v_head_dim, args.n_heads
    for name in sorted(k for k in weights if k.endswith(".attention.kv_b_proj.weight")):
        prefix = name.removesuffix("kv_b_proj.weight")
        w = weights.pop(name)
        file, stored = sources.pop(name)
        if f"{prefix}kv_b_proj.scales" in weights:
            raise CheckpointError(
                f"{where}: {stored} is quantized: read the MLX folder mlx_lm.convert writes "
                "(embed_q / unembed_out), or the unquantized checkpoint"
            )
        if w.shape != (heads * (nope + v), args.kv_lora_rank):
            raise CheckpointError(
                f"{where}: {stored} has shape {list(w.shape)}, but {heads} heads of "
                f"{nope} + {v} rows over a latent of {args.kv_lora_rank} need "
                f"{[heads * (nope + v), args.kv_lora_rank]}"
            )
        per_head = w.reshape(heads, nope + v, -1)
        for part, keys in (("embed_q", True), ("unembed_out", False)):
            new = f"{prefix}{part}.weight"
            rows = per_head[:, :nope] if keys else per_head[:, nope:]
            weights[new] = rows.swapaxes(1, 2) if keys else rows  # lazy: never read whole
            sources[new] = (HeadRows(new, file, stored, heads, nope, v, keys), new)
