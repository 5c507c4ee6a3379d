"""What the server knows about itself: every rank's memory and step time, the mesh,
the queue, live tokens/s and the watchdog, for `GET /v1/status` (the chat page's
cluster panel) and `GET /metrics`.

Every rank times its own steps (`StepClock`). About once a second (`REPORT_EVERY`)
rank 0 marks its next decision `report`; the decision reaches every rank in the
scheduler's one broadcast, so every rank then joins the same `all_gather_object` of
`RankReport`s (no rank can skip it or wait in it alone) and rank 0 keeps the
answers in its `Monitor`. On an idle server the report rides on the idle tick.

Rank 0's `Monitor` also sees every event the scheduler hands to a request (tokens
in and out, time to the first token and between tokens, prompt-cache hits) and
every step's batch size; `llama_tp.server.metrics` exports the same figures.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

import mlx.core as mx

from ..cluster import watchdog
from ..cluster.distributed import all_gather_object
from ..cluster.memory import MemoryFiguresError, memory_figures

REPORT_EVERY = 1.0  # seconds between the ranks' reports
RATE_WINDOW = 5.0  # seconds of events behind the live tokens/s


@dataclass
class RankReport:
    """One rank's figures, as gathered to rank 0 (bytes, seconds)."""

    rank: int
    host: str
    stage: int  # pipeline stage
    tensor: int  # rank in its stage's tensor group
    replica: int  # data-parallel replica (--dp)
    active_memory: int  # MLX's allocated bytes now
    peak_memory: int  # MLX's peak since start
    machine_total: int | None  # this machine's memory (None: unreadable)
    machine_available: int | None
    step_seconds: float | None  # mean generation step since the last report (None: none)
    steps: int  # generation steps since start


