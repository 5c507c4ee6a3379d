"""Partition plan: which heads, feed-forward columns and experts each rank computes.

Pure Python (no mlx import) so that the plan can be printed and tested
without the runtime. See `make_plan` for the rules, `tensor_slice` for what that
means for each stored tensor (derived from the layers' split tables, `splits.py`),
and `placement.py` for a whole mesh's placement.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from .shares import SplitError, split_units, weighted_units, weights_text
from .shares import shares as fractions
from .splits import (
    NOT_HELD,
    LayerSpec,
    Segmented,
    Slice,
    Unit,
    Units,
    held_bytes,
    llama_layer,
    slices_of,
    split_extra_units,
)

__all__ = ["NOT_HELD", "Experts", "Plan", "RankPart", "held_bytes", "make_plan", "tensor_slice"]
__all__ += ["kv_map", "vocab_ranges", "weight_bytes"]


@dataclass(frozen=True)
class RankPart:
    """The slice of every layer that one rank holds."""

    rank: int
    q_heads: range  # global query heads this rank computes (contiguous)
    kv_heads: range  # global KV heads this rank holds (contiguous)
    # For each local query head, the LOCAL index of its KV head; None when the
    # local heads are regular GQA, so plain GQA attention is exact.
    kv_map: tuple[int, ...] | None
    ffn: range  # feed-forward intermediate columns (rows of w1/w3, columns of w2)
    # Mixture-of-experts layers (None in a dense model): the experts this rank holds
    # (all of them when split by tensor), the columns of each expert's intermediate
    # width it holds (all of them when split by expert), and its columns of the shared
    # expert (split like a dense feed-forward).
    experts: range | None = None
    expert_ffn: range | None = None
    shared_ffn: range | None = None
    # The ranges of the units the layers' kinds declare beyond these (`splits.Unit`:
    # e.g. linear-attention key and value heads), by name.
    extra: tuple[tuple[str, range], ...] = ()

    def unit(self, name: str) -> range | None:
        """This rank's range of unit `name` (a field above, or a kind's own); None when
        the plan does not split it."""
        if name in _CORE_UNITS:
            return getattr(self, name)
        return dict(self.extra).get(name)


# The units `make_plan` splits itself (the Llama layer's); a kind's others are `extra`.
_CORE_UNITS = ("q_heads", "kv_heads", "ffn", "experts", "expert_ffn", "shared_ffn")


MOE_SPLITS = ("tensor", "expert")


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts shape a plan splits: E experts of `hidden_dim` columns each,
    split by `split` ("tensor": every expert's columns in units of `unit`; "expert":
    whole experts), and the shared expert's `shared_dim` columns (0: none) in units of
    `shared_unit`."""

    n_experts: int
    hidden_dim: int
    split: str = "tensor"
    unit: int | None = None
    shared_dim: int = 0
    shared_unit: int | None = None


@dataclass(frozen=True)
class Plan:
    n: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dim: int
    hidden_dim: int
    group_size: int | None
    parts: tuple[RankPart, ...]
    even_attention: bool  # n divides n_kv_heads: mlx's shard_linear split is this plan
    even_ffn: bool  # n divides hidden_dim (into whole quantization groups if quantized)
    experts: Experts | None = None  # the mixture-of-experts layers' shape, if any
    weights: tuple[float, ...] | None = None  # --split: each rank's weight (None: balanced)
    # Each layer's split tables and cache (`splits.LayerSpec`, from the model's kinds);
    # None: every layer is the Llama layer (`splits.llama_layer`).
    layers: tuple[LayerSpec, ...] | None = field(default=None, repr=False)
    units: tuple[Unit, ...] = ()  # the kinds' own units (`RankPart.extra`)

    def spec(self, layer: int) -> LayerSpec:
        """Layer `layer`'s split tables and cache."""
        if self.layers is None:
            return llama_layer(self.head_dim)
        return self.layers[layer]

    def total(self, unit: str) -> int:
        """How many of `unit` a layer has (the whole range the ranks split)."""
        e = self.experts
        core = {
            "q_heads": self.n_heads,
            "kv_heads": self.n_kv_heads,
            "ffn": self.hidden_dim,
            "shared_ffn": e.shared_dim if e else 0,
            "expert_ffn": e.hidden_dim if e else 0,
            "experts": e.n_experts if e else 0,
        }
        if unit in core:
            return core[unit]
        return next(u.total for u in self.units if u.name == unit)

    def replicated_kv_heads(self) -> dict[int, list[int]]:
        """Global KV head -> ranks holding it, for the heads held by more than one rank."""
        holders: dict[int, list[int]] = {}
        for p in self.parts:
            for h in p.kv_heads:
                holders.setdefault(h, []).append(p.rank)
        return {h: ranks for h, ranks in holders.items() if len(ranks) > 1}


