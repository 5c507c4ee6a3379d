"""A server under test: start one (`python -m llama_tp.serve`, on N ranks through
`python -m llama_tp.launch`, or mlx_lm.server), wait until it answers, drive it with
`serve_clients`, stop it with every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

from .serve_clients import MODEL, run


def wait_ready(url: str, timeout: float = 300) -> bool:
    """Whether `url` answered 200 within `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """The server in a session of its own (so that stop() ends its ranks too)."""
    return subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop(p: subprocess.Popen) -> None:
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def serve_row(
    cmd: list[str], env: dict, port: int, health: str, conc: list[int], model: str = MODEL
) -> dict:
    """Start the server, run C streaming clients for each C in `conc` (2 requests of up
    to 48 tokens each), stop it: {"results": [one serve_clients.run per C]}."""
    p = start(cmd, env)
    try:
        if not wait_ready(f"http://127.0.0.1:{port}{health}"):
            return {"error": "the server did not start"}
        base = f"http://127.0.0.1:{port}/v1"
        return {"results": [run(base, "none", c, 2, 48, model) for c in conc]}
    finally:
        stop(p)
