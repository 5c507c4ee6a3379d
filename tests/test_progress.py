"""Progress bars (llama_tp.cluster.progress): on rank 0's terminal only, never in --json
output or a pipe, off with --quiet."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from conftest import _PORTS, BIN, ROOT, launch

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX terminal")

TEXT = "tests/data/paris.txt"


def run_on_pty(cmd: list[str], timeout: float = 180, stdout_too: bool = False):
    """Run `cmd` with stderr on a fresh pseudo-terminal (24x100) and stdout on a pipe
    (`stdout_too`: on the terminal as well); returns (exit code, stdout, what reached
    the terminal)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_TP_PROGRESS", "COLUMNS")}
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=slave if stdout_too else subprocess.PIPE,
        stderr=slave,
        env=env,
        start_new_session=True,  # and the terminal its controlling one, as in a real session
        preexec_fn=lambda: fcntl.ioctl(2, termios.TIOCSCTTY, 0),
    )
    os.close(slave)
    tty = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: nothing holds the terminal open any more
                    data = b""
                tty += data
                if not data and p.poll() is not None:
                    break
            elif p.poll() is not None:
                break
            if time.monotonic() > deadline:
                p.kill()
                raise AssertionError(f"still running after {timeout}s:\n{tty.decode()}")
        out = p.stdout.read().decode() if p.stdout else ""
        p.wait()
    finally:
        os.close(master)
        if p.stdout:
            p.stdout.close()
    return p.returncode, out, tty.decode("utf-8", "replace")


def bar_seen(text: str, desc: str) -> bool:
    """tqdm's bar for `desc`: the description, a percentage, and an estimate."""
    return desc in text and "%|" in text and "<" in text


@pytest.fixture(scope="module")
def perplexity_cmd(tiny_dir):
    return ["-m", "llama_tp.perplexity", "--model", str(tiny_dir), "--text-file", TEXT]


def test_perplexity_shows_windows_on_a_terminal_only(perplexity_cmd):
    cmd = [sys.executable, *perplexity_cmd, "--context-length", "16", "--stride", "8"]
    code, out, tty = run_on_pty(cmd)
    assert code == 0, tty
    assert bar_seen(tty, "perplexity") and "window" in tty, tty
    assert "Perplexity:" in out and "%|" not in out
    quiet = run_on_pty(cmd + ["--quiet"])
    assert quiet[0] == 0 and "%|" not in quiet[2], quiet[2]
    piped = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "%|" not in piped.stderr, piped.stderr


def test_bench_trials_on_a_terminal_never_with_json(tiny_dir):
    cmd = [sys.executable, "-m", "llama_tp.bench", "--model", str(tiny_dir)]
    cmd += ["-p", "8", "-g", "4", "-n", "3", "--collective-steps", "0"]
    code, out, tty = run_on_pty(cmd)
    assert code == 0, tty
    assert bar_seen(tty, "llama_tp: trials"), tty
    code, out, tty = run_on_pty(cmd + ["--json"])
    assert code == 0 and out.startswith("{"), tty
    assert "%|" not in tty and "%|" not in out, tty


def test_convert_shows_writing(tiny_dir, tmp_path):
    cmd = [sys.executable, "-m", "llama_tp.convert", "--model", str(tiny_dir)]
    code, _, tty = run_on_pty(cmd + ["--out", str(tmp_path / "a"), "--shards", "2"])
    assert code == 0, tty
    assert bar_seen(tty, "writing rank-0") and bar_seen(tty, "writing rank-1"), tty
    code, _, tty = run_on_pty(cmd + ["--out", str(tmp_path / "b"), "--quiet"])
    assert code == 0 and tty.strip() == "", tty


def test_loading_reports_bytes(tiny_dir, monkeypatch, capsys):
    """Loading counts this rank's bytes, tensor by tensor (shown after a second: forced here)."""
    from llama_tp.cluster import progress
    from llama_tp.loading import loader

    monkeypatch.setattr(progress, "active", lambda: True)
    monkeypatch.setattr(
        loader, "progress", lambda **kw: progress.progress(**{**kw, "delay": 0, "mininterval": 0})
    )
    loader.load_model(tiny_dir)
    err = capsys.readouterr().err
    assert bar_seen(err, "loading model") and err.count("loading model") > 2, err  # per tensor


@pytest.mark.ranks
def test_two_ranks_one_bar_through_the_launcher(perplexity_cmd):
    """Under mlx.launch, rank 0 shows the bar when the launcher's output is a terminal
    (the launcher then passes COLUMNS on)."""
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(next(_PORTS)), "--"]
    cmd += [sys.executable, *perplexity_cmd, "--context-length", "16", "--stride", "8"]
    code, _, tty = run_on_pty(cmd, timeout=240, stdout_too=True)
    assert code == 0 and "exited with code" not in tty, tty
    assert bar_seen(tty, "perplexity"), tty
    assert tty.count("Perplexity:") == 1
    # The launcher's output on pipes: no bar, whatever COLUMNS says (GNU readline, loaded
    # in pytest, puts COLUMNS in the environment the launcher inherits).
    args = [*perplexity_cmd, "--context-length", "16", "--stride", "8"]
    r = launch(2, args, timeout=240)
    assert "Perplexity:" in r.stdout and "%|" not in r.stderr, r.stderr
