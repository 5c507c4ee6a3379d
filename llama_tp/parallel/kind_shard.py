"""A kind's split table and a rank's part -> the kind's sharded layers.

Every layer kind declares one `SplitTable` (`splits.py`); this module turns it into the
parallel styles of the kind's modules (`table_styles`) and applies them: the kinds'
`shard(group, part)` (`ShardedByTable`, which every kind in `llama_tp/models/` has) is the
one place that swaps a kind's projections for all-to-sharded / sharded-to-all layers,
mlx's `shard_linear` where the split is N equal blocks, the range layers of `layers.py`
elsewhere. `part` is what the rank holds:

    None                      N equal blocks (the design card's `Attention.shard(group)`)
    RankPart                  this rank's ranges, alone
    PlanPart(plan, sequence)  its part of the placement's partition, with what a lone part
                              lacks (every rank's parts, the units' totals, whether the
                              plan is mlx's even split, the experts' split) and the
                              model's sequence-parallel context: the loader's

The built-in plan's table (`llama_plan`, what `plan` prints) is made by the same
`plan_styles`, so the table shows exactly what the kinds' `shard` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .experts import ExpertRouting, MoEParallel, ShardInPlace
from .mixer_styles import AttentionHeads, LocalUnits, Parts, by_rank
from .parallelize import parallelize
from .partition import Plan, RankPart
from .sequence import SequenceContext
from .splits import CHANNELS, COLUMNS, HEADS, ROWS, VECTOR, SplitTable
from .styles import ColwiseParallel, Layout, PlanError, PrepareModuleInput, RowwiseParallel, Style


def _unit_ranges(by: Mapping[int, RankPart] | None, unit: str, width: int, offset: int = 0):
    if by is None:
        return None
    out = {}
    for r, p in by.items():
        u = p.unit(unit)
        out[r] = (offset + u.start * width, offset + u.stop * width)
    return out


def _segment_ranges(by: Mapping[int, RankPart], e, totals: Mapping[str, int]):
    """Each rank's (start, stop) in every segment of a fused tensor, in logical units."""
    out: dict[int, tuple[tuple[int, int], ...]] = {r: () for r in by}
    offset = 0
    for s in e.sections():
        for r, rng in _unit_ranges(by, s.unit, s.width, offset).items():
            out[r] += (rng,)
        offset += totals[s.unit] * s.width
    return out


def table_styles(
    table: SplitTable,
    parts: Parts | None = None,
    sequence: bool = False,
    moe_split: str = "tensor",
    totals: Mapping[str, int] | None = None,
) -> dict[str, Style]:
    """The styles of one mixer, by path relative to it ("" is the mixer), from its kind's
    split table and the partition's `parts` (None: N equal blocks, mlx's `shard_linear`):

        rows (not in place)       ColwiseParallel    this rank's rows, no communication
        columns (not in place)    RowwiseParallel    its columns, one all-reduce
        in place, heads, segments ShardInPlace       kept in place: the mixer sums once
        stacked, split by expert  ShardInPlace("experts") + ExpertRouting on the stack
        the mixer                 AttentionHeads ("heads"), MoEParallel ("summed"),
                                  LocalUnits ("units"), PrepareModuleInput (sequence)

    `totals`: each unit's total (the plan's), for fused tensors' segment offsets."""
    layout: Layout = "sequence" if sequence else "replicate"
    by = None if parts is None else by_rank(parts)
    styles: dict[str, Style] = {}
    if table.module == "heads":
        styles[""] = AttentionHeads(parts, input_layout=layout)
    elif table.module == "summed":
        styles[""] = MoEParallel(layout, layout)
    elif table.module == "units":
        vectors = tuple((k, e.unit, e.width) for k, e in table.tensors.items() if e.dim == VECTOR)
        local = tuple((k, tuple(terms)) for k, terms in table.local.items())
        styles[""] = LocalUnits(local, vectors, parts, input_layout=layout)
    elif sequence:
        styles[""] = PrepareModuleInput()
    for path, e in table.tensors.items():
        if e.dim == VECTOR:
            continue  # sliced by the mixer's own style
        if by is None and (e.in_place or e.dim == HEADS or e.segments):
            raise PlanError(f"{table.kind}: {path} splits in place: the styles need the parts")
        if e.stacked and moe_split == "expert":
            experts = _unit_ranges(by, "experts", 1)
            styles.setdefault(path.rpartition(".")[0], ExpertRouting(experts))
            styles[path] = ShardInPlace("experts", experts)
        elif e.segments:
            dim = "channels" if e.dim in (ROWS, CHANNELS) else e.dim
            styles[path] = ShardInPlace(dim, _segment_ranges(by, e, totals or {}))
        elif e.dim == HEADS:
            styles[path] = ShardInPlace("heads", _unit_ranges(by, e.unit, 1))
        elif e.in_place or e.dim == CHANNELS:
            styles[path] = ShardInPlace(e.dim, _unit_ranges(by, e.unit, e.width))
        elif e.dim == ROWS:
            styles[path] = ColwiseParallel(_unit_ranges(by, e.unit, e.width))
        elif e.dim == COLUMNS:
            styles[path] = RowwiseParallel(_unit_ranges(by, e.unit, e.width), output_layout=layout)
    return styles


