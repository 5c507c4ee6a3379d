"""Formats that write each parameter in tags of its own: the parsers.

    qwen3_coder   <tool_call>\\n<function=f>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n
                  </tool_call>  (Qwen3-Coder, Qwen3.5, Qwen3.6, Nemotron 3 Nano, Step-3.5)
    glm45         <tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>
    glm47         <tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>  (GLM-4.7, 5)
    minimax_m2    <minimax:tool_call>\\n<invoke name="f">\\n<parameter name="k">v</parameter>\\n
                  </invoke>\\n</minimax:tool_call>
    deepseek_v3_2 <｜DSML｜function_calls>\\n<｜DSML｜invoke name="f">\\n<｜DSML｜parameter
                  name="k" string="true">v</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n
                  </｜DSML｜function_calls>
    kimi_k3       <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument
                  key="k" type="string"<|sep|>v<|close|>argument<|sep|><|close|>call<|sep|>
                  <|close|>tools<|sep|>  (or the arguments as <|open|>json ...<|close|>json<|sep|>)

A call's arguments are streamed as JSON text: `{` once its name is read, then each
parameter (`"k": value`, typed by the function's schema: `values.py`) as it completes,
then `}`.
"""

from __future__ import annotations

import json
import re

from .base import Calls, marked, name_ok, skip_to
from .json_text import json_value
from .reader import Reader, Step, literal, one_of, spaces, until
from .values import properties, typed

NAME_LIMIT = 256
_ATTR = re.compile(r'(\w+)="([^"]*)"')


class Params:
    """A call's parameters streamed as one JSON object (see the module's docstring)."""

    def __init__(self, calls: Calls, tools: list, name: str, given_id: str | None = None):
        self.calls, self.props, self.n = calls, properties(tools, name), 0
        calls.start(name, given_id)

    def add(self, key: str, text: str, as_text: bool | None = None) -> None:
        """Parameter `key` written as `text` (typed: `values.typed`)."""
        self.put(key, typed(text, self.props.get(key), as_text))

    def put(self, key: str, value: object) -> None:
        """Parameter `key`'s value."""
        self.raw(json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False))

    def raw(self, piece: str) -> None:
        self.calls.args(("{" if self.n == 0 else ", ") + piece)
        self.n += 1

    def close(self) -> None:
        self.calls.args("{}" if self.n == 0 else "}")
        self.calls.end()


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _one_newline(text: str) -> str:
    """A value without the one newline each side that the format puts around it."""
    return text.removeprefix("\n").removesuffix("\n")


# -- Qwen3-Coder and its successors ---------------------------------------------------


def qwen3_coder_section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
    if start == "<tool_call>":
        yield from spaces(r)
        if not (yield from literal(r, "<function=")):
            return False
    name, _ = yield from until(r, (">",), limit=NAME_LIMIT)
    name = (name or "").strip()
    if not name_ok(name):
        return False
    params = Params(calls, tools, name)
    closed = False
    while True:
        yield from spaces(r)
        tag = yield from one_of(r, ("<parameter=", "</function>"))
        if tag != "<parameter=":
            closed = tag is not None
            break
        key, _ = yield from until(r, (">",), limit=NAME_LIMIT)
        if not key or not key.strip():
            break
        value, end = yield from until(r, ("</parameter>", "</function>"))
        params.add(key.strip(), _one_newline(value))
        if end == "</function>":  # a model that left the parameter open
            closed = True
            break
    params.close()
    if not closed:
        yield from skip_to(r, ("</tool_call>",))
        return True
    yield from spaces(r)
    yield from literal(r, "</tool_call>")
    return True


qwen3_coder = marked(("<tool_call>", "<function="), qwen3_coder_section)

# -- GLM-4.5 to 5 ---------------------------------------------------------------------


def glm_section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
    name, tag = yield from until(r, ("<arg_key>", "</tool_call>", "\n"), limit=NAME_LIMIT)
    name = (name or "").strip()
    if not name_ok(name):
        return False
    params = Params(calls, tools, name)
    while tag != "</tool_call>":
        if tag != "<arg_key>":
            yield from spaces(r)
            tag = yield from one_of(r, ("<arg_key>", "</tool_call>"))
            if tag != "<arg_key>":
                break
        key, _ = yield from until(r, ("</arg_key>",), limit=NAME_LIMIT)
        yield from spaces(r)
        if not key or not (yield from literal(r, "<arg_value>")):
            tag = None
            break
        value, _ = yield from until(r, ("</arg_value>",))
        params.add(key.strip(), value.strip())
        tag = None
    params.close()
    if tag is None:
        yield from skip_to(r, ("</tool_call>",))
    return True


