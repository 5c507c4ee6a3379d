"""How long other sessions wait while 2 pinned local ranks work (Linux).

    python bench/session_waits.py [--nice 10] [--max-tokens 1500] [--rounds 2]

Starts a 2-rank server (`python -m llama_tp.launch -n 2 -m llama_tp.serve`, in a
session of its own as a desktop's terminal would be, the built-in model) with
`LLAMA_TP_SESSION_NICE=--nice`, then per round streams one `--max-tokens` answer to
this process, while a second process in this session wakes every 50 ms. Prints, per
round, the longest gap between two chunks of the stream, the watcher's longest wait
and the answer's tokens/s. docs/cpu-kernels.md ("Other sessions next to pinned ranks")
has the figures; `--nice 0` is the launch as it was before it yielded.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from llama_tp.benchmarks.servers import start, stop, wait_ready

WATCHER = """
import sys, time
last = time.monotonic(); worst = 0.0
while True:
    time.sleep(0.05)
    now = time.monotonic(); worst = max(worst, now - last); last = now
    print(f"{worst:.3f}", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(base: str, max_tokens: int) -> tuple[float, float]:
    """(longest gap between chunks in s, completion tokens/s) of one streamed answer."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data:"):
                times.append(time.monotonic())
    gaps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    return max(gaps), (len(times) - 2) / (times[-1] - times[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nice", type=int, default=10, help="LLAMA_TP_SESSION_NICE (0: none)")
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    port = free_port()
    env = {**os.environ, "LLAMA_TP_SESSION_NICE": str(args.nice)}
    env.pop("LLAMA_TP_CORES", None)
    cmd = [sys.executable, "-m", "llama_tp.launch", "-n", "2", "--starting-port"]
    cmd += [str(free_port()), "-m", "llama_tp.serve", "--port", str(port)]
    server = start(cmd, env)  # a session of its own, as a terminal's would be
    base = f"http://127.0.0.1:{port}"
    try:
        if not wait_ready(base + "/health"):
            raise SystemExit("error: the 2-rank server did not answer /health within 300 s")
        for k in range(args.rounds):
            watcher = subprocess.Popen(
                [sys.executable, "-c", WATCHER], stdout=subprocess.PIPE, text=True
            )
            gap, rate = stream(base, args.max_tokens)
            watcher.terminate()
            lines = watcher.communicate()[0].split()
            waited = float(lines[-1]) if lines else float("nan")
            print(
                f"round {k + 1}, session nice {args.nice}: stream's longest gap {gap:.2f} s, "
                f"the other session's longest wait {waited:.2f} s, {rate:.1f} tokens/s",
                flush=True,
            )
    finally:
        stop(server)


if __name__ == "__main__":
    main()
