"""Reading the user's input for `python -m llama_tp.chat`, on one process or across ranks.

Only rank 0 reads; each line (or the decision to quit) reaches every other rank
through `broadcast_object`, so all ranks run the same turns. How rank 0 reads
("readline", "raw" or "lines", by what it is attached to; `LLAMA_TP_TERMINAL`
overrides the choice) and the terminal modes: `console/terminal_modes.py`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import mlx.core as mx

from ..cluster.distributed import broadcast_object, world
from .line_editor import EOF, KeyDecoder, LineEditor
from .terminal_modes import RawTerminal, input_mode, on_fatal_signals


class Console:
    """The chat command's input and output, on every rank (use it as a context manager).

    `read_line(prompt)` is collective: rank 0 reads a line, every rank returns
    it (None: quit). `console.interrupted` turns True on rank 0 when the user
    presses Ctrl-C after sending a line and before the next prompt (during its
    reply, or while it is on its way); pass it as the reply's `should_stop`, so
    that every rank stops at the same token. Output goes to rank 0's stdout only.
    """

    def __init__(self, group: mx.distributed.Group | None = None):
        self.group = group or world()
        self.rank0 = self.group.rank() == 0
        self.mode, self._tty = input_mode(self.group) if self.rank0 else ("none", None)
        self.interactive = (
            self.mode in ("readline", "raw") or self._tty is not None or self.rank0 and os.isatty(0)
        )
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._replying = False
        # Lines are numbered from 1 in the order they are typed. Ctrl-C stops the reply
        # to the first line whose turn has not ended (the line being answered, or the
        # next one if it was sent and not yet picked up), never a later one.
        self._queued = 0  # lines queued by the stdin thread
        self._taken = 0  # lines returned by read_line (the current turn's number)
        self._done = 0  # lines whose turn has ended
        self._stop_line = 0  # the line whose reply Ctrl-C stops
        self._ended = False  # the input ended: ignore the rest
        self._terminal: RawTerminal | None = None
        self._undo_signals: Callable[[], None] | None = None
        self._old_sigint = None
        self._editor = LineEditor(self.write)
        self._keys = KeyDecoder()
        self._pending = b""
        self._prompt = ""

    def __enter__(self) -> Console:
        if not self.rank0:
            # Nobody reads these, but mlx.launch keeps writing every rank's stdin.
            self._thread(self._drain)
        elif self.mode == "readline":
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (input() edits lines and keeps history)
            if threading.current_thread() is threading.main_thread():
                self._old_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        elif self.mode == "raw":
            self._terminal = RawTerminal(self._tty)
            self._undo_signals = on_fatal_signals(self._terminal.restore)
            self._thread(self._read, self._on_keys)
        else:
            if self._tty is not None:  # lines at a terminal: Ctrl-D/Ctrl-C as bytes
                self._terminal = RawTerminal(self._tty, lines=True)
                self._undo_signals = on_fatal_signals(self._terminal.restore)
            self._thread(self._read, self._on_lines)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._old_sigint is not None:
            signal.signal(signal.SIGINT, self._old_sigint)
            self._old_sigint = None
        if self._terminal is not None:
            self._terminal.restore()
        if self._undo_signals is not None:
            self._undo_signals()
            self._undo_signals = None

    # -- output (rank 0) ------------------------------------------------------

    def write(self, text: str) -> None:
        if self.rank0:
            sys.stdout.write(text)
            sys.stdout.flush()

    def info(self, text: str) -> None:
        """A message for the user: on stdout at a terminal, on stderr otherwise."""
        if self.rank0:
            stream = sys.stdout if self.interactive else sys.stderr
            stream.write(text + "\n")
            stream.flush()

    def error(self, text: str) -> None:
        self.info(f"error: {text}")

    # -- input ------------------------------------------------------------------

    def read_line(self, prompt: str = ">> ") -> str | None:
        """The next line the user typed, on every rank; None when the user quits."""
        line = self._read_line(prompt) if self.rank0 else None
        return broadcast_object(line, self.group)

    def interrupted(self) -> bool:
        return self._stop_line == self._taken > self._done

    @contextlib.contextmanager
    def replying(self) -> Iterator[None]:
        """Around a reply: Ctrl-C interrupts it."""
        with self._lock:
            self._replying = True
        try:
            yield
        finally:
            with self._lock:
                self._replying = False
                self._done = self._taken  # this line's turn is over

    def _on_sigint(self, signum, frame) -> None:
        # "readline" mode, main thread: after a line was sent, Ctrl-C is for its reply;
        # at the prompt, input() gets the usual KeyboardInterrupt.
        if self._replying or self._taken > self._done:
            self._stop_line = self._taken
        else:
            raise KeyboardInterrupt

    def _ctrl_c(self) -> bool:
        """Called with the lock held: does a Ctrl-C now interrupt a reply?"""
        if self._replying or self._queued > self._done:
            self._stop_line = self._done + 1
            return True
        return False

    def _read_line(self, prompt: str) -> str | None:
        with self._lock:  # the previous line's turn is over
            self._done = self._taken
        line = self._read_local(prompt)
        if line is not None:
            with self._lock:
                self._taken += 1
        return line

    def _read_local(self, prompt: str) -> str | None:
        if self.mode == "readline":
            while True:
                try:
                    return input(prompt)
                except KeyboardInterrupt:
                    self.write("\n")
                except EOFError:
                    self.write("\n")
                    return None
        if self.mode == "raw":
            self._editor.start(prompt)
            while True:
                key = self._queue.get()
                result = EOF if key is EOF else self._editor.key(key)
                if result is EOF:
                    return None
                if result is not None:
                    return result
        if self.interactive:
            self._prompt = prompt
            self.write(prompt)
        line = self._queue.get()
        return None if line is EOF else line

    # -- stdin threads ----------------------------------------------------------

    def _thread(self, target: Callable, *args) -> None:
        threading.Thread(target=target, args=args, name="llama_tp-stdin", daemon=True).start()

    @staticmethod
    def _drain() -> None:
        with contextlib.suppress(OSError, ValueError):
            while os.read(0, 1 << 16):
                pass

    def _read(self, on_bytes: Callable[[bytes], None]) -> None:
        data = b""
        with contextlib.suppress(OSError, ValueError):
            while data := os.read(0, 1 << 12):
                on_bytes(data)
                if self._ended:
                    return
        on_bytes(b"")  # the end of the input

    def _end(self) -> None:
        self._ended = True
        self._queue.put(EOF)

    def _on_keys(self, data: bytes) -> None:
        if not data:
            self._end()
            return
        for key in self._keys.feed(data):
            with self._lock:
                if key == "ctrl-c" and self._ctrl_c():
                    continue
                if key == "enter":
                    self._queued += 1
                self._queue.put(key)

    def _on_lines(self, data: bytes) -> None:
        if self._ended:
            return
        for i, part in enumerate(data.split(b"\x03")):
            if i:  # a ^C byte came before this part: it drops the line typed so far
                self._pending = b""
                with self._lock:
                    at_prompt = not self._ctrl_c()
                if at_prompt and self._terminal is not None:
                    self.write("\n" + self._prompt)  # the terminal echoed ^C
            *lines, self._pending = (self._pending + part).split(b"\n")
            for raw in lines:
                if raw and not raw.strip(b"\x04"):  # ^D on an empty line
                    self._end()
                    return
                line = raw.decode("utf-8", "replace").removesuffix("\r").replace("\x04", "")
                with self._lock:
                    self._queued += 1
                    self._queue.put(line)
            if self._pending.endswith(b"\x04") and not self._pending.strip(b"\x04"):
                self._end()
                return
        if not data:  # the end of the input, after its last line
            if self._pending:
                with self._lock:
                    self._queued += 1
                    self._queue.put(self._pending.decode("utf-8", "replace").replace("\x04", ""))
            self._end()
