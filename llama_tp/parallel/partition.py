"""Partition plan: which heads and feed-forward columns each rank computes.

Pure Python (no mlx import) so that the plan can be printed and tested
without the runtime. See `make_plan` for the rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


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
    base, extra = divmod(total, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


def vocab_ranges(vocab_size: int, n: int) -> list[range]:
    """The vocabulary rows of each rank's embedding and output head shard: as even as
    possible (sizes differ by at most one). Rows of quantized tables split anywhere."""
    if not 1 <= n <= vocab_size:
        raise ValueError(f"cannot split a vocabulary of {vocab_size} over {n} ranks")
    return _balanced(vocab_size, n)


def _kv_map(q: range, kv: range, g: int) -> tuple[int, ...] | None:
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
) -> Plan:
    """Split the attention heads and feed-forward columns of a Llama layer over n ranks.

    - n divides n_kv_heads: equal contiguous blocks (what mlx's shard_linear does).
    - n <= n_kv_heads otherwise: whole KV groups, counts differing by at most one
      (larger first); the query heads follow their KV group.
    - n > n_kv_heads: query heads balanced (larger first); each rank holds the KV
      heads its query heads need, replicating a KV head over several ranks.
    - Feed-forward columns balanced in units of group_size (quantized: the w2
      column split must fall on group boundaries) or of single columns.

    Raises ValueError only where no split exists.
    """
    if n < 1:
        raise ValueError(f"cannot split over {n} ranks: need at least 1 rank")
    if n_heads < 1 or n_kv_heads < 1:
        raise ValueError(f"need at least one head, got {n_heads} query and {n_kv_heads} KV heads")
    if n_heads % n_kv_heads:
        raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
    if n > n_heads:
        raise ValueError(
            f"cannot split {n_heads} query heads over {n} ranks: at most {n_heads} ranks"
        )
    unit = group_size or 1
    if group_size is not None and (group_size < 1 or hidden_dim % group_size):
        raise ValueError(
            f"quantized hidden_dim {hidden_dim} is not a multiple of group_size {group_size}"
        )
    if hidden_dim // unit < n:
        what = f"{hidden_dim // unit} groups of {unit}" if group_size else f"{hidden_dim}"
        raise ValueError(
            f"cannot split {what} feed-forward columns over {n} ranks: "
            f"at most {hidden_dim // unit} ranks"
        )

    g = n_heads // n_kv_heads  # query heads per KV head
    if n <= n_kv_heads:
        # Whole KV groups per rank: local attention is plain GQA.
        kv_parts = _balanced(n_kv_heads, n)
        q_parts = [range(kv.start * g, kv.stop * g) for kv in kv_parts]
    else:
        q_parts = _balanced(n_heads, n)
        kv_parts = [range(q.start // g, (q.stop - 1) // g + 1) for q in q_parts]
    ffn_parts = [range(r.start * unit, r.stop * unit) for r in _balanced(hidden_dim // unit, n)]
    parts = tuple(
        RankPart(rank=i, q_heads=q, kv_heads=kv, kv_map=_kv_map(q, kv, g), ffn=f)
        for i, (q, kv, f) in enumerate(zip(q_parts, kv_parts, ffn_parts, strict=True))
    )
    even_ffn = hidden_dim % n == 0 and (group_size is None or (hidden_dim // n) % group_size == 0)
    return Plan(
        n=n,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        dim=dim,
        hidden_dim=hidden_dim,
        group_size=group_size,
        parts=parts,
        even_attention=n_kv_heads % n == 0,
        even_ffn=even_ffn,
    )


# layers.{i}.{attention|feed_forward}.{proj}.{weight|bias|scales|biases}
_LAYER_TENSOR = re.compile(
    r"^layers\.\d+\.(?:attention\.(wq|wk|wv|wo)|feed_forward\.(w1|w2|w3))"
    r"\.(weight|bias|scales|biases)$"
)


def _split(plan: Plan, part: RankPart, name: str) -> tuple[int, range, int] | None:
    """(axis, this rank's units, total units) of a layer tensor; None: held whole."""
    m = _LAYER_TENSOR.match(name)
    if m is None:
        return None  # embeddings, norms, output: whole unless vocabulary-parallel
    proj = m.group(1) or m.group(2)
    if proj in ("wo", "w2") and m.group(3) == "bias":
        return None  # added once after the all_sum: whole on every rank
    r, total = {
        "wq": (part.q_heads, plan.n_heads),
        "wk": (part.kv_heads, plan.n_kv_heads),
        "wv": (part.kv_heads, plan.n_kv_heads),
        "wo": (part.q_heads, plan.n_heads),
    }.get(proj, (part.ffn, plan.hidden_dim))
    return (1 if proj in ("wo", "w2") else 0), r, total


def tensor_slice(
    plan: Plan, part: RankPart, name: str, shape: tuple[int, ...], vocab: range | None = None
) -> tuple[int, int, int] | None:
    """The part of checkpoint tensor `name` (stored `shape`) that rank `part` holds:
    (axis, start, stop) in stored units, or None when it holds the whole tensor.

    Rows of wq/wk/wv/w1/w3 and columns of wo/w2, packed or not (every split axis
    is proportional to the count of heads or columns; quantized splits fall on
    group boundaries); the rows `vocab` of the embedding and output head when
    they are vocabulary-parallel; everything else (norms, wo/w2 bias) whole.
    """
    if name.startswith(("tok_embeddings.", "output.")):
        return None if vocab is None else (0, vocab.start, vocab.stop)
    split = _split(plan, part, name)
    if split is None:
        return None
    axis, r, total = split
    return axis, shape[axis] * r.start // total, shape[axis] * r.stop // total


def _held(plan: Plan, part: RankPart, name: str, nbytes: int) -> int:
    """Bytes of one tensor that `part` holds."""
    split = _split(plan, part, name)
    if split is None:
        return nbytes
    # The difference of the boundaries, so that a partition sums exactly.
    _, r, total = split
    return nbytes * r.stop // total - nbytes * r.start // total


def weight_bytes(plan: Plan, tensors: dict[str, tuple[tuple[int, ...], int]]) -> list[int]:
    """Bytes each rank holds, given every checkpoint tensor as name -> (stored shape, nbytes).

    Attention/FFN tensors are sliced by the plan; everything else (and the
    wo/w2 bias vectors) is counted whole on every rank.
    """
    return [sum(_held(plan, p, name, nb) for name, (_, nb) in tensors.items()) for p in plan.parts]


def format_ranges(items: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


def format_kv_heads(kv: range, replicated: dict[int, list[int]]) -> str:
    """KV heads as ranges, replicated heads listed singly with a '*'."""
    out, run = [], []
    for h in kv:
        if h in replicated:
            if run:
                out.append(format_ranges(run))
                run = []
            out.append(f"{h}*")
        else:
            run.append(h)
    if run:
        out.append(format_ranges(run))
    return ",".join(out)


def human_bytes(nbytes: int) -> str:
    x = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")


def imbalance(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return 100.0 * (max(values) - min(values)) / mean if mean else 0.0


def format_plan(plan: Plan, bytes_per_rank: list[int] | None = None) -> str:
    """Human-readable table of the plan, one row per rank, then the imbalance."""
    replicated = plan.replicated_kv_heads()
    header = ["rank", "q heads", "kv heads", "ffn columns"]
    if bytes_per_rank is not None:
        header.append("weights")
    rows = [header]
    for p in plan.parts:
        q = format_ranges(list(p.q_heads)) + ("" if p.kv_map is None else " (mapped)")
        row = [
            str(p.rank),
            f"{q} [{len(p.q_heads)}]",
            f"{format_kv_heads(p.kv_heads, replicated)} [{len(p.kv_heads)}]",
            f"{p.ffn.start}-{p.ffn.stop - 1} [{len(p.ffn)}]",
        ]
        if bytes_per_rank is not None:
            row.append(human_bytes(bytes_per_rank[p.rank]))
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = [
        f"{plan.n} ranks: {plan.n_heads} query / {plan.n_kv_heads} KV heads "
        f"(head_dim {plan.head_dim}), hidden_dim {plan.hidden_dim}"
        + (f", group_size {plan.group_size}" if plan.group_size else "")
        + f"; attention {'even' if plan.even_attention else 'uneven'}, "
        f"feed-forward {'even' if plan.even_ffn else 'uneven'}"
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if replicated:
        lines.append("* replicated KV head; (mapped): query heads use an explicit KV map")
    if bytes_per_rank is not None:
        lines.append(f"imbalance: {imbalance(bytes_per_rank):.1f}% of weight bytes")
    else:
        counts = [len(p.q_heads) for p in plan.parts]
        lines.append(f"imbalance: {imbalance(counts):.1f}% of query heads")
    return "\n".join(lines)
