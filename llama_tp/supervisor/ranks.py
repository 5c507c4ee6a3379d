"""One generation of ranks: `python -m llama_tp.launch ... -m llama_tp.serve ...` run as a
subprocess in a session of its own, rank 0 listening on a private address. On Linux the
launcher is told to stop (SIGTERM) when the supervisor dies, so no rank outlives it.

Its stderr is forwarded to the supervisor's, line by line, and each line handed to
`on_line` (the supervisor reads the fault lines). `stop` ends it: SIGTERM to the
launcher (it terminates its ranks, remote ones through ssh) and, after a grace, SIGKILL
to every process of the session: the launcher's group and, on Linux, any process that
left it (mpirun's ranks), stopped (SIGSTOP) ones included. Remote ranks end when their
ssh session closes (mlx.launch gives them a terminal: the hang-up ends them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

POLL = 0.25  # seconds between readiness checks
SUPERVISOR_ENV = "LLAMA_TP_SUPERVISOR"  # the supervisor's pid, in its ranks' environment
# Runs the launcher (sys.argv[1:]) so that on Linux it gets SIGTERM, and stops its ranks,
# if the supervisor dies (PR_SET_PDEATHSIG = 1 survives the exec).
ORPHAN_GUARD = """
import ctypes, os, signal, sys
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != int(os.environ["LLAMA_TP_SUPERVISOR"]):
        sys.exit(1)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


class RankGroup:
    """The launcher subprocess of generation `generation` (rank 0 at `base`, a URL)."""

    def __init__(self, generation: int, argv: list[str], base: str, on_line: Callable[[str], None]):
        self.generation, self.argv, self.base = generation, argv, base
        self.on_line = on_line
        self.proc: asyncio.subprocess.Process | None = None
        self.started = 0.0
        self.last_error: str | None = None  # the last "error: ..." line (why it failed)
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
        self.started = time.monotonic()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            ORPHAN_GUARD,
            *self.argv[1:],  # the launcher's argv after its python
            stdin=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self._reader = asyncio.create_task(self._forward(self.proc.stderr))

    @property
    def code(self) -> int | None:
        """The launcher's exit code (None while it runs)."""
        return None if self.proc is None else self.proc.returncode

    async def wait(self) -> int:
        """Until the launcher has exited and its stderr is read; its exit code."""
        code = await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._reader), 2.0)
        return code

    async def _forward(self, stream: asyncio.StreamReader) -> None:
        out = sys.stderr.buffer
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line longer than the buffer (a progress bar): pass it on
                line = await stream.read(1 << 16)
            if not line:
                return
            with contextlib.suppress(OSError, ValueError):
                out.write(line)
                out.flush()
            text = line.decode(errors="replace").rstrip()
            if text.startswith("error: "):
                self.last_error = text
            self.on_line(text)

    async def wait_ready(self, client, headers: dict, deadline: float | None) -> str | None:
        """Until rank 0 answers /health with 200: None, or why not (the launcher ended, the
        deadline (monotonic) passed)."""
        while True:
            if self.code is not None:
                await self.wait()
                why = f"the ranks' launcher exited with code {self.code}"
                return f"{why}: {self.last_error}" if self.last_error else why
            try:
                r = await client.get(f"{self.base}/health", headers=headers, timeout=2.0)
                if r.status_code == 200:
                    return None
            except Exception:  # not listening yet, or not answering
                pass
            if deadline is not None and time.monotonic() > deadline:
                took = time.monotonic() - self.started
                return f"rank 0 did not become ready in {took:.0f} s"
            await asyncio.sleep(POLL)

    async def stop(self, grace: float) -> None:
        """SIGTERM to the launcher (it stops its ranks), then after `grace` seconds SIGKILL
        to everything left in its session; returns once the launcher is gone."""
        if self.proc is None:
            return
        if self.code is None and grace > 0:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), grace)
        kill_session(self.proc.pid)
        await self.wait()


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (its leader's group, and on Linux any process
    of the session in another group). Stopped processes die too."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sid, signal.SIGKILL)
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def session_members(sid: int) -> list[int]:
    """The processes of session `sid` (Linux: /proc; elsewhere none are found)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        if len(fields) > 3 and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def free_port(host: str) -> int:
    """A port free on `host` now (any address of this machine when `host` is not one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, 0))
        except OSError:  # a remote rank 0: a port free here is likely free there
            s.bind(("", 0))
        return s.getsockname()[1]
