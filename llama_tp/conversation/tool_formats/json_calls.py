"""Formats whose calls' arguments are JSON text between markers: the parsers.

    hermes          <tool_call>\\n{"name": f, "arguments": {...}}\\n</tool_call>  (Qwen2.5, Qwen3,
                    Qwen3-Next)
    deepseek_v3     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json
                    \\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>  (V3, V3-0324, R1)
    deepseek_v3_1   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}
                    <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>  (V3.1, V3.1-Terminus)
    kimi_k2         <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
                    <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>
    mistral_json    [TOOL_CALLS][{"name": f, "arguments": {...}}, ...]  (Mistral v3, Nemo)
    mistral_args    [TOOL_CALLS]f[ARGS]{...}  (Mistral-Small-3.2, Ministral 3, Devstral)
    nemotron_v2     <TOOLCALL>[{"name": f, "arguments": {...}}, ...]</TOOLCALL>
    llama3_json     {"name": f, "parameters": {...}} as the reply, or after <|python_tag|>
    llama4_json     the same, or between <|python_start|> and <|python_end|>

Each parser streams a call's arguments as the model writes them (`json_text.py`).
"""

from __future__ import annotations

import json
import re

from .base import Calls, marked, name_ok, skip_to
from .json_text import json_value
from .reader import Reader, Step, literal, one_of, spaces, until, wait

NAME_LIMIT = 256  # characters of a function's name (or a call's header) before it is not one


def call_object(r: Reader, calls: Calls, args_keys: tuple[str, ...] = ("arguments",)) -> Step:
    """Read `{"name": f, "arguments": {...}}` (keys in any order, others skipped): None
    when it is not a call (nothing certain), "call", or "broken" (a call that stopped
    being JSON after it became certain). Arguments given as a JSON string are decoded."""
    if not (yield from literal(r, "{")):
        return None
    name, pending, done = None, None, False
    while True:
        yield from spaces(r)
        key = yield from json_value(r, None, '"')
        if key is None:
            return "broken" if calls.open else None
        yield from spaces(r)
        if not (yield from literal(r, ":")):
            return "broken" if calls.open else None
        yield from spaces(r)
        key = json.loads(key)
        if key == "name" and name is None:
            raw = yield from json_value(r, None, '"')
            name = json.loads(raw) if raw is not None else None
            if not name_ok(name):
                return None
            if pending is not None:  # the arguments came first
                calls.start(name)
                calls.args(pending)
        elif key in args_keys and not done:
            args = yield from _arguments(r, calls, name)
            if args is None:
                return "broken" if calls.open else None
            pending, done = args, True
        else:
            if (yield from json_value(r)) is None:
                return "broken" if calls.open else None
        yield from spaces(r)
        sep = yield from one_of(r, (",", "}"))
        if sep is None:
            return "broken" if calls.open else None
        if sep == "}":
            break
    if name is None:
        return None
    if not done:  # {"name": f}: a function without arguments
        calls.start(name)
        calls.args("{}")
    return "call"


def _arguments(r: Reader, calls: Calls, name: str | None) -> Step:
    """A call's arguments (an object, or a string holding one): the text, streamed to
    `calls` once the name is known (the call then certain); None when not arguments."""
    if not (yield from wait(r)):
        return None
    if r.buf[r.pos] == '"':
        raw = yield from json_value(r, None, '"')
        try:
            text = json.loads(raw)
            if not isinstance(json.loads(text), dict):
                return None
        except (TypeError, ValueError, RecursionError):
            return None
        if name is not None:
            calls.start(name)
            calls.args(text)
        return text
    if r.buf[r.pos] != "{":
        return None
    if name is None:
        return (yield from json_value(r, None, "{"))
    calls.start(name)
    return (yield from json_value(r, calls.args, "{"))


def json_args(r: Reader, calls: Calls, name: str, given_id: str | None = None) -> Step:
    """A call whose name was read: its arguments' object (whitespace before it read):
    None (not a call), "call", or "broken"."""
    yield from spaces(r)
    if not (yield from wait(r)) or r.buf[r.pos] != "{":
        return None
    calls.start(name, given_id)
    raw = yield from json_value(r, calls.args, "{")
    return "call" if raw is not None else "broken"


# -- hermes -------------------------------------------------------------------------


def hermes_section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
    yield from spaces(r)
    got = yield from call_object(r, calls)
    if got is None:
        return False
    if got == "broken":
        yield from skip_to(r, ("</tool_call>",))
        return True
    yield from spaces(r)
    yield from literal(r, "</tool_call>")
    return True


hermes = marked(("<tool_call>",), hermes_section)

# -- DeepSeek V3, V3.1 ----------------------------------------------------------------

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def deepseek_section(fenced: bool):
    """DeepSeek's section of calls: V3's `function<sep>f\\n```json ...```` (`fenced`) or
    V3.1's `f<sep>{...}`."""

    def section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
        n = 0
        while True:
            yield from spaces(r)
            tag = yield from one_of(r, (DS_CALL, DS_CALLS_END))
            if tag != DS_CALL:
                return n > 0
            if n:
                r.mark = r.pos - len(DS_CALL)
            if fenced:
                if not (yield from literal(r, "function" + DS_SEP)):
                    return n > 0
                name, _ = yield from until(r, ("\n",), limit=NAME_LIMIT)
                if not name_ok(name) or not (yield from literal(r, "```json")):
                    return n > 0
            else:
                name, _ = yield from until(r, (DS_SEP,), limit=NAME_LIMIT)
                if not name_ok(name):
                    return n > 0
            got = yield from json_args(r, calls, name)
            if got is None:
                return n > 0
            calls.end()
            n += 1
            if got == "broken":
                yield from skip_to(r, (DS_CALL_END, DS_CALLS_END))
                continue
            yield from spaces(r)
            if fenced:
                yield from literal(r, "```")
                yield from spaces(r)
            yield from literal(r, DS_CALL_END)

    return section


