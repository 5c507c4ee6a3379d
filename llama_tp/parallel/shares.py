"""Weighted splits: the share of a model each tensor rank takes (`--split`).

    --split 3:1        one weight per tensor rank: rank 0 takes 3/4 of the query heads,
                       feed-forward columns, experts (or expert columns) and vocabulary
                       rows, rank 1 the rest, each rounded to whole heads (whole KV
                       groups where every rank gets at least one), quantization groups
                       and file blocks (`partition.make_plan`)
    --split memory     weights from each rank's available memory, gathered at start-up
                       (`loading.loader.split_weights`, `cluster/memory.py`)
    (no --split)       the balanced split, as before

Pure Python: parsing and checking the flag (one-line `SplitError`s with the numbers),
the shares of a count of units (`split_units`, `weighted_units`), the weights' text,
and the weights `doctor` suggests (`checks/split.py`: from each rank's
matrix-product time or available memory).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

MEMORY = "memory"  # --split memory: weights from each rank's available memory
Weights = tuple[float, ...]
SplitSpec = str | Sequence[float] | None  # as given: "3:1", (3, 1), "memory", None


class SplitError(ValueError):
    """A --split that cannot be used (wrong length, a weight <= 0, a rank left with no
    head or column): a usage error."""


def split_units(total: int, shares: list[float] | tuple[float, ...]) -> list[range]:
    """Split range(total) into one contiguous range per share, sized in proportion to
    the shares (largest remainders first; ties to the lower rank), none empty.
    Equal shares: sizes differ by at most one, larger ones first."""
    n, whole = len(shares), sum(shares)
    if n < 1 or total < n or whole <= 0 or min(shares) < 0:
        raise ValueError(f"cannot split {total} units over {n} ranks by shares {list(shares)}")
    quota = [total * s / whole for s in shares]
    sizes = [max(1, int(q)) for q in quota]
    order = sorted(range(n), key=lambda i: (-(quota[i] - sizes[i]), i))  # largest remainders
    i = 0
    while sum(sizes) < total:
        sizes[order[i % n]] += 1
        i += 1
    while sum(sizes) > total:  # a share below one unit took a whole one
        big = max(range(n), key=lambda j: (sizes[j] - quota[j], -j))
        sizes[big] -= 1
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def weighted_units(total: int, weights: Sequence[float], what: str, unit: str = "") -> list[range]:
    """range(total) split in proportion to `weights` (`split_units`); SplitError, with the
    numbers, when a rank's share is under half a unit (it would get none: `what` names
    the units, `unit` says what one is, e.g. ' (a group of 32 columns)')."""
    whole = sum(weights)
    for rank, w in enumerate(weights):
        quota = total * w / whole
        if quota < 0.5:
            raise SplitError(
                f"--split {weights_text(weights)} leaves rank {rank} no {what}: its share of "
                f"the {total} is {quota:.2f}{unit}, under half of one; give it a larger weight"
            )
    return split_units(total, weights)


def parse_split(spec: SplitSpec, n: int, flag: str = "--split") -> Weights | str | None:
    """`--split` for `n` tensor ranks: '3:1' (or (3, 1)) -> (3.0, 1.0); 'memory' ->
    'memory'; None or equal weights -> None (the balanced split). SplitError, one line
    naming the flag and the numbers, for anything else."""
    if spec is None or (isinstance(spec, str) and spec.strip() in ("", "balanced")):
        return None
    if isinstance(spec, str) and spec.strip() == MEMORY:
        return MEMORY
    text = spec if isinstance(spec, str) else ":".join(f"{w:g}" for w in spec)
    try:
        weights = tuple(float(w) for w in (spec.split(":") if isinstance(spec, str) else spec))
    except (TypeError, ValueError):
        raise SplitError(
            f"{flag} {text}: expected one weight per tensor rank like 3:1, or 'memory'"
        ) from None
    if len(weights) != n:
        ranks = f"{n} tensor rank{'s' * (n != 1)}"
        count = f"{len(weights)} weight{'s' * (len(weights) != 1)}"
        raise SplitError(f"{flag} {text} has {count}, but there are {ranks}")
    bad = [(r, w) for r, w in enumerate(weights) if not (w > 0 and math.isfinite(w))]
    if bad:
        r, w = bad[0]
        raise SplitError(f"{flag} {text}: every weight must be positive, rank {r} has {w:g}")
    return None if len(set(weights)) == 1 else weights


def fixed_weights(spec: SplitSpec, n: int, command: str) -> Weights | None:
    """`parse_split` for a command that runs no ranks (plan, convert): 'memory' is refused,
    there being no running ranks to measure."""
    weights = parse_split(spec, n)
    if weights == MEMORY:
        raise SplitError(
            f"--split memory is measured on the running ranks at start-up: {command} needs "
            "weights like --split 3:1 (python -m llama_tp.doctor suggests them)"
        )
    return weights


def weights_text(weights: Sequence[float] | None) -> str:
    """(3, 1) -> '3:1'; (12e9, 4e9) -> '3:1'; (2.5, 1) -> '2.5:1'; None -> 'balanced'
    (the smallest weight as 1, two decimals at most)."""
    if weights is None:
        return "balanced"
    low = min(weights)
    return ":".join(f"{round(w / low, 2):g}" for w in weights)


def same_split(a: Sequence[float] | None, b: Sequence[float] | None) -> bool:
    """Whether two splits give the same shares (None: balanced; 6:2 is 3:1)."""
    a, b = a or (1.0,) * len(b or ()), b or (1.0,) * len(a or ())
    if len(a) != len(b):
        return False
    return all(abs(x / sum(a) - y / sum(b)) < 1e-9 for x, y in zip(a, b, strict=True))


def shares(weights: Sequence[float] | None, n: int) -> list[float]:
    """Each rank's fraction of the work (sums to 1)."""
    w = list(weights or [1.0] * n)
    return [x / sum(w) for x in w]


