"""Re-placing the model over the hosts that remain, or saying in one line why it does not fit.

The memory each remaining host has for the model is what it reported available while the
last generation ran (every rank's `machine_available` in rank 0's /v1/status) plus what
that generation's ranks on it held (their share of the last plan, freed when they
ended). The ranks that remain split the model in proportion to it (`--split memory`,
parallel/shares.py); it fits when no rank's share exceeds its part of its host's memory:

    re-placing SmolLM2-135M-Instruct.Q4_1.gguf over 1 of 2 hosts (127.0.0.1): rank 0 on
    127.0.0.1 holds 97.28 MiB of 21.43 GiB
    cannot re-place model over 1 of 3 hosts (127.0.0.1): rank 0 on 127.0.0.1 would hold
    1.52 MiB of 1.01 MiB available

The checkpoint is read by the supervisor (its header and shapes, no weights); when it
cannot be (a path only the ranks have, no figures yet) the ranks are launched unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .hosts import Layout


@dataclass
class Fit:
    """The outcome: `fits` (or not: `line` says why), and `line` to print either way."""

    fits: bool
    line: str


def _shape(model: str | None):
    """The model's shape (ModelShape) and its name, or None when it cannot be read here."""
    from ..checkpoints import open_checkpoint
    from ..checkpoints.slices import model_shape
    from ..loading.loader import default_model

    path = Path(model) if model else default_model()
    if not path.exists():
        return None
    return model_shape(open_checkpoint(path)), path.name


def rank_bytes(shape, weights: list[float] | None) -> list[int]:
    """Each tensor rank's weight bytes when `shape` splits by `weights` (None: evenly)."""
    from ..parallel.placement import place
    from ..parallel.shares import memory_split

    n = len(weights) if weights is not None else 1
    split = None if weights is None else memory_split(weights, {r: r for r in range(n)}, n)
    return [r.nbytes for r in place(shape, n, 1, split=split).ranks]


def _old_weights(layout: Layout, reports: list[dict], split: str | None) -> list[float]:
    """The weights the last generation split by: `--split memory` from its reports, an
    explicit `--split 3:1`, or even."""
    n = len(layout.hosts)
    if split == "memory" and len(reports) == n:
        return [float(r["machine_available"] or 1) for r in reports]
    if split and split not in ("memory", "balanced"):
        parts = [float(w) for w in split.split(":")]
        if len(parts) == n:
            return parts
    return [1.0] * n


def check(
    model: str | None,
    full: Layout,
    last: Layout,
    remaining: Layout,
    reports: list[dict],
    split: str | None,
    meshed: bool,
) -> Fit:
    """Does the model fit the `remaining` hosts, given the `reports` of the `last` layout
    (one dict per rank: /v1/status's "ranks")? `split`: the last generation's --split;
    `meshed`: it ran with --tp/--pp/--dp (what each rank held is then its reported memory)."""
    names = remaining.names()
    where = f"{len(names)} of {len(full.names())} host{'s' * (len(full.names()) > 1)}"
    where += f" ({', '.join(names)})"
    try:
        found = _shape(model)
    except Exception as e:  # an unreadable checkpoint: the ranks will say so themselves
        found, why = None, f"its checkpoint cannot be read here: {e}"
    else:
        why = "its checkpoint is not on this machine"
    if found is not None and len(reports) != len(last.hosts):
        found, why = None, "the last ranks reported no memory figures"
    if found is None:
        return Fit(True, f"re-placing the model over {where} (memory not checked: {why})")
    shape, name = found
    from ..parallel.plan_text import human_bytes

    if meshed:
        held = [int(r["active_memory"]) for r in reports]
    else:
        held = rank_bytes(shape, _old_weights(last, reports, split))
    have: dict[str, int] = {}
    for rank, report in enumerate(reports):
        host = last.host_of(rank)
        have.setdefault(host, int(report["machine_available"] or 0))
        have[host] += held[rank]
    counts = {n: sum(h.ssh_hostname == n for h in remaining.hosts) for n in names}
    avail = [have.get(h.ssh_hostname, 0) // counts[h.ssh_hostname] for h in remaining.hosts]
    need = rank_bytes(shape, [float(a) for a in avail] if len(avail) > 1 else None)
    worst = max(range(len(need)), key=lambda r: need[r] / max(avail[r], 1))
    if need[worst] > avail[worst]:
        return Fit(
            False,
            f"cannot re-place {name} over {where}: rank {worst} on "
            f"{remaining.host_of(worst)} would hold {human_bytes(need[worst])} of "
            f"{human_bytes(avail[worst])} available ({human_bytes(sum(need))} in all)",
        )
    held_text = ", ".join(
        f"rank {r} on {remaining.host_of(r)} holds {human_bytes(need[r])} of "
        f"{human_bytes(avail[r])}"
        for r in range(len(need))
    )
    return Fit(True, f"re-placing {name} over {where}: {held_text}")
