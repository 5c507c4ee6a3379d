"""Ranks that find themselves on one machine apply the local defaults themselves.

`python -m llama_tp.launch` gives local ranks their defaults in the environment: the
native kernels' threads (this machine's cores over its ranks) and each rank's own cores
(`LLAMA_TP_CORES`, affinity.py). Ranks started by another launcher (`mlx.launch`,
`mpirun`, by hand with `MLX_RANK` + `MLX_HOSTFILE`) get none of it; `world()` calls
`apply_local_defaults` once the group exists, and a rank that learns how many ranks
share its machine sets what is not set already, as the launcher would have:

- which ranks are here: Open MPI's and MPICH's local rank and size; for the ring, the
  hostfile's entries whose addresses are this machine's (a loopback address, or one a
  socket can bind to here);
- `LLAMA_TP_KERNEL_THREADS`: the usable cores over the local ranks;
- `LLAMA_TP_CORES`: equal groups of the usable cores, one per local rank (unless a rank
  already has fewer cores than there are local ranks: mpirun binds its ranks itself);
- the session at nice `LLAMA_TP_SESSION_NICE` (10) while a pinned rank runs, as the
  launcher does for its ranks (affinity.py: pinned ranks starve the other sessions); the
  last of the session's ranks to exit puts it back;
- under `mlx.launch` (the rank's parent is it): its threads at nice 19. mlx's launcher
  (0.32) polls every rank's stdin pipe for writing in a loop that never sleeps (an
  empty pipe is always writable), and its main loop spins once its own stdin is at end
  of file: it holds a core the ranks need (docs/performance.md measures it; the fix
  belongs upstream: select for writing only while there is something to write, and
  stop selecting on a stdin at end of file). At nice 19 it runs only when the ranks'
  cores have nothing else to do. `LLAMA_TP_LAUNCHER_NICE=0` leaves it alone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from functools import lru_cache

from .affinity import CORES_ENV, launch_nice, lower_session_for_exit, rank_cores, usable_cores

THREADS_ENV = "LLAMA_TP_KERNEL_THREADS"
NICE_ENV = "LLAMA_TP_LAUNCHER_NICE"
LAUNCHER_NICE = 19

_done = False
_where: tuple[int, int] | None = None
applied: dict[str, str] = {}  # what apply_local_defaults set (for --verbose and doctor)


def local_ranks(rank: int, size: int) -> tuple[int, int] | None:
    """(this rank's index among the ranks on this machine, how many there are), or None
    when the launcher's environment does not tell."""
    env = os.environ
    for idx, count in (
        ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ):
        if env.get(idx, "").isdigit() and env.get(count, "").isdigit():
            return int(env[idx]), int(env[count])
    path = env.get("MLX_HOSTFILE")
    if not path:
        return None
    try:
        with open(path) as f:
            hosts = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(hosts, list) or len(hosts) != size or not 0 <= rank < size:
        return None
    here = [r for r, h in enumerate(hosts) if _entry_is_local(h)]
    if rank not in here:
        return None
    return here.index(rank), len(here)


def _entry_is_local(entry) -> bool:
    """A ring hostfile entry ("ip:port" or a list of them) whose addresses are all here."""
    items = entry if isinstance(entry, list) else [entry]
    addrs = [str(a).rsplit(":", 1)[0].strip("[]") for a in items]
    return bool(addrs) and all(is_local_address(a) for a in addrs)


@lru_cache(maxsize=64)
def is_local_address(addr: str) -> bool:
    """A loopback address, or one a socket can bind to on this machine."""
    if addr in ("localhost", "::1") or addr.startswith("127."):
        return True
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def apply_local_defaults(rank: int, size: int) -> int | None:
    """Set this rank's local defaults that are not set yet (the first call of a process
    does; `applied` says what it set); this rank's index among the local ranks (None:
    unknown). `world()` calls it after the backend started, then pins the rank."""
    global _done, _where
    if _done:  # world() asks on every call
        return None if _where is None else _where[0]
    _done = True
    _where = where = local_ranks(rank, size) if size > 1 else None
    if where is None:
        return None
    index, count = where
    done: dict[str, str] = {}
    cores = usable_cores()
    if THREADS_ENV not in os.environ:
        done[THREADS_ENV] = str(max(1, len(cores) // count))
    if CORES_ENV not in os.environ and count > 1:
        spec = rank_cores(count, cores)
        if spec is not None:  # fewer cores than local ranks: already bound, or no room
            done[CORES_ENV] = spec  # group i for local rank i
    os.environ.update(done)
    applied.update(done)
    if CORES_ENV in done:  # pinned ranks starve the other sessions: as the launcher does
        _lower_session()
    if _under_mlx_launch() and _lower_launcher():
        applied["mlx.launch"] = f"nice {os.environ.get(NICE_ENV, LAUNCHER_NICE)}"
    return index


def _lower_session() -> None:
    """This session at nice `LLAMA_TP_SESSION_NICE` (10) while this rank runs: pinned
    ranks keep both cores busy, and under Linux's autogroups the other sessions (a shell,
    a browser, an HTTP client) then wait 20-40 s at a time (affinity.py measures it).
    `python -m llama_tp.launch` does this for its ranks; under any other launcher the
    rank that pins itself does it."""
    try:
        nice = launch_nice()
    except ValueError as e:
        print(f"warning: {e}; the session keeps its priority", file=sys.stderr)
        return
    if nice and lower_session_for_exit(nice) is not None:
        applied["session"] = f"nice {nice}"


def _under_mlx_launch() -> bool:
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return "mlx.launch" in cmd or "_distributed_utils/launch" in cmd


def _lower_launcher() -> bool:
    """Every thread of mlx.launch (the parent) at nice `LLAMA_TP_LAUNCHER_NICE` (19);
    whether it was lowered."""
    value = os.environ.get(NICE_ENV, str(LAUNCHER_NICE)).strip()
    if not value.isdigit() or int(value) == 0:
        return False
    ppid = os.getppid()
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{ppid}/task")]
    except OSError:
        tids = [ppid]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < int(value):
                os.setpriority(os.PRIO_PROCESS, tid, int(value))
        except OSError as e:  # another user's launcher, a thread gone
            if tid == ppid:
                print(f"warning: cannot lower mlx.launch's priority: {e}", file=sys.stderr)
                return False
    return True