glm = marked(("<tool_call>",), glm_section)

# -- MiniMax-M2 and DeepSeek V3.2's DSML: <invoke name=...> blocks ---------------------


def invoke_section(prefix: str, section_end: str, strip: bool):
    """Sections of `<{prefix}invoke name="f">` blocks of `<{prefix}parameter name="k"
    ...>v</{prefix}parameter>` (DSML's say `string="true"` of a string), to
    `section_end`; values stripped of whitespace when `strip`."""
    invoke, invoke_end = f"<{prefix}invoke name=", f"</{prefix}invoke>"
    param, param_end = f"<{prefix}parameter name=", f"</{prefix}parameter>"

    def section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
        n = 0
        while True:
            yield from spaces(r)
            tag = yield from one_of(r, (invoke, section_end))
            if tag != invoke:
                return n > 0
            if n:
                r.mark = r.pos - len(invoke)
            name, _ = yield from until(r, (">",), limit=NAME_LIMIT)
            name = _unquote(name or "")
            if not name_ok(name):
                return n > 0
            params, n, tag = Params(calls, tools, name), n + 1, None
            while True:
                yield from spaces(r)
                tag = yield from one_of(r, (param, invoke_end))
                if tag != param:
                    break
                head, _ = yield from until(r, (">",), limit=NAME_LIMIT)
                value, _ = yield from until(r, (param_end,))
                attrs = dict(_ATTR.findall(f"name={head}")) if head else {}
                key = attrs.get("name") or _unquote((head or "").split()[0] if head else "")
                if not key:
                    tag = None
                    break
                string = attrs.get("string")
                as_text = None if string is None else string == "true"
                params.add(key, value.strip() if strip else value, as_text)
            params.close()
            if tag is None:
                yield from skip_to(r, (invoke_end, section_end))

    return section


MINIMAX, MINIMAX_END = "<minimax:tool_call>", "</minimax:tool_call>"
minimax_m2 = marked((MINIMAX,), invoke_section("", MINIMAX_END, strip=True))
DSML = "｜DSML｜"
DSML_CALLS, DSML_CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
deepseek_v3_2 = marked((DSML_CALLS,), invoke_section(DSML, DSML_CALLS_END, strip=False))

# -- Kimi K3's XTML -------------------------------------------------------------------

K3_TOOLS, K3_TOOLS_END = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
K3_RESPONSE = ("<|open|>response<|sep|>", "<|close|>response<|sep|>")


def _attrs(text: str) -> dict[str, str]:
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(text)}


def kimi_k3_section(r: Reader, calls: Calls, tools: list, start: str) -> Step:
    if start in K3_RESPONSE:  # the answer's own tags: not content
        r.mark = None
        return False
    n = 0
    while True:
        yield from spaces(r)
        tag = yield from one_of(r, ("<|open|>call", K3_TOOLS_END))
        if tag != "<|open|>call":
            return n > 0
        if n:
            r.mark = r.pos - len(tag)
        head, _ = yield from until(r, ("<|sep|>",), limit=NAME_LIMIT)
        name = _attrs(head or "").get("tool")
        if not name_ok(name):
            return n > 0
        n += 1
        broken = yield from _k3_arguments(r, calls, tools, name)
        if broken:
            yield from skip_to(r, ("<|close|>call<|sep|>", K3_TOOLS_END))


def _k3_arguments(r: Reader, calls: Calls, tools: list, name: str) -> Step:
    """A K3 call's arguments, to its closing tag (read): whether it broke off."""
    close = "<|close|>call<|sep|>"
    params = None
    while True:
        yield from spaces(r)
        tag = yield from one_of(r, ("<|open|>argument", "<|open|>json", close))
        if tag == "<|open|>json" and params is None:  # the arguments as one JSON object
            yield from until(r, ("<|sep|>",), limit=NAME_LIMIT)
            calls.start(name)
            raw = yield from json_value(r, calls.args, "{")
            calls.end()
            if raw is None or not (yield from literal(r, "<|close|>json<|sep|>")):
                return True
            yield from spaces(r)
            return not (yield from literal(r, close))
        if params is None:
            params = Params(calls, tools, name)
        if tag != "<|open|>argument":
            params.close()
            return tag != close
        head, _ = yield from until(r, ("<|sep|>",), limit=NAME_LIMIT)
        attrs = _attrs(head or "")
        value, _ = yield from until(r, ("<|close|>argument<|sep|>",))
        if "key" not in attrs:
            params.close()
            return True
        params.add(attrs["key"], value, attrs.get("type", "string") == "string")


kimi_k3 = marked((K3_TOOLS, *K3_RESPONSE), kimi_k3_section)
