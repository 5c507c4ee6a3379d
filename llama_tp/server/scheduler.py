"""Rank 0's scheduler and the step loop every rank runs.

Rank 0 keeps the requests: a bounded queue of waiting ones and the admitted
ones' event channels. Before every step it makes one `Decision` (which waiting
requests join, which running ones are cancelled, or stop, and whether a batch of
one sequence drafts tokens) and sends it to every rank with one
`broadcast_object`; then every rank applies it and decodes one token for the
whole batch, or verifies the drafts of the one sequence
(`llama_tp.engine.batch.BatchEngine`). With nothing
to do, rank 0 waits on a condition variable for up to `IDLE_TICK` and then sends
an idle decision; the other ranks sleep for that long before they wait for the
next one. MLX's ring backend spins while a rank waits in a collective, so ranks
that waited in the broadcast all the time would burn a core each on an idle
server; this way they are in it only for the last few milliseconds of each tick,
and a new request waits at most one tick. Idle waits are outside any watchdog
stage, so an idle server can stay idle forever while a stalled step still ends
every rank; a rank that dies while idle shows at the next tick.

The HTTP side runs on another thread (uvicorn's event loop); it hands in jobs
with `submit` / `cancel`, and gets its events back through the job's asyncio
queue (`loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from ..cluster import watchdog
from ..cluster.distributed import broadcast_object
from ..engine.batch import BatchEngine, Decision, Event, Join, SamplingParams
from .protocol import RequestError

IDLE_TICK = 0.1  # seconds between idle decisions: the longest a new request waits
IDLE_MARGIN = 0.01  # the other ranks wake this much earlier than rank 0 sends


@dataclass
class Failure:
    """What a job's channel receives instead of events when it cannot finish."""

    message: str
    status: int = 503


class Job:
    """One admitted or waiting request, as rank 0's scheduler sees it."""

    def __init__(self, uid: int, prompt: list[int], params: SamplingParams, loop):
        self.uid, self.prompt, self.params = uid, prompt, params
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def post(self, item: Event | Failure) -> None:
        """Hand an event to the job's HTTP handler (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Scheduler:
    """Rank 0's queue of requests and its per-step decisions (thread-safe)."""

    def __init__(self, max_batch: int = 8, max_queue: int = 64):
        self.max_batch, self.max_queue = max_batch, max_queue
        self.ready = False  # every rank has loaded (the /health answer)
        self.closed: str | None = None  # why new requests are refused (stopping, failed)
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._running: dict[int, Job] = {}
        self._cancels: set[int] = set()
        self._stop = False
        self._uids = itertools.count(1)
        self._rng = random.SystemRandom()
        self.steps = 0

    def submit(self, prompt: list[int], params: SamplingParams, seed: int | None, loop) -> Job:
        """Queue a request; RequestError 429 when the queue is full, 503 when closed."""
        with self._cond:
            if self.closed:
                raise RequestError(self.closed, None, 503, "unavailable", "server_error")
            if not self.ready:
                raise RequestError(
                    "the model is still loading", None, 503, "loading", "server_error"
                )
            if len(self._pending) >= self.max_queue:
                raise RequestError(
                    f"the server is busy: {len(self._pending)} requests are waiting "
                    f"(--max-queue {self.max_queue}); retry later",
                    None,
                    429,
                    "rate_limit_exceeded",
                    "rate_limit_error",
                )
            # Rank 0 picks the seed of an unseeded request: every rank gets it in the decision.
            params.seed = self._rng.randrange(2**31) if seed is None else seed
            job = Job(next(self._uids), prompt, params, loop)
            self._pending.append(job)
            self._cond.notify()
            return job

    def cancel(self, uid: int) -> None:
        """The client went away: drop the request (running ones at the next step)."""
        with self._cond:
            for job in self._pending:
                if job.uid == uid:
                    self._pending.remove(job)
                    return
            if uid in self._running:
                self._cancels.add(uid)
                self._cond.notify()

    def request_stop(self, reason: str = "the server is shutting down") -> None:
        """Stop every rank at the next step (signal handlers call this)."""
        with self._cond:
            self._stop = True
            self.closed = self.closed or reason
            self._cond.notify()

    def next_decision(self, active: int, wait: float = 0.25) -> Decision | None:
        """The next step's decision; None after `wait` seconds idle (call again).

        `active`: rows in the engine. Waiting requests join while the batch has room.
        """
        with self._cond:
            if not (active or self._pending or self._stop):
                self._cond.wait(wait)
                if not (self._pending or self._stop):
                    return None
            if self._stop:
                return Decision(stop=True)
            cancels = sorted(self._cancels & self._running.keys())
            self._cancels.clear()
            joins = []
            while self._pending and active - len(cancels) + len(joins) < self.max_batch:
                job = self._pending.popleft()
                self._running[job.uid] = job
                joins.append(Join(job.uid, job.prompt, job.params))
            self.steps += 1
            # Drafts only when the step's batch is one sequence that asked for them: then
            # a (K+1)-token forward costs little more than a 1-token one; a batch of
            # several already shares each forward, and drafts would multiply its work.
            live = [j for uid, j in self._running.items() if uid not in cancels]
            draft = live[0].params.num_draft_tokens if len(live) == 1 else 0
            return Decision(joins=joins, cancels=cancels, draft=draft)

    def dispatch(self, events: list[Event]) -> None:
        """Send each event to its job; finished jobs leave."""
        with self._cond:
            for e in events:
                job = self._running.get(e.uid)
                if job is None:
                    continue
                if e.finish_reason:
                    del self._running[e.uid]
                if e.finish_reason != "cancelled":
                    job.post(e)

    def fail_all(self, message: str, status: int = 503) -> None:
        """Answer every open request with an error, and refuse new ones."""
        with self._cond:
            self.closed = self.closed or message
            for job in [*self._pending, *self._running.values()]:
                job.post(Failure(message, status))
            self._pending.clear()
            self._running.clear()