@dataclass(frozen=True)
class PlanPart:
    """A rank's part of every layer as the partition `plan` gives it (the rank is its
    group's), for a kind's `shard`: with every rank's part (a kind whose split depends on
    what lower ranks hold: full-width q/k norms), each unit's total (a fused tensor's
    segments), the experts' split; and `sequence`, the model's sequence-parallel context
    (one per model: the embedding starts each pass, the kinds' layers gather and
    scatter by it), None without sequence parallelism."""

    plan: Plan
    sequence: SequenceContext | None = None


def _even(p: Plan, unit: str) -> bool:
    """Whether the plan splits `unit` in N equal blocks mlx's `shard_linear` makes."""
    return {"q_heads": p.even_attention, "kv_heads": p.even_attention, "ffn": p.even_ffn}.get(
        unit, False
    )


def plan_styles(table: SplitTable, plan: Plan, sequence: bool = False) -> dict[str, Style]:
    """The styles of a kind of `table` under the partition `plan` (by path under the
    mixer): without ranges where the plan is N equal blocks of every unit the table
    splits by and the kind takes mlx's `shard_linear` then (`plain_when_even`), the plan's
    ranges elsewhere; `sequence`: its input arrives in sequence chunks."""
    even = table.plain_when_even and all(_even(plan, u) for u in table.unit_names())
    moe_split = plan.experts.split if plan.experts else "tensor"
    totals = {u: plan.total(u) for u in table.unit_names()}
    return table_styles(table, None if even else plan.parts, sequence, moe_split, totals)


def holds(module: nn.Module, path: str) -> bool:
    """Whether `module` has a submodule at `path` ("": itself; a KV-shared layer has no
    wk, which its kind's table names)."""
    for part in path.split(".") if path else ():
        if not isinstance(module, nn.Module) or part not in module:
            return False
        module = module[part]
    return True


def shard_by_table(
    module: nn.Module,
    table: SplitTable,
    group: mx.distributed.Group,
    part: RankPart | PlanPart | None = None,
) -> None:
    """Split `module` (a kind of split table `table`) over `group` as `part` says (see the
    module docstring): its projections swapped for sharded layers, in-place tensors
    sliced, the module's own counts set, through `parallelize` (the whole table checked
    before anything changes)."""
    sequence = None
    if part is None:
        styles = table_styles(table)
    elif isinstance(part, RankPart):
        styles = table_styles(table, {group.rank(): part})
    else:
        styles = plan_styles(table, part.plan, part.sequence is not None)
        sequence = part.sequence
    styles = {path: s for path, s in styles.items() if holds(module, path)}
    parallelize(module, styles, group, sequence)


class ShardedByTable:
    """What every layer kind has (mixed into its class): `shard(group, part)`, its split
    table (`split_table(self.args)`) applied to itself by `shard_by_table`."""

    args: Any  # the ModelArgs the kind was built from

    def shard(self, group: mx.distributed.Group, part: RankPart | PlanPart | None = None) -> None:
        """Split this kind's tensors over `group`: projections by rows (all-to-sharded) or
        columns (sharded-to-all, one all-reduce), in-place tensors sliced, as its split
        table says; `part` None: N equal blocks (mlx's `shard_linear`); a `RankPart`:
        this rank's ranges; a `PlanPart`: the placement's (the loader's)."""
        shard_by_table(self, type(self).split_table(self.args), group, part)
