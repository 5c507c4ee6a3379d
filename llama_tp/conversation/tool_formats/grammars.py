"""The grammar of a forced call in each format (llguidance's Lark, `lark.py`'s pieces).

Each function takes a `Spell`, the functions a call may name (OpenAI's `function`
objects) and whether several calls may follow one another (`parallel_tool_calls`), and
returns the Lark expression of the reply's call(s), spelled as the release's template
writes a call (so the model writes what it was trained on), the arguments following
each function's `parameters`: JSON values by `%json`, values written as text (XML-like
formats) by their schema (`values.py`: strings as text, enumerations as their choices,
the others as JSON).
"""

from __future__ import annotations

import json
from typing import Any

from .lark import Spell, choice, ordered, repeat
from .values import kind_of, text_only

INDEX = r"/[0-9]{1,3}/"  # a call's number (a model left free would write digits on)


def _params(fn: dict) -> dict:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def _props(fn: dict) -> list[tuple[str, Any, bool]]:
    """(name, schema, required) of each of `fn`'s parameters, in the schema's order."""
    params = _params(fn)
    required = set(params.get("required") or ())
    return [(k, v, k in required) for k, v in (params.get("properties") or {}).items()]


def text_value(sp: Spell, schema: Any, end: str, lead: str = "") -> str:
    """A parameter's value written as text, then `end`: a string as it is (one of its
    enumeration or its constant, when it has them), anything else as JSON; `lead`: what
    the template writes between a value it knows and `end` (free text may end in it)."""
    if text_only(schema):
        options = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
        if options:
            return f"{choice([sp(o) for o in options])} {sp(lead + end)}"
        return sp.text_until(end, schema.get("minLength", 0), schema.get("maxLength"))
    return f"{sp.json(schema if isinstance(schema, dict) else {})} {sp(lead + end)}"


# -- JSON arguments ---------------------------------------------------------------------


