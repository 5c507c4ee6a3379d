"""Split tables: how a mixer kind's tensors split over the ranks, as plain data.

Every mixer kind (attention, latent attention, feed-forward, experts: the core ones in
`models/attention.py` and `models/feed_forward.py`, the others beside them) declares
one `SplitTable`: for each of its tensors, by path under the mixer, the unit it splits
by (a range of every rank's part: query heads, KV heads, feed-forward columns, experts,
or a unit of the kind's own), the dimension, the values per unit along it, and for a
fused tensor its segments (q | k | v sections of one projection, each split by its own
units: a rank keeps its slice of every section). Tensors the table does not name
(norms, routers, latent projections) are whole on every rank. A kind also declares its
cache (`CacheSpec`: KV, rotating, fixed-size arrays; what one token or one sequence
holds per unit).

From these declarations this package derives everything that depends on how a layer
splits, so that it is written once:

    the read slices of every stored tensor   `slices_of` (partition.tensor_slice)
    the parallel styles of every module      kind_shard.table_styles (the kinds' `shard`)
    the bytes of each rank's cache           `cache_values` (placement.kv_cache_bytes)
    the units each rank holds                partition.make_plan (core units) and
                                             `split_extra_units` (a kind's own units)

    wq = TensorSplit("q_heads", ROWS, width=head_dim)    # rows of whole query heads
    wo = TensorSplit("q_heads", COLUMNS, width=head_dim) # the same heads' columns
    qkv = TensorSplit(segments=(Segment("k_heads", dk), Segment("k_heads", dk),
                                Segment("v_heads", dv)))  # a fused projection's rows

Pure Python (no mlx import), as the partition it feeds. The core Llama layer's tables
(`llama_attention`, `llama_feed_forward`) live here because `partition.make_plan`
partitions exactly that layer; `Attention` and `FeedForward` (`models/`) declare them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .shares import split_units, weighted_units

ROWS = "rows"  # output rows of an (out, in) weight; of stacked experts (E, out, in): axis 1
COLUMNS = "columns"  # input columns; stacked: axis 2
HEADS = "heads"  # axis 0 of a per-head (H, out, in) stack (mlx-lm's MultiLinear)
VECTOR = "vector"  # a 1-D parameter with `width` values per unit (attention sinks, A_log)
CHANNELS = "channels"  # axis 0 of any weight and its bias (a depthwise conv's (C, K, 1))
DIMS = (ROWS, COLUMNS, HEADS, VECTOR, CHANNELS)
PARAMS = ("weight", "bias", "scales", "biases")  # a linear layer's stored tensors

Slice = tuple[int, int, int]  # (axis, start, stop) of a stored tensor
# A fused tensor's slice: one (axis, start, stop) per segment, all on one axis, read and
# concatenated in order.
Segmented = tuple[Slice, ...]
NOT_HELD: Slice = (0, 0, 0)  # the slice of a tensor a rank does not hold at all


@dataclass(frozen=True)
class Segment:
    """One section of a fused tensor along its split axis: `width` values per unit of
    `unit` (q, k and v of `in_proj_qkv`: key heads, key heads, value heads)."""

    unit: str
    width: int = 1


@dataclass(frozen=True)
class TensorSplit:
    """How one tensor (a linear layer's weight, bias, scales and biases, or a 1-D
    parameter) splits: by `unit` along `dim`, `width` values per unit, or by `segments`.

    `stacked`: experts stacked as (E, out, in) (mlx-lm's SwitchGLU): split by their
    columns as `unit` says, or by whole experts (axis 0) when the plan splits by expert.
    `in_place`: kept in place (the enclosing module sums the partial outputs once:
    `summed`), not a sharded layer with its own all-reduce; the bias of an in-place
    column split is held and added by the rank holding the first columns only.
    """

    unit: str = ""
    dim: str = ROWS
    width: int = 1
    segments: tuple[Segment, ...] = ()
    stacked: bool = False
    in_place: bool = False

    def __post_init__(self) -> None:
        if self.dim not in DIMS:
            raise ValueError(f"split dimension {self.dim!r}: expected one of {', '.join(DIMS)}")
        if not self.unit and not self.segments:
            raise ValueError("a tensor split needs a unit or segments")

    def sections(self) -> tuple[Segment, ...]:
        """Its segments; an unfused tensor is one."""
        return self.segments or (Segment(self.unit, self.width),)

    def units(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.unit for s in self.sections()))


@dataclass(frozen=True)
class Unit:
    """A unit a kind splits by beyond the core ones (query/KV heads, feed-forward
    columns, experts): `total` of them (the config's), split over the ranks in
    multiples of `step`, balanced or by the weights; or, with `follows`, the same
    fraction of them as of that unit (value heads with their key heads: total a
    multiple of the followed total), or, fewer than it (a divisor of its total), the
    ones its range needs, shared by neighbours where a group straddles two ranks
    (Gemma 4's global KV heads for a rank's query heads: `follows="q_heads"`). `what`
    names them in `plan` and in errors."""

    name: str
    total: int
    what: str
    step: int = 1
    follows: str | None = None


@dataclass(frozen=True)
class CacheSpec:
    """What one layer's cache holds (its kind's declaration).

    `kind`: "kv" (mlx-lm's KVCache: grows with the tokens), "rotating" (a
    RotatingKVCache of `window` tokens at most), "chunked" (chunked attention, Llama 4:
    the current chunk of `window` positions, `models/caches.ChunkedCache`), "arrays" (an
    ArraysCache of `size` fixed-size arrays: a recurrent state), "list" (a CacheList of
    several), "shared" (none of its own: the layer attends over layer `source`'s keys
    and values, Gemma's KV-shared layers; the model makes no cache for it and a pipeline
    stage keeps it with its source; whether and how each steps back is the cache's to
    say: `models/caches.py`). `per_token`:
    (unit, values per unit) per cached token (unit "": whole on every rank, e.g. a
    latent); `fixed`: the same per sequence, whatever its length (a recurrent state).
    `mask`: the mask the layer takes: "causal", "window" (the last `window`
    positions), "chunked" (each query over its own chunk of `window` positions) or
    "ssm" (mlx-lm's create_ssm_mask: padding only). `fixed32`: fixed
    values held in float32 whatever the model's dtype (mlx-lm's gated delta keeps its
    recurrent state so); `per_token` and `fixed` are in the activations' dtype.
    """

    kind: str = "kv"
    per_token: tuple[tuple[str, int], ...] = ()
    fixed: tuple[tuple[str, int], ...] = ()
    fixed32: tuple[tuple[str, int], ...] = ()
    window: int | None = None
    size: int = 0
    mask: str = "causal"
    parts: tuple[CacheSpec, ...] = ()  # "list": each of its caches
    what: str = ""  # the layer kind, as refusals name it ("Gated DeltaNet linear attention")
    source: int | None = None  # "shared": the layer whose keys and values it reads


@dataclass(frozen=True)
class SplitTable:
    """A mixer kind's split (see the module docstring): `tensors` by path under the
    mixer ("wq", "switch_mlp.gate_proj", "sinks"); `module`, the style of the mixer
    itself: "heads" (attention: local head counts, KV map), "summed" (one all-reduce of
    the partial outputs of in-place tensors), "units" (local counts `local`, attribute ->
    ((unit, width), ...) summed, and VECTOR parameters sliced), or None; `units`, the
    kind's own units (`Unit`); `plain_when_even`: on an even split the projections take mlx's
    `shard_linear` (no ranges), as the design card's `shard` methods do."""

    kind: str
    tensors: Mapping[str, TensorSplit] = field(default_factory=dict)
    module: str | None = None
    units: tuple[Unit, ...] = ()
    local: Mapping[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    plain_when_even: bool = True

    def entry(self, name: str) -> tuple[TensorSplit, str] | None:
        """(split, parameter) of tensor `name` (path under the mixer, e.g.
        'wq.scales' -> (wq's split, 'scales'); 'sinks' -> (its split, '')); None: whole."""
        e = self.tensors.get(name)
        if e is not None and e.dim == VECTOR:
            return e, ""
        module, _, param = name.rpartition(".")
        e = self.tensors.get(module)
        if e is None or e.dim == VECTOR or param not in PARAMS:
            return None
        return e, param

    def unit_names(self) -> tuple[str, ...]:
        """Every unit the table splits by, in order."""
        names = [u for e in self.tensors.values() for u in e.units()]
        names += [u for terms in self.local.values() for u, _ in terms]
        return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class LayerSpec:
    """One layer as the placement sees it: each mixer's split table by its path in the
    layer ("attention", "feed_forward"), and the layer's cache (None: it caches nothing)."""

    tables: Mapping[str, SplitTable]
    cache: CacheSpec | None = None

    @classmethod
    def of(cls, mixers: Mapping[str, Any], args: Any, layer: int) -> LayerSpec:
        """From a layer's mixers (modules or their classes), each declaring
        `split_table(args)` and `cache_spec(args, layer)` (None: nothing cached)."""
        tables, caches = {}, []
        for slot, m in mixers.items():
            kind = m if isinstance(m, type) else type(m)
            tables[slot] = kind.split_table(args)
            spec = kind.cache_spec(args, layer)
            if spec is not None:
                caches.append(spec)
        if len(caches) > 1:  # several caching mixers: a CacheList of their caches
            return cls(tables, CacheSpec("list", mask=caches[0].mask, parts=tuple(caches)))
        return cls(tables, caches[0] if caches else None)

    def find(self, rest: str) -> tuple[SplitTable, str] | None:
        """(table, path under its mixer) of a layer tensor `rest` ('attention.wq.weight')."""
        for slot, table in self.tables.items():
            if rest.startswith(slot + "."):
                return table, rest[len(slot) + 1 :]
        return None


# -- the core Llama layer -------------------------------------------------------------


def llama_attention(head_dim: int) -> SplitTable:
    """The core attention: q/k/v rows and wo's columns by whole heads (GQA: a rank's
    query heads follow its KV heads, or its KV heads are replicated to serve them)."""
    return SplitTable(
        "attention",
        {
            "wq": TensorSplit("q_heads", ROWS, head_dim),
            "wk": TensorSplit("kv_heads", ROWS, head_dim),
            "wv": TensorSplit("kv_heads", ROWS, head_dim),
            "wo": TensorSplit("q_heads", COLUMNS, head_dim),
        },
        module="heads",
    )


def llama_feed_forward() -> SplitTable:
    """The core SwiGLU: w1/w3 rows and w2's columns by intermediate columns."""
    return SplitTable(
        "feed-forward",
        {
            "w1": TensorSplit("ffn", ROWS),
            "w2": TensorSplit("ffn", COLUMNS),
            "w3": TensorSplit("ffn", ROWS),
        },
    )


def llama_layer(head_dim: int) -> LayerSpec:
    """The layer `partition.make_plan` partitions: attention and a feed-forward."""
    cache = CacheSpec("kv", (("kv_heads", 2 * head_dim),))
    tables = {"attention": llama_attention(head_dim), "feed_forward": llama_feed_forward()}
    return LayerSpec(tables, cache)


# -- derivations ----------------------------------------------------------------------

# unit name -> (this rank's range, the total): what a derivation asks of a rank's part
Units = Callable[[str], tuple[range, int] | None]


def _axis(e: TensorSplit, by_expert: bool) -> int:
    if (e.stacked and by_expert) or e.dim == CHANNELS:
        return 0
    base = 1 if e.dim == COLUMNS else 0
    return base + (1 if e.stacked else 0)


def slices_of(
    e: TensorSplit, param: str, shape: tuple[int, ...], units: Units, by_expert: bool = False
) -> Slice | Segmented | None:
    """The part of one stored tensor (`shape`; `param` of the split `e`: 'weight', 'bias',
    'scales', 'biases', '' for a vector) that a rank holds: None (whole), one (axis,
    start, stop) in stored units, one per segment (a fused tensor), or `NOT_HELD`.

    Every split axis is proportional to the units along it (packed quantized columns,
    scales: the same fractions), so the stored slice is `shape[axis] * position //
    total` of the logical positions. `by_expert`: stacked experts split by whole experts.
    """
    stacked_by_expert = e.stacked and by_expert
    axis = _axis(e, by_expert)
    if len(shape) <= axis:
        # the bias of a column split: whole on every rank (a sharded-to-all layer adds it
        # once after its sum), or on the first rank only (in place: the module sums)
        got = units(e.unit) if e.in_place and e.dim == COLUMNS else None
        return None if got is None or got[0].start == 0 else NOT_HELD
    sections = (Segment("experts", 1),) if stacked_by_expert else e.sections()
    spans, logical = [], 0
    for s in sections:
        got = units(s.unit)
        if got is None:
            return None  # the plan does not split this unit (a user's style plan)
        r, total = got
        spans.append((logical + r.start * s.width, logical + r.stop * s.width))
        logical += total * s.width
    if len(spans) == 1 and spans[0] == (0, logical):
        return None
    size = shape[axis]
    out = tuple((axis, size * a // logical, size * b // logical) for a, b in spans)
    return out[0] if len(out) == 1 else out


def held_bytes(shape: tuple[int, ...], nbytes: int, s: Slice | Segmented | None) -> int:
    """Bytes of a tensor (stored `shape`, `nbytes`) that slice `s` keeps (None: all)."""
    if s is None:
        return nbytes
    if isinstance(s[0], tuple):
        return sum(held_bytes(shape, nbytes, one) for one in s)
    axis, start, stop = s
    # The difference of the boundaries, so that a partition sums exactly.
    return nbytes * stop // shape[axis] - nbytes * start // shape[axis]


def cache_values(spec: CacheSpec, units: Units, tokens: int) -> int:
    """Values a layer's cache holds on a rank after `tokens` tokens: per token, its units'
    (at most `window` tokens for a rotating cache, the last token's chunk for a chunked
    one), plus the fixed state."""
    if spec.kind == "list":
        return sum(cache_values(p, units, tokens) for p in spec.parts)
    held = tokens if spec.window is None else min(tokens, spec.window)
    if spec.kind == "chunked" and tokens:  # after decoding steps: the last token's chunk
        held = tokens - (tokens - 1) // spec.window * spec.window

    def count(unit: str) -> int:
        if not unit:
            return 1
        got = units(unit)
        return 1 if got is None else len(got[0])

    per_token = sum(count(u) * w for u, w in spec.per_token)
    return held * per_token + sum(count(u) * w for u, w in spec.fixed)


def cache_bytes(spec: CacheSpec, units: Units, tokens: int, itemsize: int) -> int:
    """Bytes a layer's cache holds on a rank after `tokens` tokens: `cache_values` at
    `itemsize` bytes each (the activations'), plus its float32 state (`fixed32`)."""
    if spec.kind == "list":
        return sum(cache_bytes(p, units, tokens, itemsize) for p in spec.parts)

    def count(unit: str) -> int:
        got = units(unit) if unit else None
        return 1 if got is None else len(got[0])

    state = sum(count(u) * w for u, w in spec.fixed32)
    return cache_values(spec, units, tokens) * itemsize + 4 * state


def split_extra_units(
    units: Sequence[Unit],
    n: int,
    weights: Sequence[float] | None = None,
    core: Mapping[str, tuple[int, Sequence[range]]] | None = None,
) -> list[dict[str, range]]:
    """Each rank's range of every kind's own unit: `step`-sized multiples balanced (larger
    first) or by `weights`; a following unit takes its leader's fraction, or (fewer than
    its leader) the groups its leader's range touches. `core`: the core units a unit may
    follow, name -> (total, each rank's range). ValueError, one line, where the units do
    not split over n ranks."""
    out: list[dict[str, range]] = [{} for _ in range(n)]
    by_name = {u.name: u for u in units}
    for name, (total, ranges) in (core or {}).items():
        by_name.setdefault(name, Unit(name, total, name))
        for i, r in enumerate(ranges):
            out[i].setdefault(name, r)
    for u in units:
        if u.follows is not None:
            continue
        if u.total % u.step:
            raise ValueError(f"{u.total} {u.what} are not a multiple of {u.step}")
        count = u.total // u.step
        if count < n:
            raise ValueError(
                f"cannot split {u.total} {u.what} over {n} ranks: at most {count} ranks"
            )
        parts = (
            split_units(count, [1.0] * n)
            if weights is None
            else weighted_units(count, weights, u.what)
        )
        for i, r in enumerate(parts):
            out[i][u.name] = range(r.start * u.step, r.stop * u.step)
    for u in units:
        if u.follows is None:
            continue
        lead = by_name.get(u.follows)
        fewer = lead is not None and u.total < lead.total
        if lead is None or (lead.total % u.total if fewer else u.total % lead.total):
            raise ValueError(
                f"{u.total} {u.what} cannot follow {lead.total if lead else 0} "
                f"{lead.what if lead else u.follows}"
            )
        for i in range(n):
            r = out[i][lead.name]
            if fewer:  # the groups of `g` leaders that r touches (maybe shared)
                g = lead.total // u.total
                out[i][u.name] = range(r.start // g, (r.stop - 1) // g + 1)
            else:
                k = u.total // lead.total
                out[i][u.name] = range(r.start * k, r.stop * k)
    for name in core or {}:
        for i in range(n):
            out[i].pop(name, None)
    return out
