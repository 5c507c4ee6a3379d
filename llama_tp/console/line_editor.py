"""Keys and a one-line editor for rank 0's raw-mode terminal input (see terminal_modes.py).

`KeyDecoder` turns the bytes a terminal sends into key names; `LineEditor`
keeps the line, the cursor and the history, and redraws through a writer.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable

EOF = object()  # the user quit

CONTROLS = {
    "\r": "enter",
    "\n": "enter",
    "\x7f": "backspace",
    "\x08": "backspace",
    "\x03": "ctrl-c",
    "\x04": "ctrl-d",
    "\x01": "home",
    "\x05": "end",
    "\x02": "left",
    "\x06": "right",
    "\x10": "up",
    "\x0e": "down",
    "\x15": "kill-start",
    "\x0b": "kill-end",
    "\x17": "kill-word",
    "\x0c": "redraw",
    "\t": " ",
}
ESCAPES = {
    "[A": "up",
    "[B": "down",
    "[C": "right",
    "[D": "left",
    "[H": "home",
    "[F": "end",
    "OA": "up",
    "OB": "down",
    "OC": "right",
    "OD": "left",
    "OH": "home",
    "OF": "end",
    "[1~": "home",
    "[7~": "home",
    "[4~": "end",
    "[8~": "end",
    "[3~": "delete",
}


class KeyDecoder:
    """Bytes typed at a terminal in raw mode -> keys: single characters, or names
    such as "enter", "ctrl-c", "up" (escape sequences of unknown keys are dropped)."""

    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._esc: str | None = None
        self._cr = False

    def feed(self, data: bytes) -> list[str]:
        keys = []
        for ch in self._utf8.decode(data):
            cr, self._cr = self._cr, ch == "\r"
            if self._esc is not None:
                self._esc += ch
                seq = self._esc[1:]
                if seq in ("[", "O") or (seq[0] == "[" and not "\x40" <= ch <= "\x7e"):
                    continue  # more to come
                self._esc = None
                if seq in ESCAPES:
                    keys.append(ESCAPES[seq])
            elif ch == "\x1b":
                self._esc = ch
            elif ch == "\n" and cr:
                continue  # "\r\n" is one Enter
            elif ch in CONTROLS:
                keys.append(CONTROLS[ch])
            elif ch >= " ":
                keys.append(ch)
        return keys


class LineEditor:
    """A one-line editor drawn with plain ANSI sequences through `write`.

    `start(prompt)`, then `key(k)` for each key until it returns the line (a
    str) or EOF (Ctrl-D on an empty line). Ctrl-C abandons the line."""

    def __init__(self, write: Callable[[str], None], history_size: int = 1000):
        self.write = write
        self.history: list[str] = []
        self.history_size = history_size
        self.prompt, self.buf, self.pos = "", "", 0
        self._browse, self._draft = 0, ""

    def start(self, prompt: str) -> None:
        self.prompt, self.buf, self.pos = prompt, "", 0
        self._browse, self._draft = len(self.history), ""
        self.write(prompt)

    def _redraw(self) -> None:
        back = len(self.buf) - self.pos
        self.write(f"\r{self.prompt}{self.buf}\x1b[K" + (f"\x1b[{back}D" if back else ""))

    def _set(self, buf: str, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self._redraw()

    def key(self, k: str):
        buf, pos = self.buf, self.pos
        if len(k) == 1:  # a character
            if pos == len(buf):
                self.buf, self.pos = buf + k, pos + 1
                self.write(k)
            else:
                self._set(buf[:pos] + k + buf[pos:], pos + 1)
        elif k == "enter":
            self.write("\n")
            if buf.strip() and (not self.history or self.history[-1] != buf):
                self.history = [*self.history, buf][-self.history_size :]
            return buf
        elif k == "ctrl-c":
            self.write("^C\n")
            self.start(self.prompt)
        elif k == "ctrl-d" and not buf:
            self.write("\n")
            return EOF
        elif k == "backspace" and pos > 0:
            if pos == len(buf):
                self.buf, self.pos = buf[:-1], pos - 1
                self.write("\b \b")
            else:
                self._set(buf[: pos - 1] + buf[pos:], pos - 1)
        elif k in ("delete", "ctrl-d") and pos < len(buf):
            self._set(buf[:pos] + buf[pos + 1 :], pos)
        elif k == "left" and pos > 0:
            self._set(buf, pos - 1)
        elif k == "right" and pos < len(buf):
            self._set(buf, pos + 1)
        elif k == "home":
            self._set(buf, 0)
        elif k == "end":
            self._set(buf, len(buf))
        elif k == "kill-start":
            self._set(buf[pos:], 0)
        elif k == "kill-end":
            self._set(buf[:pos], pos)
        elif k == "kill-word":
            start = len(buf[:pos].rstrip())
            start = len(buf[:start]) - len(buf[:start].split(" ")[-1]) if start else 0
            self._set(buf[:start] + buf[pos:], start)
        elif k == "redraw":
            self._redraw()
        elif k in ("up", "down"):
            i = self._browse + (-1 if k == "up" else 1)
            if 0 <= i <= len(self.history):
                if self._browse == len(self.history):
                    self._draft = buf
                self._browse = i
                line = self.history[i] if i < len(self.history) else self._draft
                self._set(line, len(line))
        return None
