"""JSON text read as it arrives: where a value ends, and that it is JSON so far.

`json_value` is a reader step (`reader.py`): it reads one JSON value, handing each
checked piece of its text to `out` as soon as it is read (a call's arguments streamed as
the model writes them), and returns the value's whole text, or None at the first
character that cannot continue JSON (left unread) or at a reply that ends inside it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .reader import Reader, Step

MAX_DEPTH = 256  # deeper is refused: json.loads would reach Python's recursion limit
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")


class _Scan:
    """The state of one value's scan (see `json_value`)."""

    def __init__(self, starts: str):
        self.starts = starts  # the characters the value may begin with ("" any)
        self.stack: list[str] = []  # open containers: "{" or "["
        self.expect = "value"  # value, key, key_or_end, colon, comma_or_end, value_or_end
        self.inside = ""  # "string", "escape", "u0".."u3", "number", "literal"
        self.word = ""  # the number or literal read so far
        self.done = False

    def run(self, text: str, i: int) -> int:
        """Scan `text` from `i`; the index where it stopped (the value complete, the text
        used up, or an error: `self.expect` is then "error")."""
        n = len(text)
        while i < n and not self.done:
            c = text[i]
            if self.inside == "string":
                m = _STRING_RUN.match(text, i)
                if m:
                    i = m.end()
                    continue
                if c == '"':
                    self.inside = ""
                    self._after_value()
                elif c == "\\":
                    self.inside = "escape"
                else:
                    return self._error(i)  # a control character
                i += 1
            elif self.inside == "escape":
                if c not in _ESCAPES:
                    return self._error(i)
                self.inside = "u0" if c == "u" else "string"
                i += 1
            elif self.inside.startswith("u"):
                if c not in _HEX:
                    return self._error(i)
                k = int(self.inside[1]) + 1
                self.inside = "string" if k == 4 else f"u{k}"
                i += 1
            elif self.inside == "number":
                if c in _NUMBER_CHARS:
                    self.word += c
                    i += 1
                    continue
                if not _NUMBER.match(self.word):
                    return self._error(i)
                self.inside = ""
                self._after_value()
            elif self.inside == "literal":
                target = _LITERALS[self.word[0]]
                if c != target[len(self.word)]:
                    return self._error(i)
                self.word += c
                i += 1
                if self.word == target:
                    self.inside = ""
                    self._after_value()
            elif c in " \t\r\n":
                if not self.stack and self.expect == "value":
                    return self._error(i)  # the caller reads leading whitespace
                i += 1
            else:
                i = self._token(c, i)
                if self.expect == "error":
                    return i
        return i

    def finish(self) -> bool:
        """At the reply's end: whether a top-level number completes the value."""
        if self.inside == "number" and not self.stack and _NUMBER.match(self.word):
            self.inside, self.done = "", True
        return self.done

    def _token(self, c: str, i: int) -> int:
        e = self.expect
        if e in ("value", "value_or_end"):
            if e == "value_or_end" and c == "]":
                return self._close(i)
            if not self.stack and self.starts and c not in self.starts:
                return self._error(i)
            if c in "{[":
                if len(self.stack) >= MAX_DEPTH:
                    return self._error(i)
                self.stack.append(c)
                self.expect = "key_or_end" if c == "{" else "value_or_end"
            elif c == '"':
                self.inside = "string"
            elif c in "-0123456789":
                self.inside, self.word = "number", c
            elif c in _LITERALS:
                self.inside, self.word = "literal", c
            else:
                return self._error(i)
            return i + 1
        if e in ("key", "key_or_end"):
            if e == "key_or_end" and c == "}":
                return self._close(i)
            if c != '"':
                return self._error(i)
            self.inside, self.expect = "string", "colon"
            return i + 1
        if e == "colon":
            if c != ":":
                return self._error(i)
            self.expect = "value"
            return i + 1
        # comma_or_end
        if c == ",":
            self.expect = "key" if self.stack[-1] == "{" else "value"
            return i + 1
        if c == ("}" if self.stack[-1] == "{" else "]"):
            return self._close(i)
        return self._error(i)

    def _close(self, i: int) -> int:
        self.stack.pop()
        self._after_value()
        return i + 1

    def _after_value(self) -> None:
        if self.expect == "colon":  # that string was a key
            return
        if self.stack:
            self.expect = "comma_or_end"
        else:
            self.done = True

    def _error(self, i: int) -> int:
        self.expect = "error"
        return i


def json_value(r: Reader, out: Callable[[str], None] | None = None, starts: str = "") -> Step:
    """Read one JSON value beginning at `r.pos` (its first character one of `starts`,
    when given): its text, or None where it stops being JSON (that character unread) or
    at the reply's end. `out` gets the text as it is checked."""
    scan, pieces = _Scan(starts), []
    while True:
        start = r.pos
        r.pos = scan.run(r.buf, r.pos)
        if r.pos > start:
            piece = r.buf[start : r.pos]
            pieces.append(piece)
            if out is not None:
                out(piece)
        if scan.done:
            return "".join(pieces)
        if scan.expect == "error":
            return None
        if r.eof:
            return "".join(pieces) if scan.finish() else None
        yield