class StepClock:
    """A rank's generation-step times since its last report."""

    def __init__(self) -> None:
        self.total, self.count, self.steps = 0.0, 0, 0
        self.last: float | None = None

    def add(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1
        self.steps += 1

    def take(self) -> float | None:
        """The mean step since the last call (the last known one when no step ran)."""
        if self.count:
            self.last = round(self.total / self.count, 6)
        self.total, self.count = 0.0, 0
        return self.last


def local_report(rank: int, mesh, clock: StepClock) -> RankReport:
    """This rank's report. `mesh` (parallel.mesh.Mesh or None: tensor-parallel only)."""
    stage, tensor, replica = (0, rank, 0) if mesh is None else (mesh.stage, mesh.tp_rank, 0)
    if mesh is not None and mesh.dp > 1:
        replica = mesh.replica
    try:
        total, available = memory_figures(rank)
    except MemoryFiguresError:
        total = available = None
    return RankReport(
        rank=rank,
        host=socket.gethostname(),
        stage=stage,
        tensor=tensor,
        replica=replica,
        active_memory=mx.get_active_memory(),
        peak_memory=mx.get_peak_memory(),
        machine_total=total,
        machine_available=available,
        step_seconds=clock.take(),
        steps=clock.steps,
    )


def gather_reports(group: mx.distributed.Group, mesh, clock: StepClock) -> list[RankReport]:
    """Every rank's report, in rank order (collective: every rank calls it after the same
    decision)."""
    mine = local_report(group.rank(), mesh, clock)
    if group.size() == 1:
        return [mine]
    with watchdog.stage("status exchange"):
        return all_gather_object(mine, group)


@dataclass
class Flow:
    """A request's timing as rank 0 sees its events."""

    submitted: float
    last: float | None = None  # when its last token arrived
    tokens: int = 0  # completion tokens so far


class Monitor:
    """Rank 0's view of the server (thread-safe: the step loop writes, HTTP reads).

    `sink` (e.g. `metrics.Metrics`) receives the same observations as they happen.
    """

    def __init__(self, ranks: int = 1, mesh=None, sink=None) -> None:
        self.ranks, self.mesh, self.sink = ranks, mesh, sink
        self.started = time.time()
        self.reports: list[RankReport] = []
        self.reported_at: float | None = None  # monotonic time of the last reports
        self._due = 0.0
        self._flows: dict[int, Flow] = {}
        self._recent: deque[tuple[float, int]] = deque()  # (time, completion tokens)
        self.batch = 0  # sequences in the last step
        self.batching = "continuous"  # or why the server runs one sequence at a time
        self.tokens_in = self.tokens_out = self.cache_hits = self.finished = 0
        self._lock = threading.Lock()

    # -- the step loop (rank 0) --

    def due(self) -> bool:
        """Whether the next decision asks every rank for its report (about once a second)."""
        now = time.monotonic()
        if now < self._due:
            return False
        self._due = now + REPORT_EVERY
        return True

    def update(self, reports: list[RankReport]) -> None:
        with self._lock:
            self.reports, self.reported_at = reports, time.monotonic()

    def stepped(self, batch: int) -> None:
        self.batch = batch
        if self.sink is not None:
            self.sink.stepped(batch)

    def submitted(self, uid: int) -> None:
        """A request was queued (from the HTTP thread)."""
        with self._lock:
            self._flows[uid] = Flow(time.monotonic())

    def forget(self, uids: list[int]) -> None:
        """Requests that ended without a last event (cancelled while waiting, failed)."""
        with self._lock:
            for uid in uids:
                self._flows.pop(uid, None)

    def event(self, e) -> None:
        """An engine event (`engine.sequence.Event`) reached its request."""
        now = time.monotonic()
        with self._lock:
            flow = self._flows.get(e.uid)
            if flow is None:
                return
            new = e.completion_tokens - flow.tokens
            first = flow.last is None and new > 0
            gap = None if flow.last is None or new <= 0 else (now - flow.last) / new
            if new > 0:
                flow.tokens, flow.last = e.completion_tokens, now
                self.tokens_out += new
                self._recent.append((now, new))
            if first:
                self.tokens_in += e.prompt_tokens
                self.cache_hits += e.cached_tokens > 0
            if e.finish_reason:
                del self._flows[e.uid]
                self.finished += 1
        if self.sink is not None:
            if first:
                self.sink.first_token(now - flow.submitted, e.prompt_tokens, e.cached_tokens)
            if new > 0:
                self.sink.tokens(new, gap)

    def embedded(self, e) -> None:
        """An embedding request's end (`engine.batch_messages.Embedded`)."""
        if e.vectors is not None and self.sink is not None:
            self.sink.embedded(len(e.vectors), e.prompt_tokens)

    # -- the HTTP side --

    def tokens_per_second(self) -> float:
        """Completion tokens per second over the last RATE_WINDOW seconds."""
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW:
                self._recent.popleft()
            n = sum(k for _, k in self._recent)
        return n / RATE_WINDOW

    def snapshot(self, scheduler, model: str | None) -> dict:
        """The JSON of GET /v1/status."""
        with self._lock:
            reports = [asdict(r) for r in self.reports]
            age = (
                None if self.reported_at is None else round(time.monotonic() - self.reported_at, 3)
            )
            totals = {
                "prompt_tokens": self.tokens_in,
                "completion_tokens": self.tokens_out,
                "prompt_cache_hits": self.cache_hits,
                "finished_requests": self.finished,
            }
        mesh = self.mesh
        shape = {"tp": self.ranks, "pp": 1, "dp": 1}
        if mesh is not None:
            shape = {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp}
        problem = scheduler.unavailable()
        return {
            "object": "status",
            "model": model,
            "state": "ok" if problem is None else problem.code,
            "uptime": round(time.time() - self.started, 3),
            "mesh": {"ranks": self.ranks, **shape},
            "ranks": reports,
            "reported_seconds_ago": age,
            "queue": scheduler.queued(),
            "running": sum(scheduler.rows()),
            "embedding_requests": scheduler.embeddings(),  # open: waiting or computed
            "last_batch": self.batch,  # sequences in the last step
            "max_batch": scheduler.max_batch,
            "batching": self.batching,  # "continuous", or why one sequence at a time
            "tokens_per_second": round(self.tokens_per_second(), 3),
            "totals": totals,
            "watchdog": watchdog.state(),
        }