def run_steps(
    engine: BatchEngine,
    scheduler: Scheduler | None,
    group: mx.distributed.Group,
) -> None:
    """The step loop: rank 0 (with `scheduler`) decides, every rank applies and decodes.

    Returns after a stop decision. On rank 0 an exception (a lost peer) first answers
    every open request with a 503 error, so that no client is left waiting.
    """
    rank0 = group.rank() == 0
    try:
        while True:
            decision = None
            if rank0:
                decision = scheduler.next_decision(len(engine), wait=IDLE_TICK)
                if decision is None:
                    if group.size() == 1:
                        continue
                    decision = Decision(idle=IDLE_TICK)  # keeps the others sleeping
            if group.size() > 1:
                # The one exchange per step besides the model's own (unarmed: rank 0
                # may still be deciding).
                decision = broadcast_object(decision, group)
            if decision.idle:
                if not rank0:  # rank 0 waits on its queue instead
                    time.sleep(max(0.0, decision.idle - IDLE_MARGIN))
                continue
            if decision.stop:
                if rank0:
                    scheduler.fail_all("the server is shutting down")
                return
            events = []
            if decision.joins or decision.cancels:
                n = sum(len(j.prompt) for j in decision.joins)
                with watchdog.stage(f"prompt processing ({n} tokens)", "load"):
                    events = engine.apply(decision)
            with watchdog.stage(f"generation step ({len(engine)} sequences)"):
                events += engine.step(decision.draft)
            if rank0:
                scheduler.dispatch(events)
    except BaseException as e:
        if rank0 and scheduler is not None:
            scheduler.fail_all(_failure_message(e))
            time.sleep(0.5)  # let the HTTP thread send the errors before the process ends
        raise


def _failure_message(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "the server is shutting down"
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "connection to a peer was lost" in text:
        return f"a rank of the server failed: {watchdog.PEER_LOST}"
    return f"the server failed: {text}"
