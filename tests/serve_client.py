"""The server tests' client side: a server subprocess and the calls they make.

`Server` starts `python -m llama_tp.serve` on 1 or more ranks (its own process group);
`chat` / `complete` drive it with the real `openai` client; `http` sends raw requests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import openai
from conftest import _PORTS, BIN, ROOT, TIMEOUT_SCALE, python_cmd

KEY = "test-key"
REPEAT = "abc abc abc abc abc abc abc abc"  # prompt lookup finds drafts the model accepts
DRAFTS = {"num_draft_tokens": 4}


def http(url: str, body=None, headers=None, timeout: float = 30) -> tuple[int, str]:
    """(status, body text) of a GET, or of a POST of `body` (bytes, or JSON)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers or {})
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess (its own process group), stopped at the end of the module.

    Ranks start under `python -m llama_tp.launch`, which blocks; `launcher="mlx"` uses
    mlx.launch, whose threads spin on their ranks' writable stdin (about 1.3 cores busy
    for as long as the server lives: measured with top on an idle 2-rank server)."""

    def __init__(self, ranks: int, model: Path, tmp: Path, *flags: str, launcher: str = "llama_tp"):
        self.port, self.model = free_port(), model
        args = ["-m", "llama_tp.serve", "--model", str(model), "--port", str(self.port)]
        args += ["--api-key", KEY, *flags]
        run = python_cmd(args)  # forked from the warm interpreter where it can
        if ranks == 1:
            cmd = run
        elif launcher == "llama_tp":  # blocks instead of spinning (--no-openblas: as one process)
            cmd = [sys.executable, "-m", "llama_tp.launch", "--no-openblas", "-n", str(ranks)]
            cmd += ["--starting-port", str(next(_PORTS)), "--", *run]
        else:
            cmd = [str(BIN / "mlx.launch"), "-n", str(ranks), "--starting-port", str(next(_PORTS))]
            cmd += ["--", *run]
        self.err_path = tmp / f"serve-{ranks}-{self.port}.err"
        # mlx.launch spins once its stdin ends: give it a pipe that stays open.
        self.read_end, self.write_end = os.pipe()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=self.read_end,
            stdout=subprocess.DEVNULL,
            stderr=open(self.err_path, "w"),
            start_new_session=True,
        )
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout * TIMEOUT_SCALE
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr()
            try:
                if http(f"{self.base}/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready after {timeout} s: {self.stderr()}")

    def client(self, **kw) -> openai.OpenAI:
        kw = {"timeout": 60, **kw}
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=KEY, max_retries=0, **kw)

    def stderr(self) -> str:
        return self.err_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for fd in (self.read_end, self.write_end):
            try:
                os.close(fd)
            except OSError:
                pass


def chat(client, prompt: str, stream: bool = False, **kw):
    """(text, finish_reason, usage) of a one-message chat."""
    messages = kw.pop("messages", None) or [{"role": "user", "content": prompt}]
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    if not stream:
        r = client.chat.completions.create(model="m", messages=messages, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    text, finish, usage = [], None, None
    for c in client.chat.completions.create(
        model="m", messages=messages, stream=True, stream_options={"include_usage": True}, **kw
    ):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            text.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    return "".join(text), finish, usage


def complete(client, prompt: str, stream: bool = False, **kw) -> str:
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    if not stream:
        return client.completions.create(model="m", prompt=prompt, **kw).choices[0].text
    chunks = client.completions.create(model="m", prompt=prompt, stream=True, **kw)
    return "".join(ch.text for c in chunks for ch in c.choices)


@contextmanager
def serving(app):
    """`app` (`create_app`'s, or `build_app`'s) on a free port of this machine, in this
    process: its base URL. `create_app`'s step loop is stopped at the end."""
    from llama_tp.server.runner import HTTPThread, bind

    sock = bind("127.0.0.1", 0)
    http_thread = HTTPThread(app, sock)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        http_thread.stop()
        scheduler = getattr(app.state, "scheduler", None)
        if scheduler is not None:  # create_app's step loop
            scheduler.request_stop()
            app.state.steps.join(10)


def openai_client(base: str, key: str = KEY, **kw) -> openai.OpenAI:
    """The real `openai` client of a server at `base`."""
    kw = {"timeout": 60, **kw}
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, **kw)
