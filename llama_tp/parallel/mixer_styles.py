"""The styles of a mixer module itself, beside its tensors' (`kind_shard.table_styles`
gives both from the kind's split table): `AttentionHeads`, an attention module's local
head counts and KV map; `LocalUnits`, a kind's own local counts and per-unit vectors.
Both take the partition's parts (None: N equal blocks) and leave the module in place."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .partition import RankPart, kv_map
from .sequence import gather_input
from .styles import Layout, PlanError, Split, Style

Parts = Sequence[RankPart] | Mapping[int, RankPart]


def by_rank(parts: Parts) -> dict[int, RankPart]:
    """The parts by their rank."""
    return dict(parts) if isinstance(parts, Mapping) else {p.rank: p for p in parts}


@dataclass(frozen=True)
class AttentionHeads(Style):
    """An attention module's local head counts (and, where a rank's query heads do not
    map onto its KV heads as plain GQA, the KV map) from the partition plan's `parts`;
    None: N equal blocks of query and KV heads. `input_layout="sequence"` gathers the
    sequence chunks first. Goes with `ColwiseParallel` on wq/wk/wv and `RowwiseParallel`
    on wo over the same heads; attention sinks (gpt-oss) are sliced to the local heads,
    and a module with `take_heads` (full-width q/k norms) is given its heads' ranges and
    which of its KV heads no lower rank holds (it counts those in its norms' sums).
    A module whose KV heads are a unit of its own (`kv_unit`, Gemma 4's global KV heads)
    takes that unit's range, and its KV map from its query heads; one whose query heads
    are too (`q_unit`, Step-3.5's sliding layers) takes that unit's range of them."""

    parts: Parts | None = None
    input_layout: Layout = "replicate"

    def split(self, module: nn.Module, path: str, n: int) -> None:
        if not all(hasattr(module, a) for a in ("n_heads", "n_kv_heads", "head_dim")):
            raise PlanError(f"{path}: AttentionHeads applies to attention, not {type(module)}")
        if self.parts is None and module.n_kv_heads % n:
            where = f"{path}: " if path else ""
            raise PlanError(
                f"{where}cannot split {module.n_kv_heads} KV heads evenly over {n} ranks"
            )
        return None

    def describe(self, rank: int, n: int) -> str:
        if self.parts is None:
            return f"heads 1/{n}"
        part = by_rank(self.parts).get(rank)
        if part is None:
            return "-"
        q, kv = part.q_heads, part.kv_heads
        return f"q {q.start}-{q.stop - 1} kv {kv.start}-{kv.stop - 1}"

    def apply(self, module, group: mx.distributed.Group, ctx, split: Split | None):
        counted = 0  # local KV heads before this rank's first held by no lower rank
        if self.parts is None:
            module.n_heads //= group.size()
            module.n_kv_heads //= group.size()
            first = group.rank() * module.n_heads
            kv = range(group.rank() * module.n_kv_heads, (group.rank() + 1) * module.n_kv_heads)
        else:
            part = by_rank(self.parts)[group.rank()]
            unit = getattr(module, "kv_unit", "kv_heads")
            q_unit = getattr(module, "q_unit", "q_heads")
            q = part.q_heads if q_unit == "q_heads" else part.unit(q_unit)
            kv, local = part.kv_heads, part.kv_map
            if unit != "kv_heads" or q_unit != "q_heads":
                kv = part.unit(unit)
                local = kv_map(q, kv, module.n_heads // module.n_kv_heads)
            module.n_heads, module.n_kv_heads = len(q), len(kv)
            first = q.start
            if local is not None:
                object.__setattr__(module, "_kv_index", mx.array(local, dtype=mx.int32))
            below = [p.unit(unit).stop for p in by_rank(self.parts).values() if p.rank < part.rank]
            counted = min(len(kv), max(0, max(below, default=0) - kv.start))
        if "sinks" in module:  # gpt-oss: each query head's sink logit goes with its head
            module.sinks = mx.contiguous(module.sinks[first : first + module.n_heads])
        if hasattr(module, "take_heads"):  # MiniMax's full-width q/k norms (wide_qk_norm.py)
            module.take_heads(group, range(first, first + module.n_heads), kv, counted)
        if self.input_layout == "sequence":
            # The queries go in sequence chunks too (see `gather_input`).
            gather_input(module, ctx, query_chunks=True)
        return module


@dataclass(frozen=True)
class LocalUnits(Style):
    """A mixer of a kind with its own units (`SplitTable.module == "units"`): on each
    rank, its attributes `local` (attribute, ((unit, width), ...)) become the sum of this
    rank's count of each unit times its width (e.g. `num_k_heads`, `key_dim`, a conv's
    `conv1d.groups` = 2 key dims + the value dim), and its 1-D parameters `vectors`
    (parameter, unit, width) keep this rank's values (e.g. `A_log`, `dt_bias` per value
    head; a path under it: `norm.weight`); a module with `take_units(group)` is told
    its group once split. `parts` None: N equal blocks. `input_layout="sequence"` gathers
    the sequence chunks first."""

    local: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()
    vectors: tuple[tuple[str, str, int], ...] = ()
    parts: Parts | None = None
    input_layout: Layout = "replicate"

    def split(self, module: nn.Module, path: str, n: int) -> None:
        for attr, _ in self.local:
            target = _owner(module, attr)
            if target is None:
                raise PlanError(f"{path}: {type(module).__name__} has no attribute {attr!r}")
            if self.parts is None and getattr(target, attr.rpartition(".")[2]) % n:
                raise PlanError(f"{path}: cannot split {attr} evenly over {n} ranks")
        for name, _, _ in self.vectors:
            if _owner(module, name) is None:
                raise PlanError(f"{path}: {type(module).__name__} has no parameter {name!r}")
        return None

    def _count(self, terms, total: int, group: mx.distributed.Group) -> int:
        if self.parts is None:
            return total // group.size()
        part = by_rank(self.parts)[group.rank()]
        return sum(len(part.unit(u)) * w for u, w in terms)

    def apply(self, module, group, ctx, split):
        for attr, terms in self.local:
            target, name = _owner(module, attr), attr.rpartition(".")[2]
            setattr(target, name, self._count(terms, getattr(target, name), group))
        for name, unit, width in self.vectors:
            owner, key = _owner(module, name), name.rpartition(".")[2]  # ("norm.weight")
            v = owner[key]
            if self.parts is None:
                b = v.shape[0] // group.size()
                a, b = group.rank() * b, (group.rank() + 1) * b
            else:
                r = by_rank(self.parts)[group.rank()].unit(unit)
                a, b = r.start * width, r.stop * width
            owner[key] = mx.contiguous(v[a:b])
        if hasattr(module, "take_units"):  # after the split (Mamba-2's norm over the ranks)
            module.take_units(group)
        if self.input_layout == "sequence":
            gather_input(module, ctx)
        return module


def _owner(module: nn.Module, attr: str) -> object | None:
    """The object holding attribute `attr` ('conv1d.groups': the module's conv1d)."""
    *path, name = attr.split(".")
    target: object = module
    for p in path:
        target = target.get(p) if isinstance(target, dict) else getattr(target, p, None)
    return target if target is not None and hasattr(target, name) else None
