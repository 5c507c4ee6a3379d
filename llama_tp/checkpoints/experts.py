"""Mixture-of-experts tensors in checkpoints: per-expert tensors stacked, and their checks.

Hugging Face checkpoints store each expert's projections as their own tensors
(`model.layers.3.mlp.experts.17.gate_proj.weight`); the model holds them stacked,
(E, out, in) (mlx-lm's `SwitchGLU`, as MLX folders and GGUF files store them). A
`StackedExperts` source reads the stack without ever making it: whole experts
(a split by expert reads only its own experts' tensors), or the same slice of every
expert's tensor (a split by tensor), each read in slices from its file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from .base import CheckpointError

# HF per-expert names: (stack prefix, expert, projection, part)
_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe))\.experts\.(\d+)\.(\w+)\.(weight|scales|biases)$"
)
# Mixtral's expert projections by their Meta names
_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def per_expert(name: str) -> tuple[str, int] | None:
    """`model.layers.3.mlp.experts.17.gate_proj.weight` -> (the stacked tensor's HF name
    `model.layers.3.mlp.switch_mlp.gate_proj.weight`, 17); None for other tensors."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    prefix, expert, proj, part = m.groups()
    return f"{prefix}.switch_mlp.{_PROJECTIONS.get(proj, proj)}.{part}", int(expert)


@dataclass(frozen=True)
class _Info:
    shape: tuple[int, ...]


class StackedExperts:
    """One (E, ...) tensor made of E per-expert tensors, each `(file, stored name)` of a
    sliced reader (`SafetensorsFile`): `read` as the sliced readers do."""

    def __init__(self, name: str, parts: list[tuple[Any, str]]):
        self.name, self.parts = name, parts
        first = parts[0][0].tensors[parts[0][1]]
        for f, stored in parts:
            if f.tensors[stored].shape != first.shape:
                raise CheckpointError(
                    f"{f.path}: {stored} has shape {list(f.tensors[stored].shape)}, "
                    f"expert 0's is {list(first.shape)}"
                )
        self.tensors = {name: _Info((len(parts), *first.shape))}

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        """The stack, whole (`axis` None) or its slice [start, stop) along `axis`."""
        if axis is None:
            return mx.stack([f.read(s) for f, s in self.parts])
        if axis == 0:
            return mx.stack([f.read(s) for f, s in self.parts[start:stop]])
        return mx.stack([f.read(s, axis - 1, start, stop) for f, s in self.parts])


def stack_experts(
    found: dict[str, dict[int, tuple[Any, str, mx.array]]], path: Path
) -> dict[str, tuple[mx.array, StackedExperts]]:
    """HF stacked name -> (the lazy stack, its source) for per-expert tensors grouped as
    stacked name -> {expert: (file, stored name, lazy tensor)}; experts 0..E-1 complete."""
    out = {}
    for name, experts in found.items():
        missing = sorted(set(range(max(experts) + 1)) - set(experts))
        if missing:
            raise CheckpointError(
                f"{path}: {name.replace('switch_mlp', 'experts.N')}: expert {missing[0]} "
                f"is missing ({len(experts)} of {max(experts) + 1} present)"
            )
        parts = [experts[e] for e in range(len(experts))]
        lazy = mx.stack([v for _, _, v in parts])  # never evaluated: the source reads it
        out[name] = (lazy, StackedExperts(name, [(f, s) for f, s, _ in parts]))
    return out


def check_experts(
    args: Any,
    shapes: dict[str, tuple[int, ...]],
    where: str,
    stored: dict[str, str] | None = None,
    count: str = "the config's expert count",
) -> None:
    """One line with the numbers when a stacked expert tensor disagrees with the config:
    its expert count, or its rows (gate/up: the expert width; down: the model width).
    `shapes`: the model's tensor names -> stored shapes; `where` names the file;
    `stored`: the file's own tensor names (for the message); `count`: where the expert
    count comes from (e.g. `qwen3moe.expert_count`)."""
    if not args.n_experts:
        if any(".switch_mlp." in k for k in shapes):
            raise CheckpointError(f"{where}: expert tensors, but {count} is 0")
        return
    for name, shape in sorted(shapes.items()):  # in name order: the same message each time
        m = re.match(r"^layers\.(\d+)\.(?:feed_forward|experts)\.switch_mlp\.(\w+)\.weight$", name)
        if m is None:
            continue
        label = (stored or {}).get(name, name)
        if len(shape) != 3 or shape[0] != args.n_experts:
            held = shape[0] if len(shape) == 3 else f"shape {list(shape)}"
            raise CheckpointError(
                f"{where}: {label} holds {held} experts but {count} is {args.n_experts}"
            )
        # (Kimi K3's latent experts run in their own width, not the model's)
        width = args.extra.get("routed_expert_hidden_size") or args.dim
        rows = width if m.group(2) == "down_proj" else args.moe_hidden_dim
        if shape[1] != rows:
            what = "model width" if width == args.dim else "experts' latent width"
            what = what if m.group(2) == "down_proj" else "expert width"
            raise CheckpointError(
                f"{where}: {label} has {shape[1]} rows per expert but the {what} is {rows}"
            )
