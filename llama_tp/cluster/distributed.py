"""Everything about ranks outside the sharded layers: the group, printing, sharing.

Under `mlx.launch` every rank runs the same program (SPMD); these helpers keep
the ranks in step and make only rank 0 talk to the user.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import mlx.core as mx

from .affinity import apply_launch_cores
from .local_ranks import apply_local_defaults

T = TypeVar("T")


def launched_backend() -> str | None:
    """The backend a launcher set up for this process, told from what it put in the
    environment, in the order `mx.distributed.init(backend="any")` tries them
    (None: started on its own)."""
    env = os.environ
    if "NCCL_HOST_IP" in env and "MLX_WORLD_SIZE" in env:
        return "nccl"
    if "MLX_HOSTFILE" in env and "MLX_RANK" in env:
        return "ring"
    if any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        return "mpi"
    if "MLX_IBV_DEVICES" in env or "MLX_JACCL_COORDINATOR" in env:
        return "jaccl"
    return None


def world() -> mx.distributed.Group:
    """The global group: size 1 when not launched by mlx.launch (or mpirun).

    A process started on its own gets the ring backend's group of one: with Open MPI
    installed, `init()` would otherwise start MPI as a singleton (0.3 s here, and a
    session directory left in /tmp by every run)."""
    if launched_backend() is None:
        return mx.distributed.init(backend="ring")
    group = mx.distributed.init()
    # Ranks on one machine set what a local launch would have (threads, cores), under
    # any launcher; then, after init, the backend's threads are pinned with the rest.
    index = apply_local_defaults(group.rank(), group.size())
    apply_launch_cores(group.rank() if index is None else index)
    return group


def is_rank0(group: mx.distributed.Group | None = None) -> bool:
    return (group or world()).rank() == 0


def print0(*args: Any, group: mx.distributed.Group | None = None, **kwargs: Any) -> None:
    """print() on rank 0 only; other ranks stay silent."""
    if is_rank0(group):
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def eprint0(*args: Any, group: mx.distributed.Group | None = None) -> None:
    """print() to stderr on rank 0 only."""
    print0(*args, group=group, file=sys.stderr)


def barrier(group: mx.distributed.Group | None = None) -> None:
    """Return once every rank got here (a one-element all-reduce on the CPU)."""
    group = group or world()
    if group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def all_gather_bytes(data: bytes, group: mx.distributed.Group | None = None) -> list[bytes]:
    """Every rank's `data`, in rank order, on every rank (two small collectives)."""
    group = group or world()
    if group.size() == 1:
        return [data]
    n = mx.distributed.all_gather(mx.array([len(data)]), group=group, stream=mx.cpu).tolist()
    width = max(n)
    if width == 0:
        return [b""] * group.size()
    buf = mx.zeros((width,), dtype=mx.uint8)
    if data:
        buf[: len(data)] = mx.array(data)  # bytes are uint8 already: no Python int per byte
    rows = mx.distributed.all_gather(buf[None], group=group, stream=mx.cpu)
    mx.eval(rows)
    flat = memoryview(rows).cast("B")  # (N * width,) without copying through Python ints
    return [bytes(flat[i * width : i * width + n[i]]) for i in range(group.size())]


def all_gather_object(obj: Any, group: mx.distributed.Group | None = None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order, on every rank."""
    return [pickle.loads(b) for b in all_gather_bytes(pickle.dumps(obj), group)]


def broadcast_object(obj: Any, group: mx.distributed.Group | None = None) -> Any:
    """Rank 0's `obj` on every rank (the others pass anything, e.g. None)."""
    group = group or world()
    if group.size() == 1:
        return obj
    data = pickle.dumps(obj) if group.rank() == 0 else b""
    return pickle.loads(all_gather_bytes(data, group)[0])


def broadcast_text(text: str | None, group: mx.distributed.Group | None = None) -> str | None:
    """Rank 0's string (or None) on every rank."""
    return broadcast_object(text, group)


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): what
    a rank reports of an error, and what an entry point prints."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class PeerError(RuntimeError):
    """Another rank failed at a point where all ranks compare their outcome."""


def agree_ok(error: BaseException | None, group: mx.distributed.Group | None = None) -> None:
    """Every rank calls this with its own outcome (None: success) at the same point.

    If any rank failed, every rank raises: a failed rank its own exception, the
    others a `PeerError` naming the first failed rank and its message, so that
    rank 0 can print the reason and nobody waits for a rank that gave up.
    """
    group = group or world()
    if group.size() == 1:
        if error is not None:
            raise error
        return
    text = None if error is None else first_line(error)
    failed = [(r, m) for r, m in enumerate(all_gather_object(text, group)) if m is not None]
    if not failed:
        return
    if error is not None:
        raise error
    rank, message = failed[0]
    others = (
        f" (and {len(failed) - 1} more rank{'s' * (len(failed) > 2)})" if len(failed) > 1 else ""
    )
    raise PeerError(f"rank {rank}: {message}{others}")


def agreed(fn: Callable[[], T], group: mx.distributed.Group | None = None) -> T:
    """fn() on this rank, then `agree_ok` on its outcome: its value when it returned on
    every rank of `group`; if it raised on any rank, every rank raises (the failed ranks
    their own exception). Collective: every rank calls it at the same point."""
    value = error = None
    try:
        value = fn()
    except Exception as e:  # every rank must learn of a failure before raising
        error = e
    agree_ok(error, group)
    return value
