"""The built-in plan: one table from module paths to parallel styles.

Made from the partition plan (`partition.make_plan`) and each layer's split tables
(`splits.py`, the kinds' declarations: `table_styles` turns a table into styles):
where N divides the heads or columns the styles take no ranges (mlx's `shard_linear`,
the design's even split), elsewhere each rank's explicit range. Works on the model by
its attribute names and its layers' `spec`, so this package never imports
`llama_tp.model`. For SmolLM2 (9 query / 3 KV heads, untied) on 2 ranks,
`llama_plan(model, 2)` is:

    layers.*.attention            AttentionHeads(parts)
    layers.*.attention.wq|wk|wv   ColwiseParallel(ranges)   rows of heads 0-5 | 6-8
    layers.*.attention.wo         RowwiseParallel(ranges)   columns of the same heads
    layers.*.feed_forward.w1|w3   ColwiseParallel()         rows 0-767 | 768-1535
    layers.*.feed_forward.w2      RowwiseParallel()
    layers.*.attention_norm, layers.*.ffn_norm, norm        Replicate()
    tok_embeddings                VocabParallel()
    output                        LossParallel()

With `sequence_parallel` the norms become `SequenceParallel()`, the embedding's output
and `wo`/`w2`'s outputs take the "sequence" layout, attention and feed-forward gather
their input first, and the head gathers before the logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .experts import ExpertRouting, MoEParallel, ShardInPlace
from .partition import Plan, RankPart, kv_map
from .placement import ModelShape, partition
from .sequence import gather_input
from .splits import CHANNELS, COLUMNS, HEADS, ROWS, VECTOR, SplitTable
from .styles import (
    ColwiseParallel,
    Layout,
    LossParallel,
    PlanError,
    PrepareModuleInput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Split,
    Style,
    VocabParallel,
)

Parts = Sequence[RankPart] | Mapping[int, RankPart]


def model_shape_of(model: nn.Module) -> ModelShape:
    """The placement's view of a built (lazy) model: its args and parameter shapes, as the
    checkpoint it was built from stores them (`checkpoints.slices.model_shape`)."""
    tensors = {k: (tuple(v.shape), v.nbytes) for k, v in tree_flatten(model.parameters())}
    specs = tuple(layer.spec for layer in model.layers)
    return ModelShape(model.args, tensors, getattr(model, "ffn_block", None), specs)


def plan_for(model: nn.Module, n: int, moe_split: str = "tensor") -> Plan:
    """The partition of `model`'s layers over `n` ranks (`placement.partition`)."""
    return partition(model_shape_of(model), n, moe_split)


def _by_rank(parts: Parts) -> dict[int, RankPart]:
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
        part = _by_rank(self.parts).get(rank)
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
            part = _by_rank(self.parts)[group.rank()]
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
            below = [p.unit(unit).stop for p in _by_rank(self.parts).values() if p.rank < part.rank]
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
        part = _by_rank(self.parts)[group.rank()]
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
                r = _by_rank(self.parts)[group.rank()].unit(unit)
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
    by = None if parts is None else _by_rank(parts)
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


def _under(prefix: str, styles: dict[str, Style]) -> dict[str, Style]:
    return {f"{prefix}.{k}" if k else prefix: v for k, v in styles.items()}


def _even(p: Plan, unit: str) -> bool:
    """Whether the plan splits `unit` in N equal blocks mlx's `shard_linear` makes."""
    return {"q_heads": p.even_attention, "kv_heads": p.even_attention, "ffn": p.even_ffn}.get(
        unit, False
    )


def _mixer_table(model: nn.Module, p: Plan, sequence: bool) -> dict[str, Style]:
    """The mixers' entries: each layer's kinds by their split tables. A mixer path
    whose layers differ in kind (dense and expert feed-forwards; attention and a
    recurrent mixer) names each layer's module entry by its index (a wildcard would
    match both kinds); tensor entries keep the wildcard (the kinds' names differ)."""
    moe_split = p.experts.split if p.experts else "tensor"
    totals = {u: p.total(u) for u in _units_of(model)}
    slots: dict[str, list[tuple[SplitTable, list[int]]]] = {}
    for i, layer in enumerate(model.layers):
        for slot, t in layer.spec.tables.items():
            kinds = slots.setdefault(slot, [])
            known = next((k for k in kinds if k[0] == t), None)
            if known is None:
                kinds.append((t, [i]))
            else:
                known[1].append(i)
    table: dict[str, Style] = {}
    for slot, kinds in slots.items():
        made = []
        for t, layers in kinds:
            even = t.plain_when_even and all(_even(p, u) for u in t.unit_names())
            styles = table_styles(t, None if even else p.parts, sequence, moe_split, totals)
            module = styles.pop("", None)
            if module is not None:
                for i in layers if len(kinds) > 1 else ["*"]:
                    table[f"layers.{i}.{slot}"] = module
            made.append((styles, layers))
        # a tensor two kinds name alike but split apart (Gemma 4's sliding and global
        # heads: wq of other widths) takes an entry per layer; the others a wildcard
        differ = {
            path
            for styles, _ in made
            for path, style in styles.items()
            if any(other.get(path, style) != style for other, _ in made)
        }
        for styles, layers in made:
            table |= _under(
                f"layers.*.{slot}", {k: v for k, v in styles.items() if k not in differ}
            )
            for i in layers:
                mixer = model.layers[i][slot]
                own = {k: v for k, v in styles.items() if k in differ and _holds(mixer, k)}
                table |= _under(f"layers.{i}.{slot}", own)
    return table


def _holds(module: nn.Module, path: str) -> bool:
    """Whether `module` has a submodule at `path` (a KV-shared layer has no wk)."""
    for part in path.split("."):
        if not isinstance(module, nn.Module) or part not in module:
            return False
        module = module[part]
    return True


def _units_of(model: nn.Module) -> set[str]:
    return {u for layer in model.layers for t in layer.spec.tables.values() for u in t.unit_names()}


def llama_plan(
    model: nn.Module,
    n: int,
    *,
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
    plan: Plan | None = None,
    vocab: Sequence[range] | None = None,
) -> dict[str, Style]:
    """The built-in plan of `model` over `n` ranks (see the module docstring); `vocab`:
    each rank's vocabulary rows (default: as even as possible)."""
    p = plan or plan_for(model, n)
    sp = sequence_parallel
    table = _mixer_table(model, p, sp)
    norm: Style = SequenceParallel() if sp else Replicate()
    norms = {k for layer in model.layers for k, m in layer.items() if isinstance(m, nn.RMSNorm)}
    table |= {f"layers.*.{k}": norm for k in sorted(norms)} | {"norm": norm}
    seq: Layout = "sequence" if sp else "replicate"
    tied = model.args.tie_word_embeddings
    if vocab_parallel:
        rows = None if vocab is None else tuple((r.start, r.stop) for r in vocab)
        table["tok_embeddings"] = (LossParallel if tied else VocabParallel)(rows, output_layout=seq)
        if not tied:
            table["output"] = LossParallel(rows, input_layout=seq)
        if "per_layer_embeddings" in model:  # Gemma's: the same rows, one all-reduce
            table["per_layer_embeddings"] = VocabParallel(rows)
    else:
        table["tok_embeddings"] = Replicate(output_layout=seq)
        if not tied:
            table["output"] = Replicate(input_layout=seq)
    return table
