"""How fast the supervised server heals: a rank's fault to the first good answer after it.

    python bench/recovery.py [--model M | --synthetic 0.5b-fp16] [--faults 3]
                             [--signal KILL|STOP] [--timeout 60] [--nice N]

Starts `python -m llama_tp.launch -n 2 --restart -m llama_tp.serve` (the built-in model
by default; `--synthetic SPEC`: a random-weight model of that size, written once into
the cache), and per fault: streams one answer, sends the signal to rank 1 mid-stream
and, 0.2 s later, a new one-token request (held by the front door until the ranks are
back; one token, so that the figures are the recovery's, not the model's speed).
Prints per fault, from the signal: when the supervisor saw the fault (detect), when the
new ranks answered /health (relaunch: from the detection), when the first answer after
it completed (first answer, from the detection), and when the new request was answered
(from the signal). `--nice N`: the ranks' session nice (LLAMA_TP_SESSION_NICE; on a
busy machine the default 10 of pinned ranks starves them). docs/reliability.md has the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEY = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(base: str, path: str) -> dict:
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def chat(base: str, prompt: str, max_tokens: int, stream: bool = False, on_token=None) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "logit_bias": {"0": -100, "2": -100},  # the built-in model's end tokens: run on
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if on_token is not None and b'"content": "' in line:
                on_token()


def wait_state(base: str, state: str, generation: int, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            s = get(base, "/v1/status")["supervisor"]
            if s["state"] == state and s["generation"] > generation:
                return s
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"not {state} after {timeout} s")


def rank_pid(supervisor: int, rank: int) -> int:
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LLAMA_TP_SUPERVISOR={supervisor}".encode() in env:
            for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK"):  # mlx.launch's ranks, mpirun's
                if f"{name}={rank}".encode() in env:
                    return int(entry.name)
    raise LookupError(f"no rank {rank} of supervisor {supervisor}")


def one_fault(base: str, supervisor: int, sig: int) -> dict:
    before = get(base, "/v1/status")["supervisor"]
    streaming = threading.Event()

    def stream() -> None:
        try:
            chat(base, "Count from one to a thousand.", 4000, True, streaming.set)
        except OSError:
            pass  # the fault ends it with an error event, or the connection

    threading.Thread(target=stream, daemon=True).start()
    streaming.wait(300)
    time.sleep(0.5)
    t0 = time.time()
    os.kill(rank_pid(supervisor, 1), sig)
    time.sleep(0.2)
    chat(base, "Name a colour.", 1)  # held until the ranks are back; one token: not speed
    answered = time.time() - t0
    s = wait_state(base, "serving", before["generation"])["last_fault"]
    return {
        "detect": s["at"] - t0,
        "relaunch": s["seconds_to_ready"],
        "first_answer": s["seconds_to_first_answer"],
        "new_request": answered,
        "what": s["what"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="default: the built-in model")
    src.add_argument("--synthetic", metavar="SPEC", help="e.g. 0.5b-fp16")
    p.add_argument("--faults", type=int, default=3)
    p.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    p.add_argument("--timeout", type=float, default=60.0, help="the server's --timeout")
    p.add_argument("--nice", type=int, default=None, help="LLAMA_TP_SESSION_NICE for the ranks")
    args = p.parse_args()
    model = args.model
    if args.synthetic:
        from llama_tp.benchmarks.synthetic import synthetic_dir

        model = str(synthetic_dir(args.synthetic))
    port = free_port()
    cmd = [sys.executable, "-m", "llama_tp.launch", "-n", "2", "--restart"]
    cmd += ["--restart-limit", str(args.faults + 2), "-m", "llama_tp.serve", "--port", str(port)]
    cmd += ["--api-key", KEY, "--timeout", f"{args.timeout:g}"]
    cmd += ["--model", model] if model else []
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if args.nice is not None:
        env["LLAMA_TP_SESSION_NICE"] = str(args.nice)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, start_new_session=True
    )
    rows = []
    try:
        t = time.monotonic()
        wait_state(base, "serving", 0)
        started = time.monotonic() - t
        chat(base, "Hello.", 8)
        for _ in range(args.faults):
            rows.append(one_fault(base, proc.pid, getattr(signal, f"SIG{args.signal}")))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else []
    name = Path(model).name if model else "built-in (SmolLM2-135M-Instruct Q4_1)"
    print(
        f"\n{name}, 2 ranks, SIG{args.signal} of rank 1, --timeout {args.timeout:g}"
        f"{'' if args.nice is None else f', session nice {args.nice}'}; first "
        f"start {started:.1f} s; load average {' '.join(load)}; exit code {code}"
    )
    print("| fault | detect | relaunch | first answer | new request |")
    print("| --- | --- | --- | --- | --- |")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {r['detect']:.2f} s | {r['relaunch']:.1f} s | {r['first_answer']:.1f} s "
              f"| {r['new_request']:.1f} s |")  # fmt: skip
    if rows:
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "what"}
        print(f"| median | {med['detect']:.2f} s | {med['relaunch']:.1f} s | "
              f"{med['first_answer']:.1f} s | {med['new_request']:.1f} s |")  # fmt: skip
        print(f"fault named: {rows[-1]['what']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
