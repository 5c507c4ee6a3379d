"""Splitting a mixture-of-experts feed-forward: by tensor or by expert.

A mixture-of-experts module (`models/moe.py`: a `router`, the experts stacked in
mlx-lm's `SwitchGLU` as `switch_mlp`, maybe a `shared_expert` FeedForward) is split
with three styles (which `kind_shard.table_styles` derives from the kind's split table,
`models/moe.py`):

- `ShardInPlace` keeps a range of a layer's weight in place (mlx's `shard_inplace`,
  with any ranges): rows or columns of every expert's (E, out, in) projection, whole
  experts (axis 0), or rows/columns of a plain linear layer (the shared expert). The
  layer's class and call are unchanged: its output is this rank's rows, or a partial
  sum over its columns.
- `ExpertRouting` (split by expert) makes `switch_mlp` take the global expert indices
  the router chose on every rank: the slots routed to this rank's experts are
  computed with their local index, the others weigh zero.
- `MoEParallel` sums the module's partial output over the group once, routed experts
  and shared expert together: one all-reduce per feed-forward, as a dense layer.

    split "tensor": gate/up rows and down columns of every expert (any rank count,
                    on quantization groups), the router replicated
    split "expert": whole experts per rank (E/N each, uneven when N does not divide
                    E), the router replicated; each rank applies its experts only

The shared expert is split like a dense feed-forward (its columns) in both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from .sequence import _rewrap, gather_input, scatter_output
from .styles import Layout, PlanError, Ranges, Split, Style, _check_layout, _ranges

Dim = Literal["rows", "columns", "experts", "heads", "channels"]


def _quantized(module: nn.Module) -> bool:
    return "scales" in module


# MXFP4 (gpt-oss's experts): 4-bit values with one uint8 exponent per 32, no biases;
# splits on whole groups as affine does
_SPLIT_MODES = ("affine", "mxfp4")


def _check_mode(module: nn.Module, path: str) -> None:
    mode = getattr(module, "mode", "affine")
    if _quantized(module) and mode not in _SPLIT_MODES:
        raise PlanError(
            f"{path}: quantization mode {mode!r} does not split (only {', '.join(_SPLIT_MODES)})"
        )


@dataclass(frozen=True)
class ShardInPlace(Style):
    """Keep units `ranges[r]` of a linear or stacked-experts layer's weight along `dim`
    ("rows": outputs; "columns": inputs, on quantization groups; "experts": axis 0 of an
    (E, out, in) weight; "heads": axis 0 of mlx-lm's per-head (H, out, in) MultiLinear;
    "channels": axis 0 of any weight and its bias, e.g. a depthwise conv's (C, K, 1)),
    in place. A rank's range may be several (start, stop) pairs, the segments of a fused
    tensor (q | k | v rows): their slices are kept, concatenated in order. x -> this
    rank's rows (rows), a partial sum (columns: the enclosing module's `MoEParallel`
    sums it), or the outputs of its
    experts (experts). A column split of stacked experts (gpt-oss's down projections)
    keeps their bias on the rank holding the first columns only, so that the sum adds it
    once; of a plain linear layer it refuses a bias."""

    dim: Dim
    ranges: Ranges

    def _axis(self, module: nn.Module) -> int:
        ndim = module["weight"].ndim
        axes = {"rows": ndim - 2, "columns": ndim - 1, "experts": 0, "heads": 0, "channels": 0}
        return axes[self.dim]

    def split(self, module: nn.Module, path: str, n: int) -> Split:
        if "weight" not in module or module["weight"].ndim not in (2, 3):
            raise PlanError(
                f"{path}: ShardInPlace applies to a linear or stacked-experts layer, "
                f"not {type(module).__name__}"
            )
        _check_mode(module, path)
        w = module["weight"]
        if self.dim in ("experts", "heads") and w.ndim != 3:
            raise PlanError(f"{path}: splitting by {self.dim} needs stacked (N, out, in) weights")
        if self.dim == "columns" and "bias" in module and w.ndim != 3:
            raise PlanError(f"{path}: a column split in place cannot keep a bias")
        axis = self._axis(module)
        total = w.shape[axis]
        unit = 1
        if self.dim == "columns" and _quantized(module):
            total = total * 32 // module.bits
            unit = module.group_size
        what = {"rows": "output rows", "columns": "input columns"}.get(self.dim, self.dim)
        if _segmented(self.ranges):
            for i in range(len(next(iter(_items(self.ranges)))[1])):
                _ranges({r: p[i] for r, p in _items(self.ranges)}, total, n, path, what, unit)
            return Split(axis, total, self.ranges, self.dim)
        ranges = _ranges(self.ranges, total, n, path, what, unit)
        return Split(axis, total, ranges, "cols" if self.dim == "columns" else self.dim)

    def describe(self, rank: int, n: int) -> str:
        return "whole"

    def apply(self, module, group, ctx, split):
        mine = split.ranges[group.rank()]
        pairs = mine if isinstance(mine[0], tuple) else (mine,)
        axis = split.axis
        for key in ("weight", "scales", "biases", "bias"):
            if key not in module:
                continue
            v = module[key]
            if key == "bias" and self.dim == "columns":
                if pairs[0][0] > 0:  # added once, by the rank holding column 0 (docstring)
                    module.pop("bias")
                continue
            if key == "bias":
                ax = axis if self.dim in ("experts", "heads", "channels") else v.ndim - 1
            else:
                ax = axis
            size = v.shape[ax]
            kept = []
            for a, b in pairs:
                index = [slice(None)] * v.ndim
                index[ax] = slice(size * a // split.total, size * b // split.total)
                kept.append(v[tuple(index)])
            # contiguous: a plain slice would keep the whole tensor alive once evaluated
            module[key] = mx.contiguous(kept[0] if len(kept) == 1 else mx.concatenate(kept, ax))
        return module


@dataclass(frozen=True)
class ExpertRouting(Style):
    """`switch_mlp` (mlx-lm's SwitchGLU, or SwitchMLP: Nemotron-H's) holding experts
    `ranges[r]` (its projections split with `ShardInPlace("experts", ...)`): called with
    the router's global indices (..., k), the slots on this rank's experts run with their
    local index and the others weigh zero: (..., k, dim), summed over the ranks by `MoEParallel`."""

    ranges: Ranges

    def split(self, module: nn.Module, path: str, n: int) -> None:
        glu, mlp = ("gate_proj", "up_proj", "down_proj"), ("fc1", "fc2")  # SwitchGLU, SwitchMLP
        found = next((ps for ps in (glu, mlp) if all(k in module for k in ps)), None)
        if found is None:
            raise PlanError(f"{path}: ExpertRouting applies to a SwitchGLU, not {type(module)}")
        total = module[found[0]]["weight"].shape[0]
        _ranges(self.ranges, total, n, path, "experts", 1)
        return None

    def describe(self, rank: int, n: int) -> str:
        try:
            a, b = self.ranges[rank]
        except (KeyError, IndexError):
            return "-"
        return f"experts {a}-{b - 1} [{b - a}]"

    def apply(self, module, group, ctx, split):
        a, b = self.ranges[group.rank()]
        object.__setattr__(module, "_experts", (a, b))

        def make(base: type) -> dict[str, Any]:
            def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
                first, stop = self._experts
                local = indices - first
                mine = (local >= 0) & (local < stop - first)
                y = base.__call__(self, x, mx.where(mine, local, 0))
                return y * mine[..., None].astype(y.dtype)

            return {"__call__": __call__}

        _rewrap(module, "ExpertRange", make)
        return module


@dataclass(frozen=True)
class MoEParallel(Style):
    """A mixture-of-experts module whose experts (and shared expert) hold partial
    outputs: its output is summed over the group (one all_sum). `input_layout=
    "sequence"` gathers the sequence chunks first; `output_layout="sequence"` keeps
    this rank's chunk of the sum (sequence parallelism)."""

    input_layout: Layout = "replicate"
    output_layout: Layout = "replicate"

    def split(self, module: nn.Module, path: str, n: int) -> None:
        _check_layout(self.input_layout, path, self)
        _check_layout(self.output_layout, path, self)
        if "switch_mlp" not in module:
            raise PlanError(f"{path}: MoEParallel applies to a mixture-of-experts module")
        return None

    def describe(self, rank: int, n: int) -> str:
        return "sums over the ranks"

    def apply(self, module, group, ctx, split):
        object.__setattr__(module, "_group", group)

        def make(base: type) -> dict[str, Any]:
            def __call__(self, x: mx.array) -> mx.array:
                return mx.distributed.all_sum(base.__call__(self, x), group=self._group)

            return {"__call__": __call__}

        _rewrap(module, "Summed", make)
        if self.input_layout == "sequence":
            gather_input(module, ctx)
        if self.output_layout == "sequence":
            scatter_output(module, ctx)
        return module


def _items(ranges: Any):
    return ranges.items() if isinstance(ranges, Mapping) else enumerate(ranges)


def _segmented(ranges: Any) -> bool:
    """Whether each rank's range is several (start, stop) pairs (a fused tensor's)."""
    first = next(iter(_items(ranges)), (None, None))[1]
    return first is not None and len(first) > 0 and isinstance(first[0], tuple | list)
