"""Rank 0's scheduler: the requests' queue and the decision sent to every rank each step.

Rank 0 keeps the requests: a bounded queue of waiting ones and the admitted
ones' event channels. Before every step it makes one `Decision` (which waiting
requests join, which running ones are cancelled, or stop) that the step loop
(server/step_loop.py) sends to every rank; every rank applies it and decodes one
token for the whole batch, or checks the drafts of a lone sequence that asked
for them (`llama_tp.engine.batch.BatchEngine`).

With `--dp D` replicas (each a whole model on its own ranks) the decision is one
per replica: rank 0 sends a new request to the replica with the fewest sequences.

A request with a grammar joins only once every rank has compiled it, so that no rank
compiles one in its step loop: rank 0 compiled it while preparing the request; on more
ranks it waits (`preparing`) while its grammar goes out in one decision and the other
ranks compile it on a thread of their own (`grammar.Prefetch`); the step loop's
exchange brings back what they have compiled (`prepared`). Meanwhile rank 0 ticks
every PREPARE_TICK rather than IDLE_TICK.

An embedding request (`submit_embedding`) is queued on one replica's engine by the next
decision (`Decision.embeds`: the one with the fewest such requests) and works through
its inputs a chunk per step beside the rows being decoded (engine/embeddings.py); its
vectors come back as one `Embedded` event. It takes no row of the batch: at most
`max_queue` of them are open at once.

The HTTP side runs on another thread (uvicorn's event loop); it hands in jobs
with `submit` / `cancel`, and gets its events back through the job's asyncio
queue (`loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from collections import deque
from dataclasses import dataclass

from ..engine.batch import Decision, Embed, Embedded, Event, Join, SamplingParams
from .protocol import RequestError

IDLE_TICK = 0.1  # seconds between idle decisions: the longest a new request waits
PREPARE_TICK = 0.02  # the same while requests wait for the other ranks' grammars


@dataclass
class Failure:
    """What a job's channel receives instead of events when it cannot finish."""

    message: str
    status: int = 503


