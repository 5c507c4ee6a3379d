"""Arrays from the ranks that have them to the ranks that need them, over MLX's backend.

    needs = [Need(dst=1, index=0, nbytes=4096, servers=(0,), label="layers.0.w1")]
    jobs = schedule(needs, group.size(), ring=True)      # pure: who sends what, by which path
    stats = run(jobs, group, read, deliver)              # collective: every rank calls it

Every byte goes through `mx.distributed.send` / `recv`, so it takes whatever link the
group runs on (the ring over Thunderbolt or Ethernet, JACCL, MPI); no socket of our own.
MLX's ring backend sends only to a rank's two neighbours, so on a ring a job to a rank
further away is relayed by the ranks between (`ring_path`); other backends send direct.

A job is one array: the source reads it (`read(job)`), sends a small header (dtype,
shape, size, checksum) and the data; each relay forwards both; the destination checks size
and checksum on arrival and hands the array on (`deliver(job, array)`). A source
keeps at most two arrays alive (one being sent while it reads the next), a relay one,
a destination what it delivered plus one in flight. When `several` ranks can serve a
need, `schedule` shares the work between them by bytes and hops.

The jobs run in rounds of about `ROUND_BYTES`; each round ends with one small
all-gather of every rank's errors (a source that could not read, a checksum that did
not match: `TransferError` on every rank, naming the rank and the array), which is
also what moves the progress bar and the watchdog of ranks that wait meanwhile. A
rank that dies mid-round leaves the others in a receive: the watchdog ends them
(`cluster/watchdog.py`), its line naming what was in flight (`watchdog.doing`).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from . import watchdog
from .distributed import all_gather_object, first_line

ROUND_BYTES = 256 << 20  # bytes per round: one small all-gather each, ~1 s at 256 MB/s
_MAGIC = 0x6C74_7077  # "ltpw": a header, not data out of step
_SLOTS = 8  # dimensions a header carries
_PIECES = 64  # of an array, summed apart by `checksum`
_H = 5 + _SLOTS  # magic, sequence number, status, dtype, ndim, shape..., then checksum, nbytes
HEADER = _H + 2
DTYPES = (
    mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32,
    mx.int64, mx.float16, mx.bfloat16, mx.float32,
)  # fmt: skip


class TransferError(RuntimeError):
    """An array could not be read, or arrived damaged: raised on every rank."""


@dataclass(frozen=True)
class Need:
    """Rank `dst` needs its array number `index` (`nbytes`, about), which any of `servers`
    can read; `label` names it in messages (a tensor's name)."""

    dst: int
    index: int
    nbytes: int
    servers: tuple[int, ...]
    label: str = ""


@dataclass(frozen=True)
class Job:
    """One array from `path[0]` to `path[-1]`, relayed by the ranks between."""

    dst: int
    index: int
    nbytes: int
    path: tuple[int, ...]
    label: str = ""

    @property
    def src(self) -> int:
        return self.path[0]


@dataclass
class Stats:
    """What this rank moved: bytes it read and sent, relayed, and received (checked)."""

    sent: int = 0
    relayed: int = 0
    received: int = 0
    seconds: float = 0.0
    peers: set[int] = field(default_factory=set)  # the ranks it received from


def ring_path(src: int, dst: int, n: int) -> tuple[int, ...]:
    """The ranks from `src` to `dst` the short way round a ring of `n` (rightwards on a tie)."""
    right = (dst - src) % n
    step = 1 if right <= n - right else -1
    path = [src]
    while path[-1] != dst:
        path.append((path[-1] + step) % n)
    return tuple(path)


def schedule(needs: list[Need], size: int, ring: bool) -> list[Job]:
    """The jobs for `needs`, in the order every rank runs them: destinations taken in
    turn (so that each round keeps every link busy), each need served by the server
    with the least work so far, counting a relayed byte once per hop."""
    by_dst: dict[int, deque[Need]] = {}
    for n in needs:
        if not n.servers:
            raise ValueError(f"rank {n.dst} needs {n.label or n.index} and no rank has it")
        by_dst.setdefault(n.dst, deque()).append(n)
    work = dict.fromkeys(range(size), 0)
    jobs = []
    while by_dst:
        for dst in sorted(by_dst):
            n = by_dst[dst].popleft()
            if not by_dst[dst]:
                del by_dst[dst]
            paths = {s: ring_path(s, dst, size) if ring else (s, dst) for s in n.servers}
            src = min(n.servers, key=lambda s: (work[s] + n.nbytes * (len(paths[s]) - 1), s))
            work[src] += n.nbytes * (len(paths[src]) - 1)
            jobs.append(Job(dst, n.index, n.nbytes, paths[src], n.label))
    return jobs


def rounds(jobs: list[Job], nbytes: int = ROUND_BYTES) -> list[list[Job]]:
    """`jobs` cut, in order, into rounds of about `nbytes` (at least one job each)."""
    out: list[list[Job]] = []
    size = nbytes
    for j in jobs:
        if size >= nbytes:
            out.append([])
            size = 0
        out[-1].append(j)
        size += j.nbytes
    return out


def checksum(a: mx.array) -> int:
    """A 63-bit checksum of an evaluated array's bytes, at memory speed (~7 GB/s on one
    core, three times zlib's CRC-32): the wrapping 64-bit sums of the words of 64
    consecutive pieces, with the size and the bytes past the last word, hashed. A
    changed byte, a piece missing, cut short or out of place changes it."""
    try:
        buf = memoryview(a).cast("B")
    except (BufferError, TypeError, ValueError):  # not row-contiguous
        c = mx.contiguous(a)
        mx.eval(c)
        buf = memoryview(c).cast("B")
    words = np.frombuffer(buf, dtype=np.uint64, count=len(buf) // 8)
    sums = np.zeros(0, dtype=np.uint64)
    if len(words):
        starts = np.unique(np.linspace(0, len(words), _PIECES + 1, dtype=np.int64)[:-1])
        sums = np.add.reduceat(words, starts)
    h = hashlib.blake2b(sums.tobytes(), digest_size=8)
    h.update(bytes(buf[len(words) * 8 :]) + len(buf).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") >> 1


def _header(seq: int, a: mx.array | None, check: int = 0) -> mx.array:
    if a is None:  # the source failed: no data follows
        return mx.array([_MAGIC, seq, 1] + [0] * (HEADER - 3), dtype=mx.int64)
    if a.ndim > _SLOTS:
        raise ValueError(f"cannot send an array of {a.ndim} dimensions")
    shape = list(a.shape) + [0] * (_SLOTS - a.ndim)
    values = [_MAGIC, seq, 0, DTYPES.index(a.dtype), a.ndim, *shape, check, a.nbytes]
    return mx.array(values, dtype=mx.int64)


class _Rank:
    """One rank's part of a run: its sends in flight, its arrivals to check."""

    def __init__(self, group, read, deliver, stats: Stats):
        self.group, self.read, self.deliver, self.stats = group, read, deliver, stats
        self.me = group.rank()
        self.in_flight: deque[list[mx.array]] = deque()
        self.arrivals: deque[tuple[Job, list[int], mx.array]] = deque()
        self.error: str | None = None
        # LLAMA_TP_FAULT=die-sending:rankR (tests only): rank R is killed after its first send
        self.die = os.environ.get("LLAMA_TP_FAULT") == f"die-sending:rank{self.me}"

    def put(self, arrays: list[mx.array], dst: int) -> None:
        """Send `arrays` in order to `dst` (queued: at most two jobs in flight)."""
        while len(self.in_flight) > 1:  # one being sent, one queued, one being read
            mx.eval(self.in_flight.popleft())
        out = []
        for a in arrays:  # one evaluation each: the stream keeps their order, one graph may not
            out.append(mx.distributed.send(a, dst, group=self.group, stream=mx.cpu))
            mx.async_eval(out[-1])
        self.in_flight.append(out)

    def take(self, shape: tuple[int, ...], dtype: mx.Dtype, src: int) -> mx.array:
        """The next array from `src` (lazy: queued behind what came before)."""
        return mx.distributed.recv(shape, dtype, src, group=self.group, stream=mx.cpu)

    def source(self, seq: int, job: Job) -> None:
        try:
            a = self.read(job)
            mx.eval(a)
            header = _header(seq, a, checksum(a))
        except Exception as e:  # tell the receiver, then every rank at the round's end
            self.error = self.error or f"rank {self.me} could not read {job.label}: {first_line(e)}"
            self.put([_header(seq, None)], job.path[1])
            return
        self.put([header, a], job.path[1])
        self.stats.sent += a.nbytes
        if self.die:  # the test hook: this rank stops dead mid-transfer
            mx.eval(self.in_flight[-1])
            os.kill(os.getpid(), signal.SIGKILL)

    def receive(self, seq: int, job: Job, prev: int, nxt: int | None) -> None:
        h = self.take((HEADER,), mx.int64, prev)
        mx.eval(h)
        values = h.tolist()
        if values[0] != _MAGIC or values[1] != seq:
            raise TransferError(
                f"rank {self.me} received out of step from rank {prev} (expected "
                f"{job.label}, array {seq}): the ranks disagree on what to send"
            )
        a = None
        if values[2] == 0:
            ndim = values[4]
            a = self.take(tuple(values[5 : 5 + ndim]), DTYPES[values[3]], prev)
        if nxt is not None:  # a relay: pass both on
            self.put([h] if a is None else [h, a], nxt)
            self.stats.relayed += 0 if a is None else a.nbytes
            return
        if a is None:
            return
        mx.async_eval(a)
        self.stats.peers.add(job.src)
        self.arrivals.append((job, values, a))
        while len(self.arrivals) > 1:  # the one before this has fully arrived
            self.check(*self.arrivals.popleft())

    def check(self, job: Job, values: list[int], a: mx.array) -> None:
        mx.eval(a)
        crc, nbytes = values[_H], values[_H + 1]
        if a.nbytes != nbytes or checksum(a) != crc:
            self.error = self.error or (
                f"rank {self.me} received {job.label} from rank {job.src} damaged "
                f"({a.nbytes} bytes, checksum {checksum(a):016x}; sent {nbytes} bytes, "
                f"{crc:016x})"
            )
            return
        self.stats.received += a.nbytes
        self.deliver(job, a)

    def finish(self) -> None:
        while self.in_flight:
            mx.eval(self.in_flight.popleft())
        while self.arrivals:
            self.check(*self.arrivals.popleft())


def run(
    jobs: list[Job],
    group: mx.distributed.Group,
    read: Callable[[Job], mx.array],
    deliver: Callable[[Job, mx.array], None],
    done: Callable[[int], None] | None = None,
    round_bytes: int = ROUND_BYTES,
) -> Stats:
    """Run `jobs` (the same list on every rank: `schedule`'s); collective over `group`.
    This rank reads the jobs it is the source of, relays those that pass it and checks
    and `deliver`s those it is the destination of; `done(nbytes)` after each round (a
    progress bar). Raises TransferError on every rank when any job failed."""
    stats = Stats()
    tic = time.perf_counter()
    me = _Rank(group, read, deliver, stats)
    all_rounds = rounds(jobs, round_bytes)
    seq = 0
    for number, batch in enumerate(all_rounds, 1):
        first = batch[0]
        # a rank that only waits names the round's first job if a peer is lost
        watchdog.progress(f"sending the weights (round {number} of {len(all_rounds)})", "load")
        watchdog.doing(f"while rank {first.src} sent {first.label} to rank {first.dst}")
        for job in batch:
            seq += 1
            if me.me not in job.path:
                continue
            i = job.path.index(me.me)
            if i == 0:
                watchdog.doing(f"while sending {job.label} to rank {job.dst}")
                me.source(seq, job)
                continue
            nxt = job.path[i + 1] if i + 1 < len(job.path) else None
            watchdog.doing(f"while receiving {job.label} from rank {job.src}")
            me.receive(seq, job, job.path[i - 1], nxt)
        watchdog.doing(f"while waiting for the other ranks' weights (round {number})")
        me.finish()
        errors = [e for e in all_gather_object(me.error, group) if e]
        if errors:
            watchdog.doing(None)
            raise TransferError(errors[0])
        if done is not None:
            done(sum(j.nbytes for j in batch))
    watchdog.doing(None)
    stats.seconds = time.perf_counter() - tic
    return stats
