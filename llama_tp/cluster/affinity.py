"""Each local rank on its own cores (Linux).

Several ranks on one machine each run a compute thread, a Python thread and MLX's ring
socket threads, which spin on a non-blocking `recv` while a collective waits. Left to
the scheduler, 2 ranks on 2 cores keep migrating and preempting each other at every one
of a token's ~60 collectives; each rank on its own core generated 72-75 tokens/s where
the same launch unpinned made 13-58, next to other jobs (docs/cpu-kernels.md, "Two ranks
on one machine").

`python -m llama_tp.launch -n N` on one machine sets `LLAMA_TP_CORES` to N groups of
this machine's usable cores, `0/1` or `0,1/2,3` (rank r takes group r), when N divides
into them; `world()` applies it once, after the backend started its threads. Set it
yourself (`--env LLAMA_TP_CORES=...`) to choose the cores, or to `off`.
"""

from __future__ import annotations

import os
import sys

CORES_ENV = "LLAMA_TP_CORES"


def usable_cores() -> list[int]:
    """The cores this process may run on (all of them when the OS cannot tell)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def rank_cores(ranks: int, cores: list[int]) -> str | None:
    """`LLAMA_TP_CORES` for `ranks` local ranks over `cores`: equal groups, rank r's
    r-th (None: fewer cores than ranks, or no way to pin here)."""
    if not hasattr(os, "sched_setaffinity") or ranks < 2 or len(cores) < ranks:
        return None
    k = len(cores) // ranks
    return "/".join(",".join(map(str, cores[r * k : (r + 1) * k])) for r in range(ranks))


def parse_cores(spec: str, rank: int) -> list[int]:
    """Rank `rank`'s cores in a `LLAMA_TP_CORES` value ("0/1", "0,1/2,3"; groups are
    taken round robin when there are fewer groups than ranks). ValueError if malformed."""
    groups = spec.split("/")
    try:
        cores = [int(c) for c in groups[rank % len(groups)].split(",")]
    except ValueError:
        raise ValueError(
            f"{CORES_ENV}: expected groups of cores like 0,1/2,3, got {spec!r}"
        ) from None
    return cores


def pin_threads(cores: list[int]) -> list[int]:
    """Every thread of this process onto `cores` (threads started later inherit it).
    Returns the cores read back. OSError if the OS refuses."""
    allowed: set[int] = set()
    # Threads already running (MLX's stream and socket threads, OpenBLAS's) keep their
    # own affinity: set each one.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cores))
            allowed |= os.sched_getaffinity(int(tid))
        except ProcessLookupError:  # a thread that just ended
            continue
    return sorted(allowed)


_applied = False


def apply_launch_cores(rank: int) -> list[int] | None:
    """Pin this rank as `LLAMA_TP_CORES` says, once per process; None when unset, `off`,
    or not Linux. A value that cannot be applied warns on stderr once and runs unpinned
    (the launch is still correct, only slower)."""
    global _applied
    if _applied:  # world() asks on every call
        return None
    spec = os.environ.get(CORES_ENV, "")
    if not spec or spec == "off" or not os.path.isdir("/proc/self/task"):
        return None
    _applied = True
    try:
        return pin_threads(parse_cores(spec, rank))
    except (ValueError, OSError) as e:
        print(f"warning: {CORES_ENV}={spec}: not pinned: {e}", file=sys.stderr, flush=True)
        return None
