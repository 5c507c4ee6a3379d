"""What went wrong, from the lines a generation of ranks writes to stderr.

Each line that tells of a fault becomes a `Fault` with a weight: how much it says about
the cause. The supervisor keeps the heaviest one seen while it settles, so that a rank
that was killed is named rather than the peer that noticed:

    6  a rank killed by a signal (mlx.launch: "Node with rank 1 exited with code -9";
       mpirun: "process rank 1 with PID ... on node b exited on signal 9")
    5  a rank's own error line ("error: rank 1: ..." that is not a lost peer or a timeout)
    4  a rank that exited with a code of its own (not 3, a lost peer)
    3  the watchdog: "error: rank 0: no progress for 60 s in generation step 12 ..."
    2  a lost peer: "error: rank 0: lost the connection to a peer rank ..."
    1  what the supervisor saw itself (rank 0 stopped answering, the ranks stalled)

`Recovery` is a fault with the times of what followed (relaunch, ready, first answer).
"""

from __future__ import annotations

import asyncio
import re
import signal
from dataclasses import dataclass, field

from ..cluster.watchdog import EXIT_PEER, PEER_LOST

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RANK_LINE = re.compile(r"error: rank (\d+): (.+)")
_MLX_EXIT = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")
_MPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")


@dataclass
class Fault:
    """One observation of a fault: `what` happened to `rank` (None: unknown)."""

    what: str
    rank: int | None = None
    host: str | None = None
    weight: int = 1

    def text(self) -> str:
        """'rank 1 (host b) was killed by SIGKILL'."""
        if self.rank is None:
            return self.what
        where = f" (host {self.host})" if self.host else ""
        return f"rank {self.rank}{where} {self.what}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def from_line(line: str) -> Fault | None:
    """The fault a stderr line of the ranks or their launcher tells of, or None."""
    line = _ANSI.sub("", line).strip()
    if m := _MLX_EXIT.search(line):
        rank, code = int(m.group(1)), int(m.group(2))
        if code < 0:
            return Fault(f"was killed by {signal_name(-code)}", rank, weight=6)
        if code not in (0, EXIT_PEER):
            return Fault(f"exited with code {code}", rank, weight=4)
        return None
    if m := _MPI_SIGNAL.search(line):
        name = signal_name(int(m.group(3)))
        return Fault(f"was killed by {name}", int(m.group(1)), m.group(2), weight=6)
    if m := _RANK_LINE.match(line):
        rank, message = int(m.group(1)), m.group(2)
        if PEER_LOST in message:
            return Fault(f"reported: {message}", rank, weight=2)
        if "no progress for" in message:
            return Fault(f"reported: {message}", rank, weight=3)
        return Fault(f"failed: {message}", rank, weight=5)
    return None


def from_exit(code: int) -> Fault:
    """The launcher ended (before any line told why)."""
    if code < 0:
        return Fault(f"the ranks' launcher was killed by {signal_name(-code)}")
    return Fault(f"the ranks' launcher exited with code {code}")


@dataclass
class Recovery:
    """A fault and how long the service took to come back (seconds after detection)."""

    fault: Fault
    generation: int  # the generation it ended
    at: float  # wall clock of the detection
    detected: float  # monotonic
    relaunched: float | None = None  # the new generation's launch started
    ready: float | None = None  # rank 0 answered /health
    first_answer: float | None = None  # the first answer completed after recovery
    described: asyncio.Event = field(default_factory=asyncio.Event)

    def json(self) -> dict:
        def since(t: float | None) -> float | None:
            return None if t is None else round(t - self.detected, 3)

        return {
            "rank": self.fault.rank,
            "host": self.fault.host,
            "what": self.fault.text(),
            "at": round(self.at, 3),
            "seconds_to_relaunch": since(self.relaunched),
            "seconds_to_ready": since(self.ready),
            "seconds_to_first_answer": since(self.first_answer),
        }
