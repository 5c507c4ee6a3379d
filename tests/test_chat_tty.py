"""`python -m llama_tp.chat` driven like a person at a terminal: through a pseudo-terminal
under `mlx.launch -n 2`, and through plain pipes on one process. The input's pieces
without a terminal (key decoder, line editor, Ctrl-C): test_console_input.py."""

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

    def __init__(self, cmd: list[str], size: tuple[int, int] | None = (24, 100)):
        self.master, self.slave = os.openpty()
        # A size, as a real terminal has: mlx.launch then passes COLUMNS on to the ranks.
        # Without one (some serial consoles, editors' shells), it passes none.
        if size:
            fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
        self.mode_before = termios.tcgetattr(self.slave)
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
            # os.environ, explicitly: GNU readline, once loaded (pytest loads it), sets
            # COLUMNS and LINES in the C environment that env=None would pass on.
            env={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
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


LONG = 3000  # --max-tokens: a reply that does not end by itself is long on any machine


@pytest.fixture(scope="module")
def turns(tiny_dir):
    """Two messages whose replies (greedy, one after the other) end by themselves within
    150 tokens, with those replies; and the start of the (long) reply to 'hello'."""
    from llama_tp import Chat, load

    model = load(tiny_dir)

    def replies(*messages):  # greedy: as with --max-tokens LONG when they end by themselves
        chat = Chat(*model, max_tokens=150, max_context=100_000)
        out = [chat.send(m) for m in messages]
        return out, chat.last_stats.finish_reason == "stop"

    hello = Chat(*model, max_tokens=200, max_context=100_000)
    assert hello.send("hello") and hello.last_stats.finish_reason == "length"
    for first in ("n", "q", "c", "yes"):
        if replies(first)[1]:
            for second in ("go on", "no", "why", "and", "yes", "ok"):
                (r1, r2), short = replies(first, second)
                if short:
                    return first, r1, second, r2, hello.history[-1]["content"]
    pytest.fail("no two messages whose replies end soon")


def test_interactive_chat_two_ranks_through_a_terminal(tiny_dir, turns, monkeypatch):
    monkeypatch.delenv("LLAMA_TP_TERMINAL", raising=False)
    first, r1, second, r2, hello = turns
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(next(_PORTS)), "--"]
    cmd += [sys.executable, "-m", "llama_tp.chat", "--model", str(tiny_dir)]
    cmd += ["--max-tokens", str(LONG), "--max-context", "100000"]
    t = Pty(cmd)
    try:
        at = t.expect(PROMPT, timeout=120)
        # Two turns. Rank 0's line editor echoes each key once; the second line is
        # typed with a typo, a backspace and cursor moves.
        t.send(first + "\r")
        at = t.expect(f"{first}\n{r1}\n>> ", at)
        t.send(f"{second[:-1]}x\x7f{second[-1]}\x1b[D\x1b[C\r")
        at = t.expect(f"{second}\x1b[K\n{r2}\n>> ", at)
        t.send("/reset\r")
        at = t.expect("[conversation reset]\n>> ", at)
        # Ctrl-C during a long reply stops it on every rank and returns to the prompt.
        t.send("hello\r")
        started = t.expect("hello\n", at)
        t.expect(hello[:20], started)
        t.send("\x03")
        at = t.expect("\n[interrupted]\n>> ", started)
        part = t.text(started).split("\n[interrupted]")[0]
        assert part[:200] == hello[: len(part[:200])]  # the same reply as in one process
        # At the prompt Ctrl-C clears the line; Up recalls 'hello' for another turn,
        # and a Ctrl-C right after Enter stops that reply too.
        t.send("abc\x03")
        at = t.expect("abc^C\n>> ", at)
        t.send("\x1b[A\r\x03")
        at = t.expect("[interrupted]\n>> ", t.expect("hello\x1b[K\n", at))
        assert t.text().count("[interrupted]") == 2
        # After all that the ranks are still in step: start over, get the first reply again.
        t.send("/reset\r")
        t.send(first + "\r")
        at = t.expect(f"{first}\n{r1}\n>> ", at)
        t.send("\x04")  # Ctrl-D on an empty line: every rank ends
        code = t.wait(60)
        mode_after = termios.tcgetattr(t.slave)
    finally:
        t.close()
    out = t.text()
    assert code == 0, out
    assert WARN not in out and "Traceback" not in out and "error" not in out, out
    assert out.count(r1) == 2 and out.count(r2) == 1  # each reply printed once
    assert mode_after == t.mode_before  # rank 0 gave the terminal back as it found it


def test_two_ranks_at_a_terminal_without_a_window_size(tiny_dir, turns, monkeypatch):
    """Line mode at the terminal: the terminal edits and echoes lines; Ctrl-C stops a
    reply and keeps the chat, Ctrl-D on an empty line ends every rank with exit 0."""
    monkeypatch.delenv("LLAMA_TP_TERMINAL", raising=False)
    first, r1, _, _, hello = turns
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(next(_PORTS)), "--"]
    cmd += [sys.executable, "-m", "llama_tp.chat", "--model", str(tiny_dir)]
    t = Pty(cmd + ["--max-tokens", str(LONG), "--max-context", "100000"], size=None)
    try:
        at = t.expect(">> ", timeout=120)
        t.send(first + "\r")
        at = t.expect(f"{r1}\n>> ", at)
        t.send("/reset\r")
        at = t.expect("[conversation reset]\n>> ", at)
        t.send("hello\r")
        started = t.expect("hello\n", at)
        t.expect(hello[:20], started)
        t.send("\x03")  # a byte to rank 0, not a SIGINT to the launcher and every rank
        at = t.expect("\n[interrupted]\n>> ", started)
        t.send("abc\x03")  # at the prompt: drops the line
        at = t.expect("\n>> ", at)
        t.send("/reset\r" + first + "\r")  # the ranks are still in step: the same reply
        at = t.expect(f"{r1}\n>> ", at)
        t.send("\x04")  # Ctrl-D on an empty line: every rank ends
        code = t.wait(60)
        mode_after = termios.tcgetattr(t.slave)
    finally:
        t.close()
    out = t.text()
    assert code == 0, out
    assert WARN not in out and "Traceback" not in out and "error" not in out, out
    assert "abc" + first not in out.replace("^C", "")  # the dropped line was not sent
    assert mode_after == t.mode_before  # rank 0 gave the terminal back as it found it


