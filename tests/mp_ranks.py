"""Start ranks as plain processes, the way mlx.launch does, but keep each rank's own
exit code and output (mlx.launch stops the other ranks as soon as one fails,
which would hide what they do on their own).

    ranks = Ranks(2, ["-m", "llama_tp.generate", ...], tmp_path)
    ranks.wait_for_output(200)           # rank 0 has printed 200 bytes
    ranks.signal(1, signal.SIGKILL)
    results = ranks.wait(timeout=20)     # [Result(rank, code, out, err, seconds), ...]

Each rank gets MLX_RANK and MLX_HOSTFILE (a JSON list of "ip:port" lists, one per
rank, as mlx.launch writes for the ring backend); `hosts` puts ranks on other
addresses and `prefix` runs them through e.g. `ip netns exec NS`. Outside exclusive
tests (whose ranks start as users start them: a stopped stand-in would not stop its
rank) and without a prefix, each rank is forked from the warm interpreter by a
stand-in, as `launch`'s ranks are (conftest.python_cmd); SIGKILL of the stand-in ends
its rank too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conftest import _PORTS, ROOT, python_cmd


@dataclass
class Result:
    rank: int
    code: int | None  # None: still running when the wait ended (then killed)
    out: str
    err: str
    seconds: float  # from the signal (or the start) to the exit

    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


class Ranks:
    def __init__(
        self,
        n: int,
        args: list[str] | Callable[[int], list[str]],
        tmp_path: Path,
        *,
        env: dict[int, dict[str, str]] | None = None,
        stdin: bytes | None = None,
        hosts: list[str] | None = None,
        prefix: Callable[[int], list[str]] | None = None,
    ):
        port = next(_PORTS)
        hosts = hosts or ["127.0.0.1"] * n
        hostfile = tmp_path / f"hosts-{port}.json"
        hostfile.write_text(json.dumps([[f"{h}:{port + i}"] for i, h in enumerate(hosts)]))
        self.procs: list[subprocess.Popen] = []
        self.out = [bytearray() for _ in range(n)]
        self.err = [bytearray() for _ in range(n)]
        self.started = self.mark = time.monotonic()
        for rank in range(n):
            extra = {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            extra.update((env or {}).get(rank, {}))
            argv = args(rank) if callable(args) else args
            # forked from the warm interpreter outside exclusive tests (not through a prefix)
            cmd = [sys.executable, *argv] if prefix else python_cmd(argv)
            if prefix:  # e.g. ip netns exec NS env MLX_RANK=r ... python ...
                cmd = [*prefix(rank), "env", *[f"{k}={v}" for k, v in extra.items()], *cmd]
            p = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env={**os.environ, **extra},
                stdin=subprocess.PIPE if rank == 0 and stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            if rank == 0 and stdin is not None:
                p.stdin.write(stdin)
                p.stdin.close()
            self.procs.append(p)
            for stream, buf in ((p.stdout, self.out[rank]), (p.stderr, self.err[rank])):
                threading.Thread(target=_collect, args=(stream, buf), daemon=True).start()

    def wait_for_output(self, nbytes: int, rank: int = 0, timeout: float = 90) -> None:
        """Until `rank` has written `nbytes` to stdout (generation is under way)."""
        deadline = time.monotonic() + timeout
        while len(self.out[rank]) < nbytes:
            if time.monotonic() > deadline or self.procs[rank].poll() is not None:
                self.kill()
                raise AssertionError(
                    f"rank {rank} wrote {len(self.out[rank])} bytes in {timeout} s; "
                    f"stderr: {bytes(self.err[rank]).decode(errors='replace')}"
                )
            time.sleep(0.05)

    def signal(self, rank: int, sig: int) -> None:
        os.kill(self.procs[rank].pid, sig)
        self.mark = time.monotonic()

    def wait(self, timeout: float, ranks: list[int] | None = None) -> list[Result]:
        """Wait up to `timeout` s (from the last signal, or the start) for `ranks` to exit."""
        ranks = list(range(len(self.procs))) if ranks is None else ranks
        deadline = self.mark + timeout
        exited: dict[int, float] = {}
        while len(exited) < len(ranks) and time.monotonic() < deadline:
            for r in ranks:
                if r not in exited and self.procs[r].poll() is not None:
                    exited[r] = time.monotonic() - self.mark
            time.sleep(0.02)
        codes = {r: self.procs[r].poll() for r in ranks}
        self.kill()
        for p in self.procs:
            p.wait()
        time.sleep(0.1)  # the collector threads reach the end of the pipes
        return [
            Result(
                r,
                codes[r],
                bytes(self.out[r]).decode(errors="replace"),
                bytes(self.err[r]).decode(errors="replace"),
                exited.get(r, float("inf")),
            )
            for r in ranks
        ]

    def kill(self) -> None:
        """SIGKILL every rank still running (stopped ones too), with anything it started."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _collect(stream, buf: bytearray) -> None:
    while data := stream.read1(1 << 16):
        buf += data
