"""Shared fixtures: tiny random-weight checkpoints and a bounded `mlx.launch` runner."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Each launch gets its own block of ports so that tests cannot collide, and the
# base moves with the process id so that two suites on one machine do not either.
_PORTS = itertools.count(20000 + (os.getpid() % 400) * 50, 10)


def launch(
    n: int, args: list[str], timeout: float = 300, input: str | None = None
) -> subprocess.CompletedProcess:
    """Run `python args...` on `n` local ranks with mlx.launch (bounded by `timeout`).

    `--` keeps mlx.launch from taking the command's own flags (e.g. --verbose).
    Note that mlx.launch exits 0 even when ranks fail; callers check the output.
    """
    cmd = [str(BIN / "mlx.launch"), "-n", str(n), "--starting-port", str(next(_PORTS))]
    cmd += ["--", sys.executable, *args]
    # mlx.launch polls its stdin and spins on a CPU core once it reaches end of file:
    # give it a pipe that stays open (after `input`, if any) until the ranks are done.
    read_end, write_end = os.pipe()
    if input:
        os.write(write_end, input.encode())
    try:
        p = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=read_end,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        os.close(read_end)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher and every rank it started
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    finally:
        os.close(write_end)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def run_python(args: list[str], timeout: float = 300, input: str | None = None):
    """Run `python args...` as a single process (bounded by `timeout`)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input or "",
    )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny fp32 Llama (8 query heads, 2 KV heads) with a sentencepiece tokenizer."""
    from fixtures import write_hf_model

    return write_hf_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The built-in SmolLM2-135M-Instruct GGUF (installed by `make test`)."""
    from llama_tp.loader import default_model

    return default_model()
