"""The requests' side of the supervisor (`Admission`, a part of `control.Supervisor`):
holding requests while no generation serves and releasing them to the next one, the
bound on new ones (503 with `Retry-After` beyond it), what a request that rank 0
failed reports back (`suspect`, `answered`), what a stream cut off is told, and the
`supervisor` section of /v1/status.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from .faults import Fault

SERVING = ("serving", "degraded")
TERMINAL = ("down", "failed", "stopping")
PROBE_EVERY = 5.0  # seconds between probes of the missing hosts while down


class Unavailable(Exception):
    """No generation will serve this request: a 503 with `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class ClientGone(Exception):
    """The client disconnected while its request waited."""


class Admission:
    """The requests' side of `control.Supervisor` (which holds the state it reads)."""

    @property
    def serving(self) -> bool:
        return self.state in SERVING

    def retry_after(self) -> int:
        """Seconds a client may wait before retrying: the last recovery's time, or 10."""
        r = self.recovery
        took = (r.ready - r.detected) if r is not None and r.ready is not None else 10.0
        if self.state == "down":
            return int(PROBE_EVERY)
        return max(1, math.ceil(took))

    # -- the requests' side --

    async def admit(self, after: int, replay: bool, disconnected) -> int:
        """Wait until a generation newer than `after` serves; its number. `replay`: the
        request was under way at a fault (always kept); a new one is refused beyond
        `max_queue` waiting. Raises Unavailable, or ClientGone (`disconnected()` said so)."""
        if self.serving and self.generation > after:
            return self.generation
        if self.state in TERMINAL:
            raise Unavailable(self._refusal(), self.retry_after())
        if not replay and self.held >= self.spec.max_queue:
            raise Unavailable(
                f"the server is recovering ({self.state}) and {self.held} requests are "
                f"waiting (--max-queue {self.spec.max_queue}); retry later",
                self.retry_after(),
            )
        self.held += 1
        try:
            while not (self.serving and self.generation > after):
                if self.state in TERMINAL:
                    raise Unavailable(self._refusal(), self.retry_after())
                try:
                    await asyncio.wait_for(self._changed.wait(), 0.5)
                except asyncio.TimeoutError:
                    if await disconnected():
                        raise ClientGone() from None
            return self.generation
        finally:
            self.held -= 1

    def _refusal(self) -> str:
        if self.state == "stopping":
            return "the server is shutting down"
        if self.state == "failed":
            return f"the server gave up: {self.reason}"
        return f"the server is {self.state}: {self.reason}"

    async def end_message(self, generation: int) -> str:
        """Why a stream of `generation` that had shown output was cut off."""
        if self._stop:
            return "the server is shutting down"
        if self.state == "restarting" and generation == self.generation:
            return f"the server is restarting: {self.reason}"
        what = await self.fault_text(generation)
        return f"a rank of the server failed: {what}; the server is recovering"

    def suspect(self, generation: int, what: str) -> None:
        """A request saw rank 0 of `generation` fail (503, or no answer)."""
        if generation == self.generation and self.serving:
            self._detect(generation, Fault(what, 0, weight=1))

    def answered(self, generation: int) -> None:
        """A request completed at rank 0 of `generation`."""
        r = self.recovery
        if r is not None and r.first_answer is None and r.ready is not None:
            if generation == self.generation:
                r.first_answer = time.monotonic()

    async def fault_text(self, generation: int, wait: float = 3.0) -> str:
        """What ended `generation` (waiting up to `wait` s for its description)."""
        deadline = time.monotonic() + wait
        while True:
            if self._stop:
                return "the server is shutting down"
            r, left = self.recovery, deadline - time.monotonic()
            if r is not None and r.generation == generation:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(r.described.wait(), max(left, 0.01))
                return r.fault.text()
            if left <= 0:
                return "the connection to rank 0 was lost"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def status(self) -> dict:
        hosts = {
            "up": len(self.current.names()) if self.serving else 0,
            "total": len(self.layout.names()),
            "missing": {h: why for h, why in self.gone.items()},
            "back": list(self.back),
        }
        return {
            "state": self.state,
            "reason": self.reason,
            "generation": self.generation,
            "ranks": len(self.current.hosts),
            "hosts": hosts,
            "restarts": self.restarts,
            "failures_in_window": len(self.failures),
            "restart_limit": self.spec.restart_limit,
            "restart_window": self.spec.restart_window,
            "last_fault": None if self.recovery is None else self.recovery.json(),
            "downtime_seconds": self.downtime_seconds(),
            "waiting": self.held,
            "max_queue": self.spec.max_queue,
            "rank0": self.base,
        }