def json_object(
    sp: Spell, fns: list[dict], key: str = "arguments", extra: dict | None = None
) -> str:
    """`{"name": f, key: {...}}` for any of `fns` (and the optional `extra` members)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, key: _params(f), **(extra or {})},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in fns
    ]
    return sp.json(options[0] if len(options) == 1 else {"anyOf": options})


def named(sp: Spell, fns: list[dict], before: str, after: str, mid: str = "") -> str:
    """Calls that write the name in text: `before` (with {name}) [mid] arguments `after`."""
    return choice(
        [f"{sp(before.format(name=f['name']))} {mid}{sp.json(_params(f))} {sp(after)}" for f in fns]
    )


def hermes(sp: Spell, fns: list[dict], parallel: bool) -> str:
    call = f"{sp('<tool_call>' + chr(10))} {json_object(sp, fns)} {sp(chr(10) + '</tool_call>')}"
    return repeat(sp, call, "\n", parallel)


DS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>")


def deepseek_v3(sp: Spell, fns: list[dict], parallel: bool) -> str:
    head = DS[2] + "function" + DS[3] + "{name}\n```json\n"
    call = named(sp, fns, head, "\n```<｜tool▁call▁end｜>")
    return f"{sp(DS[0])} {repeat(sp, call, chr(10), parallel)} {sp(DS[1])}"


def deepseek_v3_1(sp: Spell, fns: list[dict], parallel: bool) -> str:
    call = named(sp, fns, DS[2] + "{name}" + DS[3], "<｜tool▁call▁end｜>")
    return f"{sp(DS[0])} {repeat(sp, call, '', parallel)} {sp(DS[1])}"


def kimi_k2(sp: Spell, fns: list[dict], parallel: bool) -> str:
    call = choice(
        [
            f"{sp('<|tool_call_begin|>functions.' + f['name'] + ':')} {INDEX} "
            f"{sp('<|tool_call_argument_begin|>')} {sp.json(_params(f))} {sp('<|tool_call_end|>')}"
            for f in fns
        ]
    )
    section = repeat(sp, call, "", parallel)
    return f"{sp('<|tool_calls_section_begin|>')} {section} {sp('<|tool_calls_section_end|>')}"


MISTRAL_ID = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}  # as the templates insist


def mistral_json(sp: Spell, fns: list[dict], parallel: bool) -> str:
    call = json_object(sp, fns, extra={"id": MISTRAL_ID})  # Nemo's template writes ids
    return f"{sp('[TOOL_CALLS][')} {repeat(sp, call, ', ', parallel)} {sp(']')}"


def mistral_args(sp: Spell, fns: list[dict], parallel: bool) -> str:
    # Mistral-Small-3.2's template writes the call's id between its name and arguments
    given = f"({sp('[CALL_ID]')} /[A-Za-z0-9]{{9}}/)? " if "[CALL_ID]" in sp.tokens else ""
    return repeat(
        sp, named(sp, fns, "[TOOL_CALLS]{name}", "", given + sp("[ARGS]") + " "), "", parallel
    )


def nemotron_v2(sp: Spell, fns: list[dict], parallel: bool) -> str:
    calls = repeat(sp, json_object(sp, fns), ", ", parallel)
    return f"{sp('<TOOLCALL>[')} {calls} {sp(']</TOOLCALL>')}"


def llama3_json(sp: Spell, fns: list[dict], parallel: bool) -> str:
    return json_object(sp, fns, "parameters")  # Llama 3.x templates take one call a turn


def llama4_json(sp: Spell, fns: list[dict], parallel: bool) -> str:
    # the release's template writes the turn's text between these tags, then the calls
    tags = f"({sp('<|python_start|>')} {sp('<|python_end|>')})? "
    return tags + repeat(sp, json_object(sp, fns, "parameters"), "", parallel)


def harmony(sp: Spell, fns: list[dict], parallel: bool) -> str:
    opens, reopens = sp("<|channel|>analysis<|message|>"), sp("<|start|>assistant")
    analysis = sp.rule(f"{opens} {sp.text_until('<|end|>')} {reopens}")
    # the recipient in the channel's header (as gpt-oss writes it) or before it (as the
    # template renders a call), llama.cpp's two
    call = choice(
        [
            named(
                sp,
                fns,
                "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
                "",
            ),
            named(sp, fns, " to=functions.{name}<|channel|>commentary json<|message|>", ""),
        ]
    )
    return f"{analysis}? {call}"  # one call: <|call|> ends the reply


# -- parameters in tags of their own ---------------------------------------------------


def _xml(sp: Spell, fn: dict, head: str, tail: str, tags: tuple[str, str, str, str]) -> str:
    """`head` ({name}), each parameter as `key_open` ({key}) value `key_close` `gap`
    (`tags`, the value's `lead` before the close), then `tail`."""
    key_open, lead, key_close, gap = tags
    items = [
        (f"{sp(key_open.format(key=k))} {text_value(sp, v, key_close, lead)} {sp(gap)}", required)
        for k, v, required in _props(fn)
    ]
    params = ordered(sp, items, "")
    return f"{sp(head.format(name=fn['name']))} {params} {sp(tail)}"


def qwen3_coder(sp: Spell, fns: list[dict], parallel: bool) -> str:
    tags = ("<parameter={key}>\n", "\n", "</parameter>", "\n")
    head, tail = "<tool_call>\n<function={name}>\n", "</function>\n</tool_call>"
    call = choice([_xml(sp, f, head, tail, tags) for f in fns])
    return repeat(sp, call, "\n", parallel, optional=True)  # Step-3.5's template: none


def glm(newlines: bool):
    nl = "\n" if newlines else ""
    tags = ("<arg_key>{key}</arg_key>" + nl + "<arg_value>", "", "</arg_value>", nl)

    def grammar(sp: Spell, fns: list[dict], parallel: bool) -> str:
        call = choice([_xml(sp, f, "<tool_call>{name}" + nl, "</tool_call>", tags) for f in fns])
        return repeat(sp, call, nl, parallel)

    return grammar


def minimax_m2(sp: Spell, fns: list[dict], parallel: bool) -> str:
    tags = ('<parameter name="{key}">', "", "</parameter>", "\n")
    invoke = choice([_xml(sp, f, '<invoke name="{name}">\n', "</invoke>\n", tags) for f in fns])
    calls = repeat(sp, invoke, "", parallel)
    return f"{sp('<minimax:tool_call>' + chr(10))} {calls} {sp('</minimax:tool_call>')}"


def deepseek_v3_2(sp: Spell, fns: list[dict], parallel: bool) -> str:
    d = "｜DSML｜"

    def param(k: str, v: Any) -> str:
        text = "true" if text_only(v) else "false"
        head = sp(f'<{d}parameter name="{json.dumps(k)[1:-1]}" string="{text}">')
        return f"{head} {text_value(sp, v, f'</{d}parameter>')} {sp(chr(10))}"

    invokes = []
    for f in fns:
        params = ordered(sp, [(param(k, v), req) for k, v, req in _props(f)], "")
        invokes.append(
            f"{sp(f'<{d}invoke name=' + json.dumps(f['name']) + '>' + chr(10))} {params} "
            f"{sp(f'</{d}invoke>' + chr(10))}"
        )
    calls = repeat(sp, choice(invokes), "", parallel)
    return f"{sp(f'<{d}function_calls>' + chr(10))} {calls} {sp(f'</{d}function_calls>')}"


def kimi_k3(sp: Spell, fns: list[dict], parallel: bool) -> str:
    calls = []
    for f in fns:
        items = []
        for k, v, req in _props(f):
            head = f"<|open|>argument key={json.dumps(k)} type={json.dumps(kind_of(v))}<|sep|>"
            items.append((f"{sp(head)} {text_value(sp, v, '<|close|>argument<|sep|>')}", req))
        head = sp(f'<|open|>call tool={json.dumps(f["name"])} index="')
        calls.append(
            f"{head} {INDEX} {sp(chr(34) + '<|sep|>')} {ordered(sp, items, '')} "
            f"{sp('<|close|>call<|sep|>')}"
        )
    section = repeat(sp, choice(calls), "", parallel)
    answer = f"({sp('<|open|>response<|sep|>')} {sp('<|close|>response<|sep|>')})? "  # empty
    return f"{answer}{sp('<|open|>tools<|sep|>')} {section} {sp('<|close|>tools<|sep|>')}"


# -- Gemma's call:f{key:value} ----------------------------------------------------------

_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"


def gemma_value(sp: Spell, schema: Any, q: str, depth: int = 0) -> str:
    """A value following `schema` as Gemma writes it (strings between `q`)."""
    s = schema if isinstance(schema, dict) else {}
    if text_only(s):
        options = s.get("enum") or ([s["const"]] if "const" in s else None)
        if options:
            return choice([sp(q + o + q) for o in options])
        return f"{sp(q)} {sp.text_until(q, s.get('minLength', 0), s.get('maxLength'))}"
    kind = s.get("type")
    if kind in ("integer", "number", "boolean", "null") or (
        ("enum" in s or "const" in s) and kind is None
    ):
        return sp.json(s)  # JSON writes these as Gemma does
    if depth > 8:
        kind = None
    if kind == "array" and isinstance(s.get("items"), dict):
        item = sp.rule(gemma_value(sp, s["items"], q, depth + 1))
        return f'"[" ({item} ("," {item})*)? "]"'
    if kind == "object" and isinstance(s.get("properties"), dict):
        return f'"{{" {gemma_object(sp, s, q, depth + 1)} "}}"'
    return _any_value(sp, q)


def gemma_object(sp: Spell, schema: dict, q: str, depth: int = 0) -> str:
    """An object's members (keys bare, sorted as the template writes them)."""
    required = set(schema.get("required") or ())
    props = sorted((schema.get("properties") or {}).items())
    items = [(f"{sp(k + ':')} {gemma_value(sp, v, q, depth)}", k in required) for k, v in props]
    return ordered(sp, items, ",")


def _any_value(sp: Spell, q: str) -> str:
    """Any value (no schema to follow)."""
    name = f"anyvalue{sum(map(ord, q))}"
    if not any(r.startswith(name + ":") for r in sp.rules):
        text = f"{sp(q)} {sp.text_until(q)}"
        key = r"/[A-Za-z_][A-Za-z0-9_]*/"
        member = f'{key} ":" {name}'
        sp.rules.append(
            f'{name}: {text} | {_NUMBER} | "true" | "false" | "null" '
            f'| "{{" ({member} ("," {member})*)? "}}" | "[" ({name} ("," {name})*)? "]"'
        )
    return name


def gemma(q: str, start: str, end: str):
    def grammar(sp: Spell, fns: list[dict], parallel: bool) -> str:
        call = choice(
            [
                f"{sp(start + 'call:' + f['name'] + '{')} {gemma_object(sp, _params(f), q)} "
                f"{sp('}' + end)}"
                for f in fns
            ]
        )
        return repeat(sp, call, "", parallel)

    return grammar
