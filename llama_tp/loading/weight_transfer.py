"""A receiving rank's slices: from its cache, else over the link from the ranks that have them.

    weights = read_weights(shared, mine, read_local)   # collective over shared.group

Exactly the bytes of the placement (`RankPlacement.slices`: tensor slices, stage,
experts, vocabulary rows, weighted splits, a pre-split folder's tensors, GGUF blocks as
stored) travel, each read by a rank that has the file (`loading/model_sources.py`) and
sent tensor by tensor over the group's own backend (`cluster/transfer.py`: size and
checksum checked on arrival; the work shared when several ranks have the file; relayed
round a ring). Holders read their own slices as usual, meanwhile receivers take what
their cache holds intact (`checkpoints/weights_cache.py`) and ask only for the rest;
what they received is written back to the cache behind the load, while the model runs
(the disk may be slower than the link). A cache that cannot be written (a full disk)
is one warning line from that rank: the partial copy is removed and the model runs on.
What moved is in `shared.stats` (the loader's `load_stats`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from ..checkpoints.base import Checkpoint
from ..checkpoints.slices import model_shape, read_tensor
from ..checkpoints.weights_cache import CacheError, wait_for_writes, write_behind
from ..cluster import transfer, watchdog
from ..cluster.diagnostics import backend_name
from ..cluster.distributed import all_gather_object, first_line
from ..cluster.progress import progress
from ..cluster.watchdog import rank_label
from ..parallel.placement import RankPlacement, Slice
from ..parallel.splits import held_bytes
from .model_sources import Shared, raise_first

Weights = list[tuple[str, mx.array]]


def _estimate(ckpt: Checkpoint, mine: RankPlacement) -> dict[str, int]:
    """About the bytes of each of `mine`'s slices (for the schedule and the progress bar;
    what is counted is what arrives)."""
    tensors = model_shape(ckpt).tensors
    out = {}
    for name, s in mine.slices.items():
        shape, nbytes = tensors[name]
        out[name] = held_bytes(shape, nbytes, s)  # (one slice, or a fused tensor's segments)
    return out


def read_weights(shared: Shared, mine: RankPlacement, read_local: Callable[[], Weights]) -> Weights:
    """This rank's tensors, exactly `mine.slices`, in its order (collective over
    `shared.group`; see the module docstring)."""
    if shared.everyone:
        shared.stats = {"source": "local"}
        return read_local()
    group, me = shared.group, shared.group.rank()
    receiving = me not in shared.holders
    tic = time.perf_counter()
    local: Weights = []
    have: dict[str, mx.array] = {}
    wanted: list[tuple[str, Slice | None, int]] = []
    error = None
    try:
        if receiving:
            missing = list(mine.slices)
            if shared.cache is not None:
                wait_for_writes()  # an earlier load's, in this process
                have, missing = shared.cache.read_entry(shared.fingerprint, mine.slices)
            sizes = _estimate(shared.ckpt, mine)
            wanted = [(n, mine.slices[n], sizes[n]) for n in missing]
        else:
            local = read_local()  # while the receivers read their caches
    except Exception as e:  # every rank learns of it with the others' needs
        error = e
    own = time.perf_counter() - tic  # this rank's own part: its cache, or its file
    asked = all_gather_object((None if error is None else first_line(error), wanted), group)
    raise_first([a[0] for a in asked], error)
    received: dict[str, mx.array] = {}
    needs = [
        transfer.Need(r, i, nbytes, shared.servers(r), name)
        for r, (_, lst) in enumerate(asked)
        for i, (name, _, nbytes) in enumerate(lst)
    ]
    ring = backend_name(group) == "ring"
    jobs = transfer.schedule(needs, group.size(), ring=ring)
    opened: dict[int, Checkpoint] = {}

    def read(job: transfer.Job) -> mx.array:
        name, s, _ = asked[job.dst][1][job.index]
        source = shared.source_for(job.dst, opened)
        return read_tensor(source, name, None if source.format == "split" else s)

    def deliver(job: transfer.Job, a: mx.array) -> None:
        received[asked[job.dst][1][job.index][0]] = a

    stage = watchdog.state()["stage"]
    name = Path(shared.path).name
    total = sum(j.nbytes for j in jobs)
    with progress(desc=f"sending {name}", total=total, unit="B", unit_scale=True, delay=1.0) as bar:
        moved = transfer.run(jobs, group, read, deliver, bar.update)
    if stage:
        watchdog.progress(stage, "load")
    weights = local
    written = 0
    if receiving:
        weights = [(n, have[n] if n in have else received[n]) for n in mine.slices]
        if received and shared.cache is not None:  # while the model runs
            written = sum(a.nbytes for _, a in weights)
            write_behind(shared.cache, shared.fingerprint, mine.slices, dict(weights), _warn)
    shared.stats.update(_stats(receiving, have, received, moved, own, written))
    return weights


def _warn(e: CacheError) -> None:
    """A cache that could not be written: one line from this rank (the model runs on)."""
    line = f"warning: rank {rank_label()}: {e.strerror}; the partial copy was removed "
    print(line + "(the model is loaded)", file=sys.stderr, flush=True)


def _stats(
    receiving: bool,
    have: dict[str, mx.array],
    received: dict[str, mx.array],
    moved: transfer.Stats,
    own_seconds: float,
    written: int,
) -> dict:
    """How this rank got its weights, for `load_stats` (--verbose, doctor, bench)."""
    source = "local"
    if receiving:
        source = "+".join(s for s, used in (("cache", have), ("link", received)) if used)
    return {
        "source": source or "link",
        "bytes_from_cache": sum(a.nbytes for a in have.values()),
        "bytes_received": moved.received,
        "bytes_sent": moved.sent,
        "bytes_relayed": moved.relayed,
        "received_from": sorted(moved.peers),
        "own_seconds": own_seconds,  # its own file, or its cache (before the transfer)
        "transfer_seconds": moved.seconds,
        "cache_written": written,  # being written behind (`weights_cache.write_behind`)
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def where_from(s: dict) -> str:
    """How a rank got its weights, from its `load_stats`: "read 40.1 MB locally, sent
    36.2 MB at 180 MB/s", "read 36.2 MB from its cache", "received 36.2 MB over the link
    from rank 0 at 180 MB/s" (--verbose, doctor)."""
    seconds = s.get("transfer_seconds") or 0.0

    def rate(n: int) -> str:
        return f" at {n / seconds / 1e6:.0f} MB/s" if seconds > 0 else ""

    parts = []
    if s.get("source", "local") == "local":
        parts.append(f"read {_mb(s.get('bytes_read', 0))} locally")
        if s.get("bytes_sent"):
            parts.append(f"sent {_mb(s['bytes_sent'])}{rate(s['bytes_sent'])}")
    if s.get("bytes_from_cache"):
        parts.append(f"read {_mb(s['bytes_from_cache'])} from its cache")
    if s.get("bytes_received"):
        peers = ", ".join(map(str, s.get("received_from", [])))
        ranks = f"rank{'s' * (len(s.get('received_from', [])) > 1)} {peers}"
        got = s["bytes_received"]
        parts.append(f"received {_mb(got)} over the link from {ranks}{rate(got)}")
    if s.get("bytes_relayed"):
        parts.append(f"relayed {_mb(s['bytes_relayed'])}")
    return ", ".join(parts) or "read nothing"