def split_text(weights: Sequence[float] | None) -> str:
    """'split 3:1 (75.0% / 25.0%)' or 'balanced split'."""
    if weights is None:
        return "balanced split"
    percent = " / ".join(f"{100 * s:.1f}%" for s in shares(weights, len(weights)))
    return f"split {weights_text(weights)} ({percent})"


def per_tensor_rank(values: Sequence[float], owner: Mapping[int, int], tp: int) -> list[float]:
    """The least value of the ranks that hold each tensor rank's share (`owner`: rank ->
    its tensor rank; with pipeline stages or replicas, several ranks share one)."""
    return [min(v for r, v in enumerate(values) if owner[r] == t) for t in range(tp)]


def memory_split(available: Sequence[int], owner: Mapping[int, int], tp: int) -> Weights | None:
    """`--split memory`: each tensor rank's weight is its available memory (the least of
    its ranks: `per_tensor_rank`); None when all are equal (balanced)."""
    least = per_tensor_rank(available, owner, tp)
    if min(least) <= 0:
        raise SplitError(f"--split memory: tensor rank {least.index(min(least))} has no memory")
    return None if len(set(least)) == 1 else tuple(float(a) for a in least)


SIMILAR = 1.1  # suggested weights within 10% of each other: the balanced split


def suggested(weights: Sequence[float]) -> Weights | None:
    """Weights to suggest: the smallest as 1, one decimal (2.97:1 -> 3:1); None (balanced)
    when they differ by less than `SIMILAR`."""
    low = min(weights)
    if max(weights) < SIMILAR * low:
        return None
    return tuple(round(w / low, 1) for w in weights)


def speed_weights(seconds: Sequence[float]) -> Weights:
    """Weights that balance the time per step: each rank's share in proportion to its
    speed (1 / its time for the same work)."""
    return tuple(1.0 / s for s in seconds)


def predicted_slowdown(weights: Sequence[float] | None, speeds: Sequence[float]) -> float:
    """The time per step of the compute a split divides, against the balanced split's,
    on ranks of relative `speeds`: max(share / speed) over max(1/n / speed)."""
    n = len(speeds)
    mine = max(s / v for s, v in zip(shares(weights, n), speeds, strict=True))
    return mine / max((1 / n) / v for v in speeds)