def _balanced(total: int, n: int) -> list[range]:
    """Split range(total) into n contiguous ranges whose sizes differ by at most
    one, larger ones first."""
    return split_units(total, [1] * n)


def _shares(total: int, n: int, weights: Sequence[float] | None, what: str) -> list[range]:
    """The balanced split, or the weighted one (`weighted_units`)."""
    return _balanced(total, n) if weights is None else weighted_units(total, weights, what)


def vocab_ranges(vocab_size: int, n: int, weights: Sequence[float] | None = None) -> list[range]:
    """The vocabulary rows of each rank's embedding and output head shard: as even as
    possible (sizes differ by at most one), or in proportion to `weights`. Rows of
    quantized tables split anywhere."""
    if not 1 <= n <= vocab_size:
        raise ValueError(f"cannot split a vocabulary of {vocab_size} over {n} ranks")
    return _shares(vocab_size, n, weights, "vocabulary rows")


def kv_map(q: range, kv: range, g: int) -> tuple[int, ...] | None:
    """Local KV index of each local query head, or None if it is regular GQA
    (each local KV head serves the same number of consecutive local query heads)."""
    local = tuple(h // g - kv.start for h in q)
    nq, nkv = len(q), len(kv)
    if nq % nkv == 0 and local == tuple(i // (nq // nkv) for i in range(nq)):
        return None
    return local


def make_plan(
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    dim: int,
    hidden_dim: int,
    n: int,
    group_size: int | None = None,
    experts: Experts | None = None,
    weights: Sequence[float] | None = None,
    layers: Sequence[LayerSpec] | None = None,
    units: Sequence[Unit] = (),
) -> Plan:
    """Split the attention heads and feed-forward columns of a Llama layer over n ranks.

    - n divides n_kv_heads: equal contiguous blocks (what mlx's shard_linear does).
    - n <= n_kv_heads otherwise: whole KV groups, counts differing by at most one
      (larger first); the query heads follow their KV group.
    - n > n_kv_heads: query heads balanced (larger first); each rank holds the KV
      heads its query heads need, replicating a KV head over several ranks.
    - Feed-forward columns balanced in units of group_size (quantized: the w2
      column split must fall on group boundaries) or of single columns.
    - Mixture-of-experts layers (`experts`): split "tensor", every rank holds every
      expert's columns balanced in units of `experts.unit`, as a dense feed-forward;
      split "expert", whole experts balanced (E/N each, larger first). The shared
      expert's columns are balanced like a dense feed-forward's either way.
    - `weights` (`--split 3:1`, one per rank; None: balanced): every count above is
      divided in proportion instead (largest remainders), in the same units: whole KV
      groups while every rank's share is at least one group, else query heads with
      the KV heads they need replicated; a rank whose share of some count is under
      half a unit is refused (SplitError, with the numbers).
    - `layers`: each layer's split tables (`splits.LayerSpec`; default: all Llama
      layers); `units`: the units their kinds declare beyond the ones above, each
      balanced or weighted in its steps (`splits.split_extra_units`).

    Raises ValueError only where no split exists.
    """
    if n < 1:
        raise ValueError(f"cannot split over {n} ranks: need at least 1 rank")
    if weights is not None and len(weights) != n:
        raise SplitError(
            f"--split {weights_text(weights)} has {len(weights)} weights for {n} ranks"
        )
    if weights is not None and len(set(weights)) == 1:
        weights = None  # equal weights: the balanced split
    if n_heads < 1 or n_kv_heads < 1:
        raise ValueError(f"need at least one head, got {n_heads} query and {n_kv_heads} KV heads")
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
    if n > n_heads:
        raise ValueError(
            f"cannot split {n_heads} query heads over {n} ranks: at most {n_heads} ranks"
        )
    unit = group_size or 1
    if hidden_dim == 0:  # no dense feed-forward (every layer a mixture of experts)
        unit, group_size = 1, None
    elif group_size is not None and (group_size < 1 or hidden_dim % group_size):
        raise ValueError(
            f"quantized hidden_dim {hidden_dim} is not a multiple of group_size {group_size}"
        )
    if 0 < hidden_dim < n * unit:
        what = f"{hidden_dim // unit} groups of {unit}" if group_size else f"{hidden_dim}"
        raise ValueError(
            f"cannot split {what} feed-forward columns over {n} ranks: "
            f"at most {hidden_dim // unit} ranks"
        )

    g = n_heads // n_kv_heads  # query heads per KV head
    if n <= n_kv_heads and min(n_kv_heads * s for s in fractions(weights, n)) >= 1:
        # Whole KV groups per rank: local attention is plain GQA.
        kv_parts = _shares(n_kv_heads, n, weights, "KV heads")
        q_parts = [range(kv.start * g, kv.stop * g) for kv in kv_parts]
    else:
        q_parts = _shares(n_heads, n, weights, "query heads")
        kv_parts = [range(q.start // g, (q.stop - 1) // g + 1) for q in q_parts]
    ffn_parts = (
        _in_units(_shares(hidden_dim // unit, n, weights, _units("feed-forward", unit)), unit)
        if hidden_dim
        else [range(0)] * n
    )
    moe = _expert_parts(experts, n, weights) if experts else [{}] * n
    core = {"q_heads": (n_heads, q_parts), "kv_heads": (n_kv_heads, kv_parts)}
    extra = split_extra_units(units, n, weights, core)
    parts = tuple(
        RankPart(
            rank=i,
            q_heads=q,
            kv_heads=kv,
            kv_map=kv_map(q, kv, g),
            ffn=f,
            extra=tuple(extra[i].items()),
            **m,
        )  # fmt: skip
        for i, (q, kv, f, m) in enumerate(zip(q_parts, kv_parts, ffn_parts, moe, strict=True))
    )
    even_ffn = hidden_dim % n == 0 and (group_size is None or (hidden_dim // n) % group_size == 0)
    even_ffn = even_ffn and len({len(f) for f in ffn_parts}) == 1
    # (with no dense feed-forward, hidden_dim 0: trivially even)
    return Plan(
        n=n,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        dim=dim,
        hidden_dim=hidden_dim,
        group_size=group_size,
        parts=parts,
        even_attention=n_kv_heads % n == 0 and len({len(q) for q in q_parts}) == 1,
        even_ffn=even_ffn,
        experts=experts,
        weights=None if weights is None else tuple(float(w) for w in weights),
        layers=None if layers is None else tuple(layers),
        units=tuple(units),
    )


def _units(what: str, unit: int) -> str:
    """'feed-forward columns', or 'feed-forward column groups of 32'."""
    return f"{what} columns" if unit == 1 else f"{what} column groups of {unit}"


def _in_units(parts: list[range], unit: int) -> list[range]:
    return [range(r.start * unit, r.stop * unit) for r in parts]


def _columns(
    width: int, unit: int | None, n: int, what: str, weights: Sequence[float] | None
) -> list[range]:
    """`width` columns split over n ranks (balanced, or by `weights`) in units of `unit`
    (ValueError naming `what`)."""
    u = unit or 1
    if width % u or width // u < n:
        groups = f"{width // u} groups of {u}" if unit else f"{width}"
        raise ValueError(
            f"cannot split {groups} {what} columns over {n} ranks"
            + (f": at most {width // u} ranks" if width % u == 0 else "")
        )
    return _in_units(_shares(width // u, n, weights, _units(what, u)), u)


def _expert_parts(
    e: Experts, n: int, weights: Sequence[float] | None = None
) -> list[dict[str, range | None]]:
    """Each rank's experts, expert columns and shared-expert columns."""
    if e.split not in MOE_SPLITS:
        raise ValueError(f"expert split {e.split!r}: expected one of {', '.join(MOE_SPLITS)}")
    if e.split == "expert":
        if e.n_experts < n:
            raise ValueError(
                f"cannot split {e.n_experts} experts over {n} ranks by expert: at most "
                f"{e.n_experts} ranks (split them by tensor instead)"
            )
        experts = _shares(e.n_experts, n, weights, "experts")
        widths = [range(e.hidden_dim)] * n
    else:
        experts = [range(e.n_experts)] * n
        widths = _columns(e.hidden_dim, e.unit, n, "expert feed-forward", weights)
    shared = None
    if e.shared_dim:
        shared = _columns(e.shared_dim, e.shared_unit, n, "shared-expert", weights)
    return [
        {"experts": x, "expert_ffn": w, "shared_ffn": shared[i] if shared else None}
        for i, (x, w) in enumerate(zip(experts, widths, strict=True))
    ]


_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# The tables split by vocabulary rows: the embedding, the head, and Gemma's per-layer
# embeddings (a row of every layer's input per token)
VOCAB_TABLES = ("tok_embeddings.", "output.", "per_layer_embeddings.")


def part_units(plan: Plan, part: RankPart) -> Units:
    """What the split tables' derivations ask of a rank's part: unit -> (its range, the
    total); None where the part does not split that unit (a dense model's experts)."""

    def get(name: str) -> tuple[range, int] | None:
        r = part.unit(name)
        return None if r is None else (r, plan.total(name))

    return get


def tensor_slice(
    plan: Plan, part: RankPart, name: str, shape: tuple[int, ...], vocab: range | None = None
) -> Slice | Segmented | None:
    """The part of checkpoint tensor `name` (stored `shape`) that rank `part` holds:
    (axis, start, stop) in stored units, one such per segment of a fused tensor, or
    None when it holds the whole tensor (`NOT_HELD`: none of it).

    A layer tensor splits as its mixer's split table says (`splits.slices_of`: the rows
    of wq/wk/wv/w1/w3 and the columns of wo/w2, packed or not, on quantization groups;
    stacked experts by columns of each expert or by whole experts; attention sinks by
    query heads; the bias of stacked down projections split by columns on the first
    rank only); the embedding and output head by the rows `vocab` when they are
    vocabulary-parallel; everything else (norms, routers, wo/w2 bias) whole.
    """
    if name.startswith(VOCAB_TABLES):
        return None if vocab is None else (0, vocab.start, vocab.stop)
    m = _LAYER.match(name)
    found = m and plan.spec(int(m.group(1))).find(m.group(2))
    hit = found and found[0].entry(found[1])
    if not hit:
        return None  # embeddings, norms, routers, output: whole unless vocabulary-parallel
    e, param = hit
    by_expert = plan.experts is not None and plan.experts.split == "expert"
    return slices_of(e, param, shape, part_units(plan, part), by_expert)


def weight_bytes(plan: Plan, tensors: dict[str, tuple[tuple[int, ...], int]]) -> list[int]:
    """Bytes each rank holds, given every checkpoint tensor as name -> (stored shape, nbytes).

    Attention/FFN tensors are sliced by the plan; everything else (and the
    wo/w2 bias vectors) is counted whole on every rank.
    """
    return [
        sum(
            held_bytes(sh, nb, tensor_slice(plan, p, name, sh))
            for name, (sh, nb) in tensors.items()
        )
        for p in plan.parts
    ]
