"""Gemma's calls: `call:f{key:value,...}` with strings between a delimiter token.

    gemma4          <|tool_call>call:f{city:<|"|>Paris<|"|>,days:3}<tool_call|>  (Gemma 4)
    function_gemma  <start_function_call>call:f{city:<escape>Paris<escape>}<end_function_call>
                    (FunctionGemma, a Gemma 3)

Keys are bare (or between the delimiters), strings between the delimiter, numbers,
true/false/null as JSON writes them, objects and lists in braces and brackets. A call's
arguments are streamed as JSON text, one parameter at a time as each completes.
"""

from __future__ import annotations

import json

from .base import Calls, marked, name_ok, skip_to
from .reader import Reader, Step, literal, one_of, spaces, until, wait
from .xml_calls import Params

NAME_LIMIT = 256
DEPTH = 64  # nesting past this is not a call
_BARE_ENDS = frozenset(",}]<\n")
_WORDS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _key(r: Reader, q: str) -> Step:
    """A key and its colon (read): the key, or None."""
    yield from spaces(r)
    key, _ = yield from until(r, (":",), limit=NAME_LIMIT)
    if key is None:
        return None
    key = key.strip()
    if key.startswith(q) and key.endswith(q) and len(key) >= 2 * len(q):
        key = key[len(q) : -len(q)]
    return key or None


def value(r: Reader, q: str, depth: int = 0) -> Step:
    """One value: (True, it) or (False, None) where it stops being one."""
    yield from spaces(r)
    if depth > DEPTH or not (yield from wait(r)):
        return False, None
    if (yield from literal(r, q)):
        text, end = yield from until(r, (q,))
        return end is not None, text
    c = r.buf[r.pos]
    if c in "{[":
        r.pos += 1
        close, out = ("}", {}) if c == "{" else ("]", [])
        yield from spaces(r)
        if (yield from literal(r, close)):
            return True, out
        while True:
            if close == "}":
                key = yield from _key(r, q)
                if key is None:
                    return False, None
            ok, item = yield from value(r, q, depth + 1)
            if not ok:
                return False, None
            if close == "}":
                out[key] = item
            else:
                out.append(item)
            yield from spaces(r)
            sep = yield from one_of(r, (",", close))
            if sep != ",":
                return sep is not None, out
    return (yield from _bare(r))


def _bare(r: Reader) -> Step:
    """A number or a word, to the next `,`, `}`, `]` (unread)."""
    while True:
        end = next((i for i in range(r.pos, len(r.buf)) if r.buf[i] in _BARE_ENDS), None)
        if end is not None or r.eof:
            end = len(r.buf) if end is None else end
            word, r.pos = r.buf[r.pos : end].strip(), end
            if word in _WORDS:
                return True, _WORDS[word]
            try:
                return True, json.loads(word)
            except ValueError:
                return bool(word), word
        if len(r.buf) - r.pos > NAME_LIMIT:
            return False, None
        yield


def gemma_section(q: str, end: str):
    """Sections of one `call:f{...}` and `end`, strings between `q`."""

    def section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
        if not (yield from literal(r, "call:")):
            return False
        name, _ = yield from until(r, ("{",), limit=NAME_LIMIT)
        if not name_ok(name):
            return False
        params, closed = Params(calls, tools, name), False
        yield from spaces(r)
        closed = yield from literal(r, "}")
        while not closed:
            key = yield from _key(r, q)
            ok, item = (yield from value(r, q)) if key is not None else (False, None)
            if not ok:
                break
            params.put(key, item)
            yield from spaces(r)
            sep = yield from one_of(r, (",", "}"))
            closed = sep == "}"
            if sep is None:
                break
        params.close()
        if not closed:
            yield from skip_to(r, (end,))
            return True
        yield from spaces(r)
        yield from literal(r, end)
        return True

    return section


gemma4 = marked(("<|tool_call>",), gemma_section('<|"|>', "<tool_call|>"))
function_gemma = marked(
    ("<start_function_call>",), gemma_section("<escape>", "<end_function_call>")
)
