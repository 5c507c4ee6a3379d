"""`python -m llama_tp.chat` driven like a person at a terminal: through a pseudo-terminal
under `mlx.launch -n 2`, and through plain pipes on one process."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest
from conftest import _PORTS, BIN, ROOT

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX terminal")

WARN = "exited with code"
PROMPT = "\n>> "  # after a reply or a message (the line editor redraws with "\r>> ")


class Pty:
    """A command on a fresh pseudo-terminal that is its controlling terminal."""

    def __init__(self, cmd: list[str]):
        self.master, self.slave = os.openpty()
        # A size, as a real terminal has: mlx.launch then passes COLUMNS on to the ranks.
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        self.mode_before = termios.tcgetattr(self.slave)
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        self.out = b""

    def text(self, start: int = 0) -> str:
        return self.out[start:].decode("utf-8", "replace").replace("\r\n", "\n")

    def read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if ready:
            try:
                self.out += os.read(self.master, 1 << 16)
            except OSError:  # EIO once nothing holds the terminal open
                time.sleep(timeout)

    def expect(self, needle: str, start: int = 0, timeout: float = 60) -> int:
        """Wait until `needle` appears after byte `start`; returns the byte after it.

        The terminal turns every "\n" written into "\r\n"; `needle` is matched so."""
        raw = needle.replace("\n", "\r\n").encode()
        deadline = time.monotonic() + timeout
        while (i := self.out.find(raw, start)) < 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {needle!r} within {timeout}s; output:\n{self.text()}")
            self.read(0.1)
        return i + len(raw)

    def send(self, data: str) -> None:
        os.write(self.master, data.encode())

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read(0.1)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"still running after {timeout}s; output:\n{self.text()}")
        for _ in range(5):  # what the launcher wrote last
            self.read(0.05)
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.master)
        os.close(self.slave)


def expected_reply(model, text: str, max_tokens: int) -> str:
    from llama_tp import load
    from llama_tp.chat import Chat

    chat = Chat(*load(model), max_tokens=max_tokens, max_context=100_000)
    return chat.send(text)


def test_interactive_chat_two_ranks_through_a_terminal(tiny_dir):
    max_tokens = 400  # long enough to interrupt: tiny's replies never end by themselves
    hello = expected_reply(tiny_dir, "hello", max_tokens)
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(next(_PORTS)), "--"]
    cmd += [sys.executable, "-m", "llama_tp.chat", "--model", str(tiny_dir)]
    cmd += ["--max-tokens", str(max_tokens), "--max-context", "100000"]
    t = Pty(cmd)
    try:
        at = t.expect(PROMPT, timeout=120)
        # Turn 1; every key is echoed once, by rank 0's line editor.
        t.send("hello\r")
        at = t.expect(PROMPT, at)
        assert t.text().count(hello) == 1
        assert t.text().count("hello\n") == 1
        # Turn 2, edited: backspace and a cursor move before Enter.
        t.send("hi theer\x7f\x7fre\x1b[D\x1b[C\r")
        at = t.expect(PROMPT, at)
        assert "hi there\x1b[K\n" in t.text()  # the line as last drawn, then Enter
        t.send("/reset\r")
        at = t.expect(PROMPT, t.expect("[conversation reset]", at))
        # After /reset the same message gets the same reply as the first time.
        t.send("hello\r")
        started = t.expect("hello\n", at)
        t.expect(hello[:20], started)
        t.send("\x03")  # Ctrl-C during the reply
        at = t.expect(PROMPT, t.expect("[interrupted]", started))
        interrupted = t.text(started).split("[interrupted]")[0].strip()
        assert interrupted and hello.startswith(interrupted) and interrupted != hello
        # Ctrl-C at the prompt clears the line; Up recalls the last line for another turn.
        t.send("abc\x03")
        at = t.expect("abc^C\n>> ", at)
        t.send("\x1b[A\r")
        at = t.expect(PROMPT, t.expect("hello\x1b[K\n", at))
        t.send("\x04")  # Ctrl-D on an empty line: every rank ends
        code = t.wait(60)
        mode_after = termios.tcgetattr(t.slave)
    finally:
        t.close()
    out = t.text()
    assert code == 0, out
    assert WARN not in out and "Traceback" not in out and "error" not in out, out
    assert mode_after == t.mode_before  # rank 0 gave the terminal back as it found it
