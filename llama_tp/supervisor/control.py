"""The supervisor's state machine: launch, watch, detect, drain, relaunch, resume.

    starting -> serving | degraded (N of M hosts) -> recovering -> serving ...
                       \\-> restarting (an operator's POST) -> serving
    down: the model does not fit the hosts that answer (waiting for the others)
    failed: K failures within the window (the supervisor exits 1); stopping: SIGTERM

A fault is seen (`_detect`) from a fault line on the ranks' stderr (`faults.py`), the
launcher's exit, rank 0 answering a request with 503 or not at all (`suspect`), or the
monitor: rank 0's /v1/status, read every second, not answering within the step timeout,
or its ranks' reports older than the step timeout while no stage is armed (a rank
stopped while the server was idle, where no watchdog times anything). The supervisor
then settles briefly (a better line may follow: the rank that was killed rather than the
one that noticed), kills the generation's processes, and relaunches: at once after a
fault, with backoff (1, 2, 4 ... 30 s) after launches that did not come up, and not at
all after `restart_limit` failures within `restart_window` seconds.

Requests wait in `admit` while no generation serves (at most `max_queue` new ones; the
replayed ones always), and are released when the next one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from . import faults
from .admission import PROBE_EVERY, SERVING, Admission
from .command import Spec, rank_argv
from .faults import Fault, Recovery
from .hosts import LOCAL, Layout, unanswered
from .ranks import RankGroup, free_port

SETTLE = 1.5  # seconds a fault's description may still improve before the ranks are killed
STOP_GRACE = 2.0  # seconds the launcher gets to stop its ranks itself, then SIGKILL
MONITOR_EVERY = 1.0  # seconds between reads of rank 0's /v1/status
HOST_ATTEMPTS = 2  # probes a host may fail before the model is re-placed without it
BACKOFF_MAX = 30.0
DRAIN_LIMIT = 60.0  # seconds a planned restart waits for the answers under way


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Supervisor(Admission):
    """Runs generations of ranks for `spec` on `layout`; `client` (an httpx2.AsyncClient)
    reaches rank 0."""

    def __init__(self, spec: Spec, layout: Layout, client):
        self.spec, self.layout, self.client = spec, layout, client
        self.headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        self.state = "starting"
        self.reason: str | None = None  # why down, failed or stopping
        self.generation = 0
        self.group: RankGroup | None = None
        self.current = layout  # the layout the current generation runs on
        self.base: str | None = None  # rank 0's URL
        self.rank_status: dict | None = None  # rank 0's last /v1/status
        self._reported = layout  # the layout of the ranks behind rank_status
        self.restarts = 0
        self.recovery: Recovery | None = None  # the last fault's
        self.failures: deque[float] = deque()  # monotonic times of faults and failed launches
        self.held = 0  # requests waiting for a generation
        self.inflight = 0  # requests at rank 0 now
        self.gone: dict[str, str] = {}  # host -> why it does not answer
        self.back: list[str] = []  # gone hosts that answer again (while degraded)
        self.downtime = 0.0
        self._down_since: float | None = None
        self._misses: dict[str, int] = {}
        self._launch_failures = 0  # in a row
        self._stop = self._planned = False
        self.stop_code = 0
        self._wake = asyncio.Event()  # a fault, a stop or a restart request
        self._changed = asyncio.Event()  # pulsed on every state change
        self._tmp = tempfile.TemporaryDirectory(prefix="llama_tp-supervisor-")

    # -- states --

    def _enter(self, state: str, reason: str | None = None) -> None:
        now = time.monotonic()
        if state in SERVING and self._down_since is not None:
            self.downtime += now - self._down_since
            self._down_since = None
        elif state not in SERVING and state != "starting" and self._down_since is None:
            self._down_since = now
        self.state, self.reason = state, reason
        self._changed.set()
        self._changed = asyncio.Event()

    def downtime_seconds(self) -> float:
        extra = 0.0 if self._down_since is None else time.monotonic() - self._down_since
        return round(self.downtime + extra, 3)

    # -- faults --

    def _line(self, generation: int, line: str) -> None:
        fault = faults.from_line(line)
        if fault is not None:
            self._detect(generation, fault)

    def _detect(self, generation: int, fault: Fault) -> None:
        """Record `fault` of `generation` (the heaviest seen is kept while it settles)."""
        if generation != self.generation or self._stop:
            return
        if fault.rank is not None and fault.host is None:
            fault.host = self._host_of(fault.rank)
        r = self.recovery
        if r is not None and r.generation == generation:
            if not r.described.is_set() and fault.weight > r.fault.weight:
                r.fault = fault
            return
        if self.state not in SERVING:
            return  # starting (the launch's own failure), or a planned restart's stop
        self.recovery = Recovery(fault, generation, time.time(), time.monotonic())
        self._enter("recovering")
        self._wake.set()

    def _host_of(self, rank: int) -> str | None:
        """Rank `rank`'s host: the layout's name, or for a local rank the host name it
        reported."""
        reported = {r.get("rank"): r.get("host") for r in self._reports()}
        name = self.current.host_of(rank) if rank < len(self.current.hosts) else None
        return reported.get(rank) or name if name in (None, LOCAL) else name

    # -- operator and signals --

    def request_stop(self, code: int = 0) -> None:
        """Stop every rank and return `code` from `run` (SIGTERM 0, SIGINT 130)."""
        if not self._stop:
            self.stop_code = code
            self._stop = True
            self._enter("stopping", "the server is shutting down")
            self._wake.set()

    def request_restart(self) -> bool:
        """A planned restart on every host (an operator's POST): False when one is under way."""
        if self._stop or self.state in ("starting", "recovering", "restarting", "failed"):
            return False
        self._planned = True
        self._wake.set()
        return True

    # -- the loop --

    async def run(self) -> int:
        """Until stopped (0), or after too many failures (1), or the first launch's flags
        were refused (2)."""
        code = 0
        try:
            while not self._stop:
                layout = await self._choose_hosts()
                if layout is None:
                    break
                outcome = await self._launch(layout)
                if isinstance(outcome, int):  # the ranks refused to start: no retry
                    code = outcome
                    break
                if outcome != "ok":
                    if self._stop:
                        break
                    if self._failed(outcome):
                        code = 1
                        break
                    self._launch_failures += 1
                    await self._pause(min(BACKOFF_MAX, 2.0 ** (self._launch_failures - 1)))
                    continue
                self._launch_failures = 0
                if not await self._watch():
                    code = 1
                    break
        finally:
            if not self._stop and self.state != "failed":
                self._enter("stopping", "the server is shutting down")
            if self.group is not None:
                await self.group.stop(STOP_GRACE)
            self._tmp.cleanup()
        say("supervisor: stopped")
        return self.stop_code if self._stop else code

    async def _pause(self, seconds: float) -> None:
        """Sleep, unless a stop or restart request comes first."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def _failed(self, what: str) -> bool:
        """Count a failure; True (and state failed) when there were too many in the window."""
        now = time.monotonic()
        self.failures.append(now)
        while self.failures and self.failures[0] < now - self.spec.restart_window:
            self.failures.popleft()
        if len(self.failures) < self.spec.restart_limit:
            return False
        line = (
            f"{len(self.failures)} failures in {self.spec.restart_window:g} s "
            f"(--restart-limit {self.spec.restart_limit}); the last: {what}"
        )
        say(f"error: supervisor: giving up: {line}")
        self._enter("failed", line)
        return True

    async def _launch(self, layout: Layout) -> str:
        """Start a generation on `layout` and wait for rank 0: 'ok', 'usage' (the ranks
        refused the flags before ever serving), or why it failed."""
        self.generation += 1
        gen = self.generation
        replaced = layout is not self.layout
        for old in Path(self._tmp.name).glob("hosts-*.json"):
            old.unlink()
        hostfile = layout.write(Path(self._tmp.name) / f"hosts-{gen}.json") if replaced else None
        host = layout.rank0_address()
        port = free_port(host)
        argv = rank_argv(self.spec, host, port, hostfile, len(layout.hosts))
        self.current, self.base = layout, f"http://{host}:{port}"
        self.group = RankGroup(gen, argv, self.base, lambda line: self._line(gen, line))
        if self.recovery is not None and self.recovery.relaunched is None:
            self.recovery.relaunched = time.monotonic()
        await self.group.start()
        limit = self.spec.load_timeout or None
        deadline = None if limit is None else time.monotonic() + limit + 60
        why = await self.group.wait_ready(self.client, self.headers, deadline)
        if why is None and not self._stop:
            with contextlib.suppress(Exception):  # the new ranks' figures from the start
                await self._read_status(5.0)
            return self._ready(gen)
        await self.group.stop(0)
        if self._stop:
            return "stopped"
        if self.group.code in (1, 2) and self.rank_status is None:
            # Never served, and a rank ended on its own error (bad flags, a model that
            # does not load): the same command would fail again.
            say(f"error: supervisor: the ranks did not start (exit code {self.group.code})")
            self._enter("failed", why)
            return self.group.code
        say(f"supervisor: generation {gen} did not start: {why}")
        return why

    def _ready(self, gen: int) -> str:
        now = time.monotonic()
        r = self.recovery
        if r is not None and r.ready is None:
            r.ready = now
        hosts = len(self.current.names())
        total = len(self.layout.names())
        self._enter("degraded" if hosts < total else "serving")
        took = now - self.group.started
        where = f"{len(self.current.hosts)} rank{'s' * (len(self.current.hosts) > 1)}"
        if total > 1:
            where += f", {hosts} of {total} hosts"
        after = "" if r is None or r.ready != now else f"; {now - r.detected:.1f} s after the fault"
        say(f"supervisor: serving on {where} (generation {gen}, up in {took:.1f} s{after})")
        return "ok"

    async def _watch(self) -> bool:
        """Serve until a fault, a planned restart or a stop; False when giving up."""
        gen, group = self.generation, self.group
        self._wake.clear()
        monitor = asyncio.create_task(self._monitor(gen))
        exited = asyncio.create_task(group.wait())
        woken = asyncio.create_task(self._wake.wait())
        try:
            await asyncio.wait([exited, woken], return_when=asyncio.FIRST_COMPLETED)
            if exited.done() and not self._stop and not self._planned:
                self._detect(gen, faults.from_exit(exited.result()))
        finally:
            for task in (monitor, woken):
                task.cancel()
        if self._stop:
            return True
        if self._planned and self.state != "recovering":
            await self._restart_planned()
            return True
        self._planned = False
        return await self._recover(gen, exited)

    async def _recover(self, gen: int, exited: asyncio.Task) -> bool:
        r = self.recovery
        settle = time.monotonic() + SETTLE
        # A better line may be on its way (a rank's watchdog answers its requests first,
        # then waits 0.5 s, then prints): until the culprit is named or the launcher ends.
        while r.fault.weight < 5 and not exited.done() and time.monotonic() < settle:
            await asyncio.sleep(0.05)
        r.described.set()
        kept, streams = self.held, self.inflight
        say(
            f"supervisor: fault in generation {gen}: {r.fault.text()}; relaunching "
            f"({kept} waiting request{'s' * (kept != 1)} kept, {streams} under way)"
        )
        await self.group.stop(0)
        self.restarts += 1
        return not self._failed(r.fault.text())

    async def _restart_planned(self) -> None:
        """Hold new requests, let the answers under way finish, stop, start on every host."""
        self._planned = False
        self._enter("restarting", "an operator asked for a restart")
        say("supervisor: planned restart: waiting for the answers under way")
        deadline = time.monotonic() + DRAIN_LIMIT
        while self.inflight and time.monotonic() < deadline and not self._stop:
            await asyncio.sleep(0.2)
        await self.group.stop(STOP_GRACE)
        self.restarts += 1
        self._misses.clear()

    async def _monitor(self, gen: int) -> None:
        """Read rank 0's /v1/status every second; a silent rank 0 or stalled ranks are
        faults. While degraded, notice missing hosts that answer again."""
        timeout = self.spec.step_timeout or 60.0
        probes = 0
        while gen == self.generation and self.serving:
            await asyncio.sleep(MONITOR_EVERY)
            try:
                status = await self._read_status(timeout)
            except Exception as e:
                if gen == self.generation and self.serving:
                    what = f"did not answer /v1/status within {timeout:g} s ({type(e).__name__})"
                    self._detect(gen, Fault(what, 0, weight=1))
                return
            if status is None:
                continue
            age = status.get("reported_seconds_ago")
            stage = (status.get("watchdog") or {}).get("stage")
            limit = self.spec.step_timeout
            if limit and stage is None and age is not None and age > limit:
                what = (
                    f"the ranks exchanged no report for {age:.0f} s while idle (--timeout "
                    f"{limit:g}): a rank is stopped or unreachable"
                )
                self._detect(gen, Fault(what, weight=1))
                return
            probes += 1
            if self.state == "degraded" and probes % 30 == 0:
                await self._probe_gone()

    async def _read_status(self, timeout: float) -> dict | None:
        """Rank 0's /v1/status, kept as the current generation's (None: not a 200)."""
        r = await self.client.get(f"{self.base}/v1/status", headers=self.headers, timeout=timeout)
        if r.status_code != 200:
            return None
        self.rank_status, self._reported = r.json(), self.current
        return self.rank_status

    async def _probe_gone(self) -> None:
        back = [h for h in self.gone if await unanswered(h) is None]
        for h in back:
            if h not in self.back:
                say(
                    f"supervisor: host {h} answers again: POST /v1/supervisor/restart (or "
                    f"the next restart) brings it back"
                )
        self.back = back

    # -- hosts --

    async def _choose_hosts(self) -> Layout | None:
        """The layout to launch next: every host when all answer; without the ones that
        failed HOST_ATTEMPTS probes when the model fits the rest; None when stopped."""
        while not self._stop:
            remote = self.layout.remote()
            answers = await asyncio.gather(*(unanswered(h) for h in remote))
            gone = {h: why for h, why in zip(remote, answers, strict=True) if why}
            for h in remote:
                self._misses[h] = self._misses.get(h, 0) + 1 if h in gone else 0
            self._planned = False  # a restart asked for is this one
            if not gone:
                self.gone, self.back = {}, []
                return self.layout
            for h, why in gone.items():
                if self._misses[h] <= HOST_ATTEMPTS:  # then once while down, below
                    say(f"supervisor: host {h} does not answer ({why}); attempt {self._misses[h]}")
            fewest = min(self._misses[h] for h in gone)
            if fewest < HOST_ATTEMPTS:
                self._wake.clear()
                await self._pause(min(BACKOFF_MAX, 2.0 ** (fewest - 1)))
                continue
            remaining = self.layout.without(set(gone))
            fit = self._fit(remaining) if remaining.hosts else None
            if fit is not None and fit.fits:
                self.gone, self.back = gone, []
                say(f"supervisor: {fit.line}")
                return remaining
            line = fit.line if fit is not None else "no host answers"
            reason = f"{line}; waiting for {', '.join(sorted(gone))} to answer"
            if reason != self.reason:
                say(f"error: supervisor: {reason}")
            self.gone = gone
            self._enter("down", reason)
            self._wake.clear()
            await self._pause(PROBE_EVERY)
        return None

    def _reports(self) -> list[dict]:
        """The ranks' last reports (rank 0's /v1/status "ranks")."""
        return (self.rank_status or {}).get("ranks") or []

    def _fit(self, remaining: Layout):
        from .replacement import check

        last = self._reported  # the layout whose ranks sent those reports
        split = "memory" if last is not self.layout else self.spec.split
        meshed = bool(self.spec.mesh) and last is self.layout
        return check(self.spec.model, self.layout, last, remaining, self._reports(), split, meshed)
