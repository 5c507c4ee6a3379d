"""The doctor's weights check: where each rank's weights would come from, and how fast.

    python -m llama_tp.launch -n 2 -m llama_tp.doctor --model M   # "weights" row

Every rank sends or receives a test array as loading sends weights (`cluster/transfer.py`:
the same carrier, headers and checksums) from rank 0 to each other rank, timed; with
`--model`, each rank also says whether it reads M itself ("local"), holds its slices in
its cache from an earlier start ("cache", `checkpoints/weights_cache.py`), or would
receive them ("link", from which ranks and at the rate just measured).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..checkpoints.slices import model_shape
from ..cluster import transfer
from ..cluster.diagnostics import Check, backend_name, run_check
from ..cluster.distributed import agreed, all_gather_object
from ..parallel.placement import place

PROBE_BYTES = (16 << 20, 64 << 20)  # quick, full


def link_rates(group: mx.distributed.Group, nbytes: int) -> list[float | None]:
    """Bytes per second a test array of `nbytes` reaches each rank from rank 0 at (None for
    rank 0). Collective."""
    ring = backend_name(group) == "ring"
    n = group.size()
    needs = [transfer.Need(r, 0, nbytes, (0,), "a test array") for r in range(1, n)]
    jobs = transfer.schedule(needs, n, ring=ring)
    probe = mx.zeros((nbytes,), dtype=mx.uint8)
    stats = transfer.run(jobs, group, lambda job: probe, lambda job, a: None)
    got = all_gather_object((stats.received, stats.seconds), group)
    return [None if r == 0 else b / s if s > 0 else None for r, (b, s) in enumerate(got)]


def check_weights(
    group: mx.distributed.Group,
    report: dict[str, Any],
    model: str | None,
    tp: int | None = None,
    pp: int | None = None,
    quick: bool = False,
    weights_cache: Any = None,
) -> Check:
    """The "weights" row (and `report["weights"]`, one entry per rank)."""
    if group.size() == 1:
        return Check("weights", "n/a", "single process: nothing to send")
    nbytes = PROBE_BYTES[0 if quick else 1]
    rates, err = run_check("weights", lambda: link_rates(group, nbytes), group)
    if err:
        return Check("weights", "FAILED", f"cannot send a test array between the ranks: {err}")
    rows = [{"rank": r, "rate": rate} for r, rate in enumerate(rates)]
    report["weights"] = rows
    speed = ", ".join(f"rank {r} {rate / 1e6:.0f} MB/s" for r, rate in enumerate(rates) if rate)
    if model is None:
        return Check("weights", "ok", f"{nbytes >> 20} MB from rank 0 over the link: {speed}")
    sources, err = run_check(
        "weights", lambda: _sources(group, model, tp, pp, weights_cache), group
    )
    if err:
        return Check("weights", "FAILED", f"cannot find {model}: {err}")
    words = []
    for row, (source, holders) in zip(rows, sources, strict=True):
        row["source"], row["from"] = source, holders
        r = row["rank"]
        if source == "link":
            ranks = ", ".join(map(str, holders))
            rate = f" at about {row['rate'] / 1e6:.0f} MB/s" if row["rate"] else ""
            words.append(f"rank {r} over the link from rank {ranks}{rate}")
        else:
            words.append(f"rank {r} {'locally' if source == 'local' else 'from its cache'}")
    return Check("weights", "ok", f"{model}: " + "; ".join(words))


def _sources(group, model: str, tp, pp, cache) -> list[tuple[str, list[int]]]:
    """Every rank's ("local" | "cache" | "link", the ranks that have the file), for the
    plain placement of `model` over the ranks (or the mesh `tp` x `pp`)."""
    from ..loading.kernel_choice import native_kernels
    from ..loading.model_sources import open_shared

    native = native_kernels(None, group)
    shared = agreed(lambda: open_shared(model, group, None, native, cache), group)
    me = group.rank()
    source = "local"
    if me not in shared.holders:
        source = "link"
        if shared.cache is not None:
            T = tp or group.size() // (pp or 1)
            placement = place(model_shape(shared.ckpt), T, pp or 1)
            mine = next(r for r in placement.ranks if r.rank == me)
            if shared.cache.has_entry(shared.fingerprint, mine.slices):
                source = "cache"
    return [(s, shared.holders) for s in all_gather_object(source, group)]
