"""Parallel styles: how one module of a model is split over a group (after PyTorch's
`ParallelStyle`s, built on mlx's `shard_linear` and this package's range layers).

A style is a small frozen dataclass. `parallelize` asks each style for its `split`
(which part of the module's weight every rank keeps: validated against the module
before anything changes, and used to read only those bytes from a checkpoint), then
`apply`s it. Layouts are "replicate" (every rank holds the whole activation) or
"sequence" (each rank holds its chunk of the sequence; see `sequence.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from ..kernels.layers import GGUFEmbedding, GGUFLinear
from .layers import shard_linear_range
from .partition import vocab_ranges
from .sequence import SequenceContext, gather_input, scatter_output
from .vocab import VocabParallelEmbedding

Layout = Literal["replicate", "sequence"]
# Each rank's [start, stop) along the split axis, indexed by rank: a sequence of N
# pairs, or a mapping holding at least the applying rank's pair.
Ranges = Sequence[tuple[int, int]] | Mapping[int, tuple[int, int]]


class PlanError(ValueError):
    """A plan that does not fit the model: names the path and the reason."""


@dataclass(frozen=True)
class Split:
    """What each rank keeps of a module's weight: `ranges[rank]` of `total` units on
    `axis` (0: output rows, 1: input columns of a (out, in) weight)."""

    axis: int
    total: int
    ranges: Ranges
    what: str | None = None  # its units in the plan table (default: rows, or cols off axis 0)

    def tensor_slice(self, shape: tuple[int, ...], rank: int):
        """(axis, start, stop) of a stored tensor (packed or not), one per segment of a
        fused tensor's (several (start, stop) pairs a rank); None: held whole."""
        if len(shape) <= self.axis:
            return None  # a bias of a sharded-to-all layer: added once, whole
        size = shape[self.axis]
        out = tuple(
            (self.axis, size * a // self.total, size * b // self.total)
            for a, b in self._pairs(rank)
        )
        return out[0] if len(out) == 1 else out

    def _pairs(self, rank: int) -> tuple[tuple[int, int], ...]:
        got = self.ranges[rank]
        return tuple(got) if isinstance(got[0], tuple | list) else (tuple(got),)

    def describe(self, rank: int) -> str:
        try:
            pairs = self._pairs(rank)
        except (KeyError, IndexError):
            return "-"
        what = self.what or ("rows" if self.axis == 0 else "cols")
        spans = " + ".join(f"{a}-{b - 1}" for a, b in pairs)
        return f"{what} {spans} [{sum(b - a for a, b in pairs)}]"


def _check_layout(layout: str, path: str, style: Style) -> None:
    if layout not in ("replicate", "sequence"):
        raise PlanError(f"{path}: {style!r}: layout must be 'replicate' or 'sequence'")


class Style:
    """Base: a style that keeps the module whole (see `Replicate`)."""

    def split(self, module: nn.Module, path: str, n: int) -> Split | None:
        """Check that the style applies to `module` over `n` ranks; what each rank keeps."""
        return None

    def apply(
        self, module: nn.Module, group: mx.distributed.Group, ctx: SequenceContext, split: Split
    ) -> nn.Module:
        """The module to put in `module`'s place on this rank (maybe `module` itself)."""
        return module

    def describe(self, rank: int, n: int) -> str:
        """What rank `rank` holds of a module this style keeps unsplit."""
        return "whole"

    def label(self) -> str:
        """Class name and the options that differ from the defaults (ranges: just named)."""
        opts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                opts.append(f.name if f.name in ("ranges", "parts") else f"{f.name}={v!r}")
        return f"{type(self).__name__}({', '.join(opts)})"


def _linear_dims(module: nn.Module, path: str, style: Style) -> tuple[int, int]:
    """(output, logical input) dims of a plain or quantized linear layer."""
    if isinstance(module, nn.QuantizedLinear):
        out, packed = module.weight.shape
        return out, packed * 32 // module.bits
    if isinstance(module, GGUFLinear):
        return module.output_dims, module.input_dims
    if isinstance(module, nn.Linear):
        return tuple(module.weight.shape)
    raise PlanError(
        f"{path}: {type(style).__name__} applies to nn.Linear or nn.QuantizedLinear, "
        f"not {type(module).__name__}"
    )


def _ranges(ranges: Ranges | None, total: int, n: int, path: str, what: str, unit: int) -> Ranges:
    """Checked ranges; None: N equal blocks (each a multiple of `unit`)."""
    if ranges is None:
        if total % n or (total // n) % unit:
            per = f" of {unit}-wide groups" if unit > 1 else ""
            raise PlanError(
                f"{path}: cannot split {total} {what} evenly{per} over {n} ranks; "
                "give the style explicit ranges"
            )
        b = total // n
        return tuple((i * b, (i + 1) * b) for i in range(n))
    if not isinstance(ranges, Mapping) and len(ranges) != n:
        raise PlanError(f"{path}: {len(ranges)} ranges for {n} ranks")
    items = ranges.items() if isinstance(ranges, Mapping) else enumerate(ranges)
    for r, (a, b) in items:
        if not 0 <= a < b <= total or a % unit or (b % unit and b != total):
            raise PlanError(
                f"{path}: rank {r}'s range [{a}, {b}) of {total} {what} is empty, out of "
                f"bounds or not on {unit}-wide quantization groups"
            )
    return ranges


@dataclass(frozen=True)
class Replicate(Style):
    """Every rank keeps the whole module (and reads its whole tensors). Layouts for
    sequence parallelism without a vocabulary-parallel embedding and head: an
    embedding with `output_layout="sequence"` keeps its rank's chunk; a head with
    `input_layout="sequence"` gathers the chunks first."""

    input_layout: Layout = "replicate"
    output_layout: Layout = "replicate"

    def split(self, module: nn.Module, path: str, n: int) -> None:
        _check_layout(self.input_layout, path, self)
        _check_layout(self.output_layout, path, self)
        return None

    def apply(self, module, group, ctx, split):
        if self.input_layout == "sequence":
            gather_input(module, ctx)
        if self.output_layout == "sequence":
            embedding = isinstance(module, nn.Embedding | nn.QuantizedEmbedding)
            scatter_output(module, ctx, begins=embedding)
        return module


@dataclass(frozen=True)
class ColwiseParallel(Style):
    """All-to-sharded linear: rank r keeps output rows `ranges[r]` (default: N equal
    blocks, mlx's `shard_linear`). x (..., in) whole -> (..., rows of r), no
    communication. `input_layout="sequence"` gathers the sequence chunks first."""

    ranges: Ranges | None = None
    input_layout: Layout = "replicate"

    def split(self, module: nn.Module, path: str, n: int) -> Split:
        _check_layout(self.input_layout, path, self)
        out, _ = _linear_dims(module, path, self)
        return Split(0, out, _ranges(self.ranges, out, n, path, "output rows", 1))

    def apply(self, module, group, ctx, split):
        if self.ranges is None and not isinstance(module, GGUFLinear):
            new = shard_linear(module, "all-to-sharded", group=group)
        else:
            a, b = split.ranges[group.rank()]
            new = shard_linear_range(module, "all-to-sharded", a, b, group)
        if self.input_layout == "sequence":
            gather_input(new, ctx)
        return new


@dataclass(frozen=True)
class RowwiseParallel(Style):
    """Sharded-to-all linear: rank r keeps input columns `ranges[r]` (default: N equal
    blocks, mlx's `shard_linear`); x (..., cols of r) -> (..., out) summed over the
    group (one all_sum). `output_layout="sequence"`: a reduce-scatter over the sequence
    instead, each rank keeping its chunk. Quantized: ranges on group boundaries."""

    ranges: Ranges | None = None
    output_layout: Layout = "replicate"

    def split(self, module: nn.Module, path: str, n: int) -> Split:
        _check_layout(self.output_layout, path, self)
        _, in_dims = _linear_dims(module, path, self)
        unit = getattr(module, "group_size", 1) if isinstance(module, nn.QuantizedLinear) else 1
        return Split(1, in_dims, _ranges(self.ranges, in_dims, n, path, "input columns", unit))

    def apply(self, module, group, ctx, split):
        if self.ranges is None and not isinstance(module, GGUFLinear):
            new = shard_linear(module, "sharded-to-all", group=group)
        else:
            a, b = split.ranges[group.rank()]
            new = shard_linear_range(module, "sharded-to-all", a, b, group)
        if self.output_layout == "sequence":
            scatter_output(new, ctx)
        return new


@dataclass(frozen=True)
class VocabParallel(Style):
    """Vocabulary rows `ranges[r]` (default: as even as possible, any vocabulary size).

    On an embedding (plain or quantized): ids (B, L) -> vectors (B, L, dim) completed
    by one all_sum; `output_layout="sequence"` keeps this rank's sequence chunk (and,
    tied, gathers before the head). On a linear output head: x (..., dim) -> this rank's
    logits (..., rows), no communication; `input_layout="sequence"` gathers first.
    """

    ranges: Ranges | None = None
    input_layout: Layout = "replicate"
    output_layout: Layout = "replicate"

    def split(self, module: nn.Module, path: str, n: int) -> Split:
        _check_layout(self.input_layout, path, self)
        _check_layout(self.output_layout, path, self)
        if isinstance(module, nn.Embedding | nn.QuantizedEmbedding | GGUFEmbedding):
            vocab = module.weight.shape[0]
        elif isinstance(module, nn.Linear | nn.QuantizedLinear | GGUFLinear):
            vocab = module.weight.shape[0]
        else:
            raise PlanError(
                f"{path}: {type(self).__name__} applies to an embedding or a linear head, "
                f"not {type(module).__name__}"
            )
        ranges = self.ranges
        if ranges is None:
            if n > vocab:
                raise PlanError(f"{path}: cannot split a vocabulary of {vocab} over {n} ranks")
            ranges = tuple((r.start, r.stop) for r in vocab_ranges(vocab, n))
        return Split(0, vocab, _ranges(ranges, vocab, n, path, "vocabulary rows", 1))

    def apply(self, module, group, ctx, split):
        a, b = split.ranges[group.rank()]
        if isinstance(module, nn.Embedding | nn.QuantizedEmbedding | GGUFEmbedding):
            n = group.size()
            # every rank's rows, when the plan says them all (the samplers need them)
            known = not isinstance(split.ranges, Mapping) or all(
                r in split.ranges for r in range(n)
            )
            rows = tuple(tuple(split.ranges[r]) for r in range(n)) if known else None
            new = VocabParallelEmbedding(module, a, b, group, rows)
            if self.output_layout == "sequence":
                scatter_output(new, ctx, begins=True)
            return new
        new = shard_linear_range(module, "all-to-sharded", a, b, group)
        if self.input_layout == "sequence":
            gather_input(new, ctx)
        return new


@dataclass(frozen=True)
class LossParallel(VocabParallel):
    """The output head's logits stay sharded by vocabulary (PyTorch's loss parallel):
    log-probabilities, perplexity and sampling work on each rank's (..., rows) with a
    distributed log-sum-exp (`engine.sampling.VocabShard`), never gathering (B, L, V).
    On a tied model, state it on the embedding (it is the head)."""


@dataclass(frozen=True)
class SequenceParallel(Style):
    """A per-position module (RMSNorm, LayerNorm) run on this rank's sequence chunk:
    (B, Lc, dim) -> (B, Lc, dim). Nothing to split or communicate: the neighbouring
    styles' layouts (a "sequence" output before it, a gather after) make the chunks."""

    def split(self, module: nn.Module, path: str, n: int) -> None:
        if not isinstance(module, nn.RMSNorm | nn.LayerNorm):
            raise PlanError(
                f"{path}: SequenceParallel applies to nn.RMSNorm or nn.LayerNorm, "
                f"not {type(module).__name__}"
            )
        return None

    def describe(self, rank: int, n: int) -> str:
        return f"whole, runs on L/{n}"


@dataclass(frozen=True)
class PrepareModuleInput(Style):
    """The module's first input arrives as sequence chunks and is gathered whole (one
    all_gather) before the module runs: e.g. attention and feed-forward under sequence
    parallelism, so that wq/wk/wv (w1/w3) share one gather."""

    input_layout: Layout = "sequence"

    def split(self, module: nn.Module, path: str, n: int) -> None:
        _check_layout(self.input_layout, path, self)
        return None

    def describe(self, rank: int, n: int) -> str:
        return "gathers L" if self.input_layout == "sequence" else "whole"

    def apply(self, module, group, ctx, split):
        if self.input_layout == "sequence":
            gather_input(module, ctx)
        return module