deepseek_v3 = marked((DS_CALLS,), deepseek_section(fenced=True))
deepseek_v3_1 = marked((DS_CALLS,), deepseek_section(fenced=False))

# -- Kimi K2 --------------------------------------------------------------------------

KIMI_SECTION, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
_KIMI_ID = re.compile(r"(?:functions\.)?([^\s:<>]+):\d+")


def kimi_section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
    n = 0
    while True:
        yield from spaces(r)
        tag = yield from one_of(r, (KIMI_CALL, KIMI_SECTION_END))
        if tag != KIMI_CALL:
            return n > 0
        if n:
            r.mark = r.pos - len(KIMI_CALL)
        header, _ = yield from until(r, (KIMI_ARGS,), limit=NAME_LIMIT)
        m = _KIMI_ID.fullmatch((header or "").strip())
        if m is None:
            return n > 0
        got = yield from json_args(r, calls, m.group(1), header.strip())
        if got is None:
            return n > 0
        calls.end()
        n += 1
        if got == "broken":
            yield from skip_to(r, (KIMI_CALL_END, KIMI_SECTION_END))
            continue
        yield from spaces(r)
        yield from literal(r, KIMI_CALL_END)


kimi_k2 = marked((KIMI_SECTION,), kimi_section)

# -- Mistral: [TOOL_CALLS] with a JSON list, or name[ARGS]{...} -------------------------


def call_list(r: Reader, calls: Calls, args_keys: tuple[str, ...] = ("arguments",)) -> Step:
    """`[{call}, {call}]`: whether calls were read (a broken one ends the list)."""
    if not (yield from literal(r, "[")):
        return False
    n = 0
    while True:
        yield from spaces(r)
        if n:
            r.mark = r.pos
        got = yield from call_object(r, calls, args_keys)
        if got != "call":
            return n > 0 or got == "broken"
        calls.end()
        n += 1
        yield from spaces(r)
        if (yield from one_of(r, (",", "]"))) != ",":
            return True


def mistral_section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
    yield from spaces(r)
    if not (yield from wait(r)):
        return False
    if r.buf[r.pos] == "[":
        return (yield from call_list(r, calls))
    name, tag = yield from until(r, ("[ARGS]", "[CALL_ID]"), limit=NAME_LIMIT)
    if not name_ok(name):
        return False
    given = None
    if tag == "[CALL_ID]":
        given, _ = yield from until(r, ("[ARGS]",), limit=NAME_LIMIT)
        if not given or not given.isalnum():
            return False
    got = yield from json_args(r, calls, name, given)
    return got is not None


mistral = marked(("[TOOL_CALLS]",), mistral_section)

# -- Nemotron Nano v2 -------------------------------------------------------------------


def nemotron_section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
    yield from spaces(r)
    if not (yield from call_list(r, calls)):
        return False
    yield from spaces(r)
    if not (yield from literal(r, "</TOOLCALL>")):
        yield from skip_to(r, ("</TOOLCALL>",))
    return True


nemotron_v2 = marked(("<TOOLCALL>",), nemotron_section)

# -- Llama 3.x and 4: the reply is the call's JSON ---------------------------------------


def llama_json(tag: str, tag_end: str | None):
    """Llama's calls: `{"name": f, "parameters": {...}}` objects (`;` or nothing between
    them) that begin the reply, or follow `tag` (to `tag_end`, when the format has one)."""
    keys = ("parameters", "arguments")

    def objects(r: Reader, calls: Calls) -> Step:
        n = 0
        while True:
            if n:
                r.mark = r.pos
            got = yield from call_object(r, calls, keys)
            if got != "call":
                return n > 0 or got == "broken"
            calls.end()
            n += 1
            yield from spaces(r)
            yield from literal(r, ";")
            yield from spaces(r)
            if not (yield from wait(r)) or r.buf[r.pos] != "{":
                return True

    def section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
        if tag_end:  # Llama 4's template: the turn's text between the tags, calls after
            r.mark = None
            yield from spaces(r)
            if (yield from wait(r)) and r.buf[r.pos] != "{":
                yield from until(r, (tag_end,), calls.content)
            r.mark = r.pos
        yield from spaces(r)
        read = yield from objects(r, calls)
        if read and tag_end:
            yield from spaces(r)
            yield from literal(r, tag_end)
        return read

    tagged = marked((tag,), section)

    def parse(r: Reader, calls: Calls, tools: list) -> Step:
        r.mark = r.pos  # the whitespace before a call is dropped with it, else content
        yield from spaces(r)
        read = False
        if (yield from wait(r)) and r.buf[r.pos] == "{":
            read = yield from objects(r, calls)
            calls.end()
        calls.rollback()
        yield from tagged(r, calls, tools, read)

    return parse


llama3_json = llama_json("<|python_tag|>", None)
llama4_json = llama_json("<|python_start|>", "<|python_end|>")