def test_interactive_chat_one_process_with_readline(tiny_dir, turns, monkeypatch):
    monkeypatch.delenv("LLAMA_TP_TERMINAL", raising=False)
    first, r1, _, _, hello = turns
    cmd = [sys.executable, "-m", "llama_tp.chat", "--model", str(tiny_dir)]
    t = Pty(cmd + ["--max-tokens", str(LONG), "--max-context", "100000"])
    try:
        at = t.expect(">> ", timeout=120)
        t.send(first + "\r")
        at = t.expect(f"{r1}\n>> ", at)
        t.send("/reset\rhello\r")
        t.expect(hello[:20], at)
        t.send("\x03")  # SIGINT, from the terminal: stops the reply
        at = t.expect("[interrupted]\n>> ", at)
        t.send("\x04")  # end of file at the prompt
        code = t.wait(60)
    finally:
        t.close()
    assert code == 0, t.text()
    assert t.text().count(r1) == 1 and "Traceback" not in t.text(), t.text()


def test_sigterm_during_a_reply_restores_the_terminal(tiny_dir, monkeypatch):
    """Killing the whole launch (launcher and ranks, as a closing terminal window
    would) in the middle of a reply still gives the terminal its mode back."""
    monkeypatch.delenv("LLAMA_TP_TERMINAL", raising=False)
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(next(_PORTS)), "--"]
    cmd += [sys.executable, "-m", "llama_tp.chat", "--model", str(tiny_dir)]
    t = Pty(cmd + ["--max-tokens", str(LONG), "--max-context", "100000"])
    try:
        at = t.expect(PROMPT, timeout=120)
        assert termios.tcgetattr(t.slave) != t.mode_before  # rank 0 took the terminal
        t.send("hello\r")
        t.expect("hello\n", at)
        t.read(0.5)
        os.killpg(t.proc.pid, signal.SIGTERM)
        t.proc.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until every rank has gone too
            try:
                os.killpg(t.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        assert termios.tcgetattr(t.slave) == t.mode_before
    finally:
        t.close()


class Piped:
    """A command with pipes for stdin/stdout/stderr, read as they come."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.out = {self.proc.stdout.fileno(): b"", self.proc.stderr.fileno(): b""}
        self.open = set(self.out)

    @property
    def stdout(self) -> str:
        return self.out[self.proc.stdout.fileno()].decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.out[self.proc.stderr.fileno()].decode("utf-8", "replace")

    def read(self, timeout: float) -> bool:
        """Read what is there within `timeout`; False once nothing more will come."""
        if not self.open:
            return False
        ready, _, _ = select.select(list(self.open), [], [], timeout)
        for fd in ready:
            data = os.read(fd, 1 << 16)
            self.out[fd] += data
            if not data:
                self.open.discard(fd)
        return bool(self.open)

    def expect(self, needle: str, start: int = 0, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while (i := self.stdout.find(needle, start)) < 0:
            if time.monotonic() > deadline or not self.read(0.05):
                raise AssertionError(
                    f"no {needle!r} in stdout:\n{self.stdout}\nstderr:\n{self.stderr}"
                )
        return i + len(needle)

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
            raise AssertionError(f"still running after {timeout}s:\n{self.stdout}")
        while self.read(0):
            pass
        return self.proc.returncode


@pytest.mark.parametrize("ending", ["eof", "ctrl-d"])
def test_chat_through_pipes_single_process(tiny_dir, turns, monkeypatch, ending):
    monkeypatch.delenv("LLAMA_TP_TERMINAL", raising=False)
    first, r1, _, _, hello = turns
    cmd = [sys.executable, "-m", "llama_tp.chat", "--model", str(tiny_dir)]
    p = Piped(cmd + ["--max-tokens", str(LONG), "--max-context", "100000"])
    try:
        p.send(f"{first}\n/reset\nhello\n")
        at = p.expect(f"{r1}\n", timeout=120)
        at = p.expect(hello[:20], at)  # the long reply to 'hello': interrupt it
        p.send("\x03")
        at = p.expect("\n[interrupted]\n", at)
        p.send("bye\n\x03")  # a ^C right after a line stops its reply
        p.expect("[interrupted]\n", at)
        if ending == "eof":
            p.proc.stdin.close()
        else:
            p.send("\x04\n")
        code = p.wait()
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
    assert code == 0, p.stderr
    assert p.stdout.count(r1) == 1 and p.stdout.count("[interrupted]") == 2, p.stdout
    assert ">>" not in p.stdout  # no prompts when nobody is at a terminal
    assert "[conversation reset]" in p.stderr and "error" not in p.stderr, p.stderr
