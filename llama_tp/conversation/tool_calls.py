"""A reply's tool calls, in the format the model's chat template teaches.

`tool_format` finds it (mlx-lm's inference from the template: Hermes `<tool_call>` JSON
of Qwen2.5/Qwen3, Mistral's `[TOOL_CALLS]` and the others mlx-lm has a parser for; then
Llama 3.x's bare JSON object `{"name": ..., "parameters": ...}`, which mlx-lm has no
parser for). `ToolStream` splits a reply into text and calls as it streams, holding back
what may be a call, so a reader sees either text or a call. `forced_call_grammar` is the
grammar (llguidance) of one call in that format, for a reply that must call a tool
(`tool_choice` "required" or a named function), its arguments following the function's
`parameters` schema. The server (`server/tools.py`) and `Chat` both use them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LLAMA3_START = "<|python_tag|>"


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes calls: between `start` and `end` ("" for Llama 3.x's bare JSON,
    which starts the reply; "" end: to the end of the reply), read by `parse`."""

    kind: str
    start: str
    end: str
    parse: Callable[[str, Any], Any]


def tool_format(tokenizer: Any) -> ToolFormat | None:
    """The format of `tokenizer`'s template (mlx-lm's inference, then Llama 3.x's)."""
    if getattr(tokenizer, "has_tool_calling", False):
        kind = getattr(tokenizer.tool_parser, "__module__", "").rsplit(".", 1)[-1]
        return ToolFormat(kind, tokenizer.tool_call_start, tokenizer.tool_call_end or "",
                          tokenizer.tool_parser)  # fmt: skip
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "<|start_header_id|>" in template and "tools" in template:
        return ToolFormat("llama3_json", "", "", _parse_llama3)
    return None


def _parse_llama3(text: str, tools: Any = None) -> dict:
    """Llama 3.x's JSON call: {"name": ..., "parameters": {...}} (after <|python_tag|>)."""
    call = json.loads(text.strip().removeprefix(LLAMA3_START))
    args = call.get("parameters", call.get("arguments")) if isinstance(call, dict) else None
    if not isinstance(call.get("name"), str) or not isinstance(args, dict):
        raise ValueError(f"not a tool call: {text[:80]!r}")
    return {"name": call["name"], "arguments": args}


class ToolStream:
    """A reply's text, split into content and tool calls as it streams.

    `feed(text)` returns the content that can be sent now (text that may be the start
    of a call is held back); `finish()` returns the rest of the content and the calls
    (OpenAI's `tool_calls` entries). A call that does not parse stays content. A call
    the parser gives no id gets `prefix` and its number ("call_0"), or a random one.
    """

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None, prefix: str | None = None):
        self.fmt, self.tools, self.prefix = fmt, tools, prefix
        self.held, self.calling, self.seen = "", False, False

    def feed(self, text: str) -> str:
        self.held += text
        if self.calling:
            return ""
        if not self.fmt.start:  # Llama 3.x: a call is the whole reply
            head = self.held.lstrip()
            if not self.seen:
                if head.startswith(("{", LLAMA3_START)):
                    self.calling = True
                    return ""
                if head == "" or LLAMA3_START.startswith(head):
                    return ""
                self.seen = True  # text: no call in this reply
            out, self.held = self.held, ""
            return out
        at = self.held.find(self.fmt.start)
        if at >= 0:
            self.calling = True
            out, self.held = self.held[:at], self.held[at:]
            return out
        keep = _partial(self.held, self.fmt.start)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        text, self.held = self.held, ""
        if not self.calling:
            return text, []
        try:
            calls = self._calls(text)
        except Exception:  # a parser's error, or JSON nested past the recursion limit
            return text, []
        ids = [f"{self.prefix}{k}" if self.prefix else None for k in range(len(calls))]
        return "", [_openai(c, i) for c, i in zip(calls, ids, strict=True)]

    def _calls(self, text: str) -> list[dict]:
        if not self.fmt.start:
            return [self.fmt.parse(text, self.tools)]
        calls = []
        for part in text.split(self.fmt.start)[1:]:
            body = part.split(self.fmt.end)[0] if self.fmt.end else part
            parsed = self.fmt.parse(body, self.tools)
            calls += parsed if isinstance(parsed, list) else [parsed]
        if not calls:
            raise ValueError("no call")
        return calls


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _openai(call: dict, given: str | None) -> dict:
    args = call["arguments"]
    return {
        "id": call.get("id") or given or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }


# -- tool_choice "required" / a named function: one call, by grammar -----------------

_SPELLING = {  # (before the call's JSON, the arguments' key, after it)
    "json_tools": ("<tool_call>\n", "arguments", "\n</tool_call>"),
    "mistral": ("[TOOL_CALLS][", "arguments", "]"),
    "llama3_json": ("", "parameters", ""),
}


def forced_call_grammar(tools: list[dict] | None, choice: Any, tokenizer: Any) -> str | None:
    """The grammar of one call of `tools` (OpenAI's definitions) in the model's format,
    for `choice` (OpenAI's tool_choice) "required" or a named function (None: "auto",
    "none", or a format this cannot spell)."""
    from ..engine.grammar import lark_grammar

    if choice in ("auto", "none") or not tools:
        return None
    fmt = tool_format(tokenizer)
    if fmt is None or fmt.kind not in _SPELLING:
        return None
    before, key, after = _SPELLING[fmt.kind]
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        fns = [f for f in fns if f["name"] == choice["function"]["name"]]
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                key: f.get("parameters") or {"type": "object"},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in fns
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "key_separator": ": ",
                                       "item_separator": ", "}}  # fmt: skip
    parts = [_literal(tokenizer, before), "call", _literal(tokenizer, after)]
    lark = f"start: {' '.join(p for p in parts if p)}\ncall: %json {json.dumps(schema)}\n"
    return lark_grammar(lark)


def _literal(tokenizer: Any, text: str) -> str:
    """`text` in llguidance's Lark: a special token by its id, else a string."""
    if not text:
        return ""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    if len(ids) == 1 and ids[0] in decoder and decoder[ids[0]].special:
        return f"<[{ids[0]}]>"
    return json.dumps(text)
