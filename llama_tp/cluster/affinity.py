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

Pinned ranks keep every core busy (the ring's socket threads spin while a collective
waits), and under Linux's autogroups (one scheduling group per session, the default)
they then starve the other sessions: a browser, an HTTP client, the shell. Measured on
this 2-core machine (kernel 6.18), with a process in another session that wakes every
50 ms: while 2 pinned ranks generated 1,500 tokens it went 4-24 s without running, in
each of 5 runs, and a client streaming from a 2-rank server got nothing for 21-44 s at
a time. With the ranks' session at nice 10 no wait passed 0.3 s (2 runs of each),
and the ranks generated as fast (47-53 tokens/s either way; nice 5 still left 2-5 s
waits next to the server). Ranks in the client's own session, or autogroups off, or
ranks over Open MPI (one run) showed no waits. So while its ranks are pinned the
launcher runs its session at nice 10 (`yielding_session`) and restores it after;
`LLAMA_TP_SESSION_NICE` sets another value (0: leave the session as it is).
bench/session_waits.py measures it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

CORES_ENV = "LLAMA_TP_CORES"
AUTOGROUP = "/proc/self/autogroup"  # "/autogroup-42 nice 0": this session's group
SESSION_NICE = 10  # the least of 5, 10, 19 that kept the waits under 0.3 s
NICE_ENV = "LLAMA_TP_SESSION_NICE"


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


def session_nice() -> int | None:
    """This session's autogroup nice value (None: no autogroups here)."""
    try:
        with open(AUTOGROUP) as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_session_nice(nice: int) -> bool:
    for _attempt in range(2):
        try:
            with open(AUTOGROUP, "w") as f:
                f.write(str(nice))
            return True
        except BlockingIOError:  # EAGAIN: the kernel allows one change per 100 ms
            time.sleep(0.11)
        except OSError:
            return False
    return False


def launch_nice() -> int:
    """The nice value for a session of pinned ranks: `LLAMA_TP_SESSION_NICE`, else 10.
    ValueError names the variable when it is not an integer from 0 to 19."""
    value = os.environ.get(NICE_ENV, "").strip()
    if not value:
        return SESSION_NICE
    if not (value.isdigit() and 0 <= int(value) <= 19):
        raise ValueError(f"{NICE_ENV} must be an integer from 0 to 19, got {value!r}")
    return int(value)


@contextlib.contextmanager
def yielding_session(nice: int = SESSION_NICE) -> Iterator[None]:
    """Run this session's scheduling group at `nice` inside the block, and restore it
    after (see the module's docstring). Nothing changes without autogroups, or for a
    session already at `nice` or above (`nice` 0 leaves every session as it is)."""
    before = session_nice()
    if before is None or before >= nice or not _set_session_nice(nice):
        yield
        return
    try:
        yield
    finally:
        _set_session_nice(before)


def lower_session_for_exit(nice: int) -> int | None:
    """Run this session's scheduling group at `nice` until the last of its ranks that
    lowered it exits (then put back what it was): for ranks that pin themselves under
    another launcher, which runs no `yielding_session` for them. The first rank lowers it
    and the others join it (`_session_holders`), so that a rank that ends first does not
    raise the session under one still running. The value to put back, or None when
    nothing changed (no autogroups, `nice` 0, or the session already at `nice` or above
    by another hand)."""
    import atexit

    if not nice or session_nice() is None:
        return None
    try:
        with _session_holders() as held:
            if not held["pids"]:  # the first here: lower it, unless it is low enough
                before = session_nice()
                if before is None or before >= nice or not _set_session_nice(nice):
                    return None
                held["restore"] = before
            held["pids"].append(os.getpid())
    except OSError:  # no temp folder to share it through: the session as it is
        return None
    atexit.register(_release_session)
    _sweep_holders()
    return held["restore"]


def _release_session() -> None:
    """At exit: leave the session's holders; the last one puts its nice back."""
    try:
        with _session_holders() as held:
            if os.getpid() not in held["pids"]:  # a forked child of a holder
                return
            held["pids"].remove(os.getpid())
            if not held["pids"]:
                _set_session_nice(held["restore"])
    except OSError:
        pass


def _sweep_holders() -> None:
    """Remove the files of other sessions whose holders all died without leaving (killed
    ranks): `_session_holders` drops the dead and removes a file that none is left in."""
    import glob

    mine = _holders_file()
    for path in glob.glob(_holders_file("*")):
        if path != mine:
            try:
                with _session_holders(path):
                    pass
            except OSError:
                continue


def _holders_file(group: str | None = None) -> str:
    """The file of the processes that hold session `group` lowered (default: this one's)."""
    import tempfile

    if group is None:
        with open(AUTOGROUP) as f:  # "/autogroup-42 nice 0"
            group = f.read().split()[0].strip("/").removeprefix("autogroup-")
    return os.path.join(tempfile.gettempdir(), f"llama_tp-{os.getuid()}-autogroup-{group}.json")


@contextlib.contextmanager
def _session_holders(path: str | None = None) -> Iterator[dict]:
    """The live processes holding this session (or the one of the file `path`) lowered
    and the nice to put back, `{"pids": [...], "restore": nice}`, under an exclusive lock
    for the block and written back after it (a file per autogroup in the temp folder,
    removed when none is left). Processes that died without leaving are dropped."""
    import fcntl
    import json

    path = path or _holders_file()
    while True:  # the file locked is the one at `path` (not one a last holder removed)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)
    with os.fdopen(fd, "r+") as f:  # closing it unlocks it
        try:
            held = json.loads(f.read() or "{}")
        except ValueError:
            held = {}
        held["pids"] = [p for p in held.get("pids", []) if _alive(p)]
        yield held
        if not held["pids"]:
            os.unlink(path)
            return
        f.seek(0)
        f.truncate()
        f.write(json.dumps(held))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        pass
    return True


BACKGROUND_NICE = 10  # how much lower a background thread runs than its process


def background_thread(by: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's priority by `by` (Linux gives each thread its own nice
    value; elsewhere nothing changes), so that it takes a core only when the process's
    other threads leave one: the server's costly request preparation (tokenizing a
    large prompt, compiling a grammar) beside its step loop and event loop."""
    if sys.platform != "linux":
        return
    import threading

    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + by))
    except OSError:
        pass
