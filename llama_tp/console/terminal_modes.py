"""How rank 0 of `python -m llama_tp.chat` reads its input (`console/terminal.py`'s
Console), by what it is attached to (`LLAMA_TP_TERMINAL=raw|lines|readline`
overrides the choice):

- "readline": one process on a terminal. `input()` with readline's line editing
  and history; Ctrl-C (SIGINT) during a reply stops it, at the prompt clears
  the line; Ctrl-D quits.
- "raw": a rank of an mlx.launch that runs at a terminal. mlx.launch forwards
  its stdin to every rank's stdin pipe but never its end, and a Ctrl-C there
  signals the launcher and every rank alike (killing the launcher). So rank 0
  switches the terminal (through /dev/tty) to a mode without signals, line
  buffering or echo: Ctrl-C and Ctrl-D then arrive as bytes 0x03 and 0x04
  through the launcher, and a small line editor (`line_editor.py`) echoes, edits
  and keeps a history. The terminal's mode is restored on every way out, SIGTERM and
  SIGHUP included.
- "lines": anything else (a pipe, a file, a remote pty). Lines are read as
  they come; the end of the input or a line holding only ^D quits; a ^C byte
  during a reply stops it (at the prompt it drops the line typed so far).
  When rank 0 is launched at a terminal that reports no window size (so
  mlx.launch passes no COLUMNS and the line editor, which needs the width, is
  off) and the launcher reads that terminal, the terminal keeps editing lines
  itself, but rank 0 turns its signals off and makes Ctrl-D and Ctrl-C end a
  line at once (VEOL, VEOL2): they then reach rank 0 as the bytes ^D and ^C
  instead of an end of file that mlx.launch swallows and a SIGINT that kills
  the launcher and every rank. Restored on every way out, as in "raw".
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

import mlx.core as mx

from ..cluster.tty import launcher_on_terminal

MODES = ("readline", "raw", "lines")


class RawTerminal:
    """The terminal at `fd` without signals, line buffering or echo, until `restore()`.

    `lines=True`: the terminal still edits and echoes lines, but without signals, and
    Ctrl-D and Ctrl-C end a line (arriving as the bytes ^D, ^C) rather than being an
    end of file and a SIGINT."""

    def __init__(self, fd: int, lines: bool = False):
        import termios

        self.fd = fd
        self.saved = termios.tcgetattr(fd)
        self._lock = threading.RLock()  # a signal handler may restore from within restore
        self._restored = False
        mode = termios.tcgetattr(fd)
        if lines:
            try:
                disabled = os.fpathconf(fd, "PC_VDISABLE")
            except (OSError, ValueError):
                disabled = 0
            mode[3] &= ~termios.ISIG
            mode[6][termios.VEOF] = bytes([disabled if disabled >= 0 else 0])
            mode[6][termios.VEOL] = b"\x04"
            mode[6][termios.VEOL2] = b"\x03"
        else:
            mode[0] &= ~termios.IXON  # Ctrl-S / Ctrl-Q are keys, not flow control
            mode[3] &= ~(termios.ECHO | termios.ICANON | termios.ISIG | termios.IEXTEN)
            mode[6][termios.VMIN], mode[6][termios.VTIME] = 1, 0
        termios.tcsetattr(fd, termios.TCSANOW, mode)

    def restore(self) -> None:
        import termios

        with self._lock:
            if self._restored:
                return
            with contextlib.suppress(OSError, termios.error):
                termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)
            if not self._restored:
                self._restored = True
                with contextlib.suppress(OSError):
                    os.close(self.fd)


def on_fatal_signals(action: Callable[[], None]) -> Callable[[], None]:
    """Run `action` and exit on SIGTERM or SIGHUP, even while the main thread is stuck
    in a collective (where Python's signal handlers cannot run): the signal's byte
    arrives through `signal.set_wakeup_fd` in a watcher thread. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    fatal = (signal.SIGTERM, signal.SIGHUP)
    r, w = os.pipe()
    os.set_blocking(w, False)

    def die(signum: int) -> None:
        action()
        os._exit(128 + signum)

    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    old = {s: signal.signal(s, lambda signum, frame: die(signum)) for s in fatal}

    def watch() -> None:
        with contextlib.suppress(OSError):
            while data := os.read(r, 64):
                for signum in data:
                    if signum in fatal:
                        die(signum)
        os.close(r)

    threading.Thread(target=watch, name="llama_tp-signals", daemon=True).start()

    def undo() -> None:
        signal.set_wakeup_fd(old_fd)
        for s, handler in old.items():
            signal.signal(s, handler)
        os.close(w)  # the watcher sees the end of its pipe and stops

    return undo


def _controlling_terminal() -> int | None:
    """A descriptor of this process's terminal when our process group is its
    foreground job (the user may be typing into it for us)."""
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None
    try:
        if os.tcgetpgrp(fd) == os.getpgrp():
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def input_mode(group: mx.distributed.Group) -> tuple[str, int | None]:
    """How rank 0 reads ("readline", "raw" or "lines") and, for "raw" and "lines" at
    a terminal (see the module's docstring), the terminal."""
    forced = os.environ.get("LLAMA_TP_TERMINAL", "")
    launched = group.size() > 1 or "MLX_RANK" in os.environ
    stdin_tty = os.isatty(0)
    if forced == "readline" or (not forced and not launched and stdin_tty):
        return "readline", None
    if forced in ("", "raw") and not stdin_tty:
        # mlx.launch passes COLUMNS on when its output is a terminal of known width.
        fd = None
        if forced:
            fd = _open_tty()
        elif "COLUMNS" in os.environ:
            fd = _controlling_terminal()
        elif launched:
            fd = _controlling_terminal()
            if fd is not None and launcher_on_terminal(0) is False:
                os.close(fd)
                fd = None
            if fd is not None:
                return "lines", fd
        if fd is not None:
            return "raw", fd
    return "lines", None


def _open_tty() -> int | None:
    try:
        return os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return None