class Job:
    """One admitted or waiting request, as rank 0's scheduler sees it (a generation, or
    an embedding request: `embed`)."""

    def __init__(
        self, uid: int, prompt: list[int], params: SamplingParams | None, loop, embed=None
    ):
        self.uid, self.prompt, self.params = uid, prompt, params
        self.embed: Embed | None = embed
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def post(self, item: Event | Embedded | Failure) -> None:
        """Hand an event to the job's HTTP handler (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Scheduler:
    """Rank 0's queue of requests and its per-step decisions (thread-safe)."""

    def __init__(self, max_batch: int = 8, max_queue: int = 64, replicas: int = 1, ranks: int = 1):
        self.max_batch, self.max_queue = max_batch, max_queue  # max_batch: per replica
        self.replicas = replicas
        self.served = [0] * replicas  # requests admitted by each replica (/health)
        self._where: dict[int, int] = {}  # running uid -> its replica
        self.ready = False  # every rank has loaded (the /health answer)
        self.closed: str | None = None  # why new requests are refused (stopping, failed)
        self._cond = threading.Condition()
        self.ranks = ranks  # > 1: grammars are compiled by every rank before a request joins
        self._pending: deque[Job] = deque()
        self._preparing: dict[int, Job] = {}  # waiting for the other ranks' grammars
        self._announce: dict[int, str] = {}  # grammars not yet sent to the other ranks
        self._running: dict[int, Job] = {}
        self._embeds: deque[Job] = deque()  # embedding requests not yet in a decision
        self._embedding: dict[int, int] = {}  # queued embedding request uid -> its replica
        self._cancels: set[int] = set()
        self._stop = False
        self._uids = itertools.count(1)
        self._rng = random.SystemRandom()
        self.steps = 0
        self.monitor = None  # status.Monitor: sees submissions and events (status, metrics)

    def unavailable(self) -> RequestError | None:
        """Why requests cannot be served now (503: stopping, failed, or still loading),
        or None: the one place that decides it, for the routes and /health alike."""
        if self.closed:
            return RequestError(self.closed, None, 503, "unavailable", "server_error")
        if not self.ready:
            return RequestError("the model is still loading", None, 503, "loading", "server_error")
        return None

    def submit(self, prompt: list[int], params: SamplingParams, seed: int | None, loop) -> Job:
        """Queue a request; RequestError 429 when the queue is full, 503 when unavailable."""
        with self._cond:
            problem = self.unavailable()
            if problem is not None:
                raise problem
            waiting = len(self._pending) + len(self._preparing)
            if waiting >= self.max_queue:
                raise self._busy(f"{waiting} requests are waiting")
            # Rank 0 picks the seed of an unseeded request: every rank gets it in the decision.
            seed = self._rng.randrange(2**31) if seed is None else seed
            job = Job(next(self._uids), prompt, params.but(seed=seed), loop)
            if params.grammar is not None and self.ranks > 1:
                self._preparing[job.uid] = job
                self._announce[job.uid] = params.grammar
            else:
                self._pending.append(job)
            if self.monitor is not None:
                self.monitor.submitted(job.uid)
            self._cond.notify()
            return job

    def submit_embedding(self, inputs: list[list[int]], pooling: str, loop) -> Job:
        """Queue an embedding request (token ids of each input; the pooling, as
        engine/embeddings.py reads it); RequestError 429 when `max_queue` are open, 503
        when unavailable. Its one event is an `Embedded`."""
        with self._cond:
            problem = self.unavailable()
            if problem is not None:
                raise problem
            open_ = len(self._embeds) + len(self._embedding)
            if open_ >= self.max_queue:
                raise self._busy(f"{open_} embedding requests are open")
            uid = next(self._uids)
            job = Job(uid, [], None, loop, Embed(uid, inputs, pooling))
            self._embeds.append(job)
            self._cond.notify()
            return job

    def _busy(self, what: str) -> RequestError:
        return RequestError(
            f"the server is busy: {what} (--max-queue {self.max_queue}); retry later",
            None,
            429,
            "rate_limit_exceeded",
            "rate_limit_error",
        )

    def embeddings(self) -> int:
        """Embedding requests open (waiting or being computed)."""
        with self._cond:
            return len(self._embeds) + len(self._embedding)

    def cancel(self, uid: int) -> None:
        """The client went away: drop the request (running ones at the next step)."""
        with self._cond:
            waiting = self._preparing.pop(uid, None)
            self._announce.pop(uid, None)
            for queue in (self._pending, self._embeds):
                for job in queue:
                    if job.uid == uid:
                        waiting = job
                        queue.remove(job)
                        break
            if waiting is not None:
                if self.monitor is not None:
                    self.monitor.forget([uid])
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

    def announce(self, decision: Decision) -> None:
        """Put on `decision` (the first replica's: every rank reads it) the grammars the
        other ranks are to compile and the requests still waiting for them."""
        with self._cond:
            decision.prepare, self._announce = self._announce, {}
            decision.awaited = list(self._preparing)

    def prepared(self, ready: list[list[int]]) -> None:
        """The requests each other rank has compiled the grammar of: those all have are
        queued to join."""
        with self._cond:
            done = set(self._preparing).intersection(*map(set, ready)) if ready else set()
            for uid in sorted(done):
                self._pending.append(self._preparing.pop(uid))
            if done:
                self._cond.notify()

    def tick(self) -> float:
        """How long rank 0 waits idle before its next decision."""
        with self._cond:
            return PREPARE_TICK if self._preparing else IDLE_TICK

    def next_decisions(self, active: list[int], wait: float = 0.25) -> list[Decision] | None:
        """Each replica's decision for the next step; None after `wait` seconds idle.

        `active[d]`: rows in replica d's engine. Each waiting request joins the replica
        with the fewest rows (the lowest-numbered of equals) while one has room.
        """
        with self._cond:
            work = self._embeds or self._embedding
            if not (any(active) or self._pending or work or self._stop):
                self._cond.wait(wait)
                if not (self._pending or self._embeds or self._stop):
                    return None
            n = len(active)
            if self._stop:
                return [Decision(stop=True) for _ in range(n)]
            cancelled = self._cancels & self._running.keys()
            self._cancels.clear()
            where = {**self._where, **self._embedding}
            cancels = [sorted(u for u in cancelled if where[u] == d) for d in range(len(active))]
            embeds: list[list[Embed]] = [[] for _ in active]
            load = [list(self._embedding.values()).count(d) for d in range(n)]
            while self._embeds:  # each to the replica with the fewest open
                d = min(range(n), key=lambda i: load[i])
                job = self._embeds.popleft()
                self._running[job.uid], self._embedding[job.uid] = job, d
                embeds[d].append(job.embed)
                load[d] += 1
            rows = [a - len(c) for a, c in zip(active, cancels, strict=True)]
            joins: list[list[Join]] = [[] for _ in active]
            while self._pending:
                d = min(range(len(active)), key=lambda i: rows[i])
                if rows[d] >= self.max_batch:
                    break
                job = self._pending.popleft()
                self._running[job.uid], self._where[job.uid] = job, d
                joins[d].append(Join(job.uid, job.prompt, job.params))
                rows[d] += 1
                self.served[d] += 1
            self.steps += 1
            return [
                Decision(joins=joins[d], embeds=embeds[d], cancels=cancels[d])
                for d in range(len(active))
            ]

    def queued(self) -> int:
        """Requests waiting for a place in a batch (or for the ranks' grammars)."""
        with self._cond:
            return len(self._pending) + len(self._preparing)

    def rows(self) -> list[int]:
        """Each replica's running sequences (its engine's rows after the last step)."""
        with self._cond:
            counts = [0] * self.replicas
            for d in self._where.values():
                counts[d] += 1
            return counts

    def dispatch(self, events: list[Event | Embedded]) -> None:
        """Send each event to its job; finished jobs leave."""
        with self._cond:
            for e in events:
                job = self._running.get(e.uid)
                if job is None:
                    continue
                if self.monitor is not None:
                    seen = self.monitor.embedded if isinstance(e, Embedded) else self.monitor.event
                    seen(e)
                if e.finish_reason:
                    del self._running[e.uid]
                    self._where.pop(e.uid, None)
                    self._embedding.pop(e.uid, None)
                if e.finish_reason != "cancelled":
                    job.post(e)

    def fail_all(self, message: str, status: int = 503) -> None:
        """Answer every open request with an error, and refuse new ones."""
        with self._cond:
            self.closed = self.closed or message
            waiting = [*self._pending, *self._preparing.values(), *self._embeds]
            for job in [*waiting, *self._running.values()]:
                job.post(Failure(message, status))
            if self.monitor is not None:
                self.monitor.forget([*(j.uid for j in waiting), *self._running])
            self._pending.clear()
            self._preparing.clear()
            self._announce.clear()
            self._running.clear()
            self._where.clear()
            self._embeds.clear()
            self._embedding.clear()
