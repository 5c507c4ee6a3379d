"""The supervisor tests' side: `python -m llama_tp.launch ... --restart -m llama_tp.serve`
as a subprocess, its ranks found by their environment, faults, and the clients' traffic.

    sup = Supervised(["-n", "2"], model, tmp_path, "--timeout", "5")
    sup.wait_serving()
    sup.ranks()          # {rank: pid} of the current generation (and "launcher")
    sup.status()         # GET /v1/status
    sup.stop()           # SIGTERM: the exit code
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
from conftest import _PORTS, ROOT
from serve_client import KEY, free_port, http

SUPERVISOR_ENV = "LLAMA_TP_SUPERVISOR"
RANK_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_RANK")  # mlx.launch's ranks, mpirun's
NO_EOS = {"0": -100, "2": -100}  # the built-in model's end tokens: a stream that runs on


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(e.split("=", 1) for e in raw.decode(errors="replace").split("\0") if "=" in e)


def started_by(supervisor: int) -> dict[int, dict[str, str]]:
    """Every live process started by the supervisor `supervisor` (pid -> environment)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        env = environ(int(entry.name))
        if env.get(SUPERVISOR_ENV) == str(supervisor):
            found[int(entry.name)] = env
    return found


def rss(pid: int) -> int:
    """Resident memory in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Supervised:
    """A supervisor subprocess (its own session) serving `model`; `launcher`: its flags."""

    def __init__(
        self,
        launcher: list[str],
        model: Path,
        tmp: Path,
        *flags: str,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ):
        self.port = free_port()
        cmd = [sys.executable, "-m", "llama_tp.launch", "--no-openblas", *launcher]
        cmd += ["--starting-port", str(next(_PORTS)), "--restart", "--restart-limit", "10"]
        cmd += ["-m", "llama_tp.serve", "--model", str(model), "--port", str(self.port)]
        cmd += ["--api-key", KEY, *flags]
        self.err_path = tmp / f"supervisor-{self.port}.err"
        self.proc = subprocess.Popen(
            [*(prefix or []), *cmd],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(self.err_path, "w"),
            start_new_session=True,
            # The ranks' session at the launcher's default (nice 10 for pinned ranks): at
            # nice 0 two pinned ranks kept this machine's other sessions (this test's
            # clients) from running for 40-70 s at a time under Linux's autogroups.
            env={**os.environ, **(env or {})},
        )
        self.base = f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.err_path.read_text()

    def client(self, **kw) -> openai.OpenAI:
        kw = {"timeout": 120, **kw}
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=KEY, max_retries=0, **kw)

    def status(self) -> dict:
        code, body = http(f"{self.base}/v1/status", headers={"Authorization": f"Bearer {KEY}"})
        assert code == 200, (code, body)
        return json.loads(body)

    def wait_state(self, states: tuple[str, ...], timeout: float = 180, generation: int = 0):
        """Until the supervisor is in one of `states` (with a generation above
        `generation`): its status."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()
            try:
                last = self.status()
                s = last["supervisor"]
                if s["state"] in states and s["generation"] > generation:
                    return last
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"not {states} after {timeout} s: {last}\n{self.stderr()}")

    def wait_serving(self, timeout: float = 180, generation: int = 0) -> dict:
        return self.wait_state(("serving",), timeout, generation)

    def ranks(self) -> dict[int, int]:
        """{rank: pid} of the ranks it runs now."""
        out = {}
        for pid, env in started_by(self.proc.pid).items():
            rank = next((env[k] for k in RANK_ENV if k in env), None)
            if rank is not None:
                out[int(rank)] = pid
        return out

    def stop(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Kill it and everything it started (a test that failed half way)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in started_by(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


@dataclass
class Traffic:
    """Streams that run on and requests queued behind them, answered on threads."""

    client: openai.OpenAI
    results: dict = field(default_factory=dict)
    threads: list = field(default_factory=list)
    tokens: dict = field(default_factory=dict)  # stream name -> tokens received
    done: dict = field(default_factory=dict)  # name -> when it ended (monotonic)

    def _run(self, name: str, fn) -> None:
        def body():
            try:
                self.results[name] = ("ok", fn())
            except openai.APIError as e:
                self.results[name] = ("error", e)
            self.done[name] = time.monotonic()

        t = threading.Thread(target=body, daemon=True)
        t.start()
        self.threads.append(t)

    def stream(self, name: str, prompt: str, max_tokens: int = 2000) -> None:
        """A chat stream that runs on (no end token) until the fault."""

        def fn():
            self.tokens[name] = 0
            text = []
            for c in self.client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0,
                logit_bias=NO_EOS,
                stream=True,
            ):
                for ch in c.choices:
                    if ch.delta.content:
                        text.append(ch.delta.content)
                        self.tokens[name] += 1
            return "".join(text)

        self._run(name, fn)

    def ask(self, name: str, prompt: str, stream: bool = False) -> None:
        self._run(name, lambda: answer(self.client, prompt, stream))

    def wait_streaming(self, names: list[str], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.tokens.get(n, 0) >= 2 for n in names):
            assert time.monotonic() < deadline, (self.tokens, self.results)
            time.sleep(0.05)

    def join(self, timeout: float = 180) -> dict:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), self.results
        return self.results


def answer(client: openai.OpenAI, prompt: str, stream: bool = False, max_tokens: int = 8) -> str:
    """A short greedy answer (streamed or not)."""
    kw = dict(model="m", messages=[{"role": "user", "content": prompt}], temperature=0)
    if not stream:
        return (
            client.chat.completions.create(max_tokens=max_tokens, **kw).choices[0].message.content
        )
    chunks = client.chat.completions.create(max_tokens=max_tokens, stream=True, **kw)
    return "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
