"""gpt-oss's Hugging Face release: MXFP4 experts stored as `*_blocks` / `*_scales`.

    model.layers.N.mlp.experts.gate_up_proj_blocks  (E, 2 * I, dim / 32, 16) uint8
    model.layers.N.mlp.experts.gate_up_proj_scales  (E, 2 * I, dim / 32) uint8
    model.layers.N.mlp.experts.gate_up_proj_bias    (E, 2 * I)
    model.layers.N.mlp.experts.down_proj_{blocks,scales,bias}

Each 32-value block is 16 bytes of 4-bit values with one uint8 exponent, as MLX's
`mxfp4` mode holds them (mlx-lm's gpt_oss `sanitize` only views the bytes as uint32),
and gate and up rows alternate in `gate_up_proj`. They are read as the model's
`switch_mlp.{gate,up,down}_proj.{weight,scales,bias}` (weight (E, out, in / 8) uint32),
MXFP4 as stored, never dequantized: a rank's rows of gate (or up) are the even (odd)
rows of the stored rows [2 * start, 2 * stop), read once for both; its columns of down
are whole blocks. `MXFP4Experts.read` is the sliced readers' `read`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

# (the experts' HF prefix, the projection, the part)
_STORED = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales|bias)$"
)
_PARTS = {"blocks": "weight", "scales": "scales", "bias": "bias"}


def stored_part(name: str) -> tuple[str, str, str] | None:
    """`model.layers.3.mlp.experts.gate_up_proj_blocks` -> (prefix, projection, part)."""
    m = _STORED.match(name)
    return m.groups() if m else None


@dataclass(frozen=True)
class _Info:
    shape: tuple[int, ...]


def _as_model(v: mx.array, part: str) -> mx.array:
    """Stored blocks (..., n, 16) uint8 -> MLX's packed (..., n * 4) uint32."""
    return v.view(mx.uint32).flatten(-2) if part == "blocks" else v


class MXFP4Experts:
    """The model's tensor `name`, from stored tensor `stored` of the sliced reader `file`:
    the rows of parity `parity` (0: gate, 1: up; None: all, down_proj)."""

    def __init__(self, name: str, file: Any, stored: str, part: str, parity: int | None):
        self.name, self.file, self.stored, self.part, self.parity = (
            name, file, stored, part, parity,
        )  # fmt: skip
        shape = list(file.tensors[stored].shape)
        if part == "blocks":
            shape = [*shape[:-2], shape[-2] * shape[-1] // 4]
        if parity is not None:
            shape[1] //= 2
        self.tensors = {name: _Info(tuple(shape))}
        # a stored slice read for one parity, kept for the other (read once for both)
        self._pending: dict = {}
        self._partner: MXFP4Experts | None = None

    def _stored_read(self, axis: int | None, start: int, stop: int) -> mx.array:
        if axis is None:
            return self.file.read(self.stored)
        if axis == 2 and self.part == "blocks":  # packed uint32 columns -> 16-byte blocks
            return self.file.read(self.stored, 2, start // 4, stop // 4)
        if axis == 1 and self.parity is not None:
            return self.file.read(self.stored, 1, 2 * start, 2 * stop)
        return self.file.read(self.stored, axis, start, stop)

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        """The tensor, whole (`axis` None) or its slice [start, stop) along `axis`, in the
        model's units (uint32 columns of the packed weight)."""
        key = (self.stored, axis, start, stop)
        pending = (self._partner or self)._pending
        if key in pending:
            v = pending.pop(key)
        else:
            v = self._stored_read(axis, start, stop)
            mx.eval(v)
            if self.parity is not None:
                pending[key] = v
        v = _as_model(v, self.part)
        if self.parity is not None:
            v = v[:, self.parity :: 2]
        return mx.contiguous(v)


def mxfp4_experts(
    found: dict[str, tuple[Any, mx.array]],
) -> dict[str, tuple[mx.array, MXFP4Experts]]:
    """The model's experts tensors -> (lazy value, sliced source), from the stored
    `*_blocks` / `*_scales` / `*_bias` tensors found (stored name -> (file, lazy value)),
    gate before up so that a rank's reads of the two share one read of their rows."""
    out = {}
    for stored, (file, value) in found.items():
        prefix, proj, part = stored_part(stored)
        layer = prefix.removeprefix("model.layers.").split(".")[0]
        base = f"layers.{layer}.feed_forward.switch_mlp"
        model = _as_model(value, part)
        if proj == "down_proj":
            name = f"{base}.down_proj.{_PARTS[part]}"
            out[name] = (model, MXFP4Experts(name, file, stored, part, None))
            continue
        gate = MXFP4Experts(f"{base}.gate_proj.{_PARTS[part]}", file, stored, part, 0)
        up = MXFP4Experts(f"{base}.up_proj.{_PARTS[part]}", file, stored, part, 1)
        up._partner = gate
        out[gate.name] = (mx.contiguous(model[:, 0::2]), gate)
        out[up.name] = (mx.contiguous(model[:, 1::2]), up)
    return out
