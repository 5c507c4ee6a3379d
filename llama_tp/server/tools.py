"""OpenAI tool calling: `tools` into the chat template, the reply's calls out of it.

The tools and earlier calls go to the tokenizer's chat template as transformers
and mlx-lm pass them (`apply_chat_template(messages, tools=...)`, a call's
arguments as a dict); what the model writes is split into text and calls by the
format its template teaches (`ToolFormat`): mlx-lm's parser for the formats it
knows (Hermes `<tool_call>` JSON of Qwen2.5/Qwen3, Mistral's `[TOOL_CALLS]`,
and the others mlx-lm infers from the template), and Llama 3.x's bare JSON object
(`{"name": ..., "parameters": ...}`), which mlx-lm has no parser for. `ToolStream`
holds back what may be a call while the reply streams, so a client sees either
text or a call. `tool_choice` "required" or a named function constrains the reply
to one call in the model's format (`forced_call_grammar`, llguidance), whose
arguments follow the function's `parameters` schema.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import RequestError

LLAMA3_START = "<|python_tag|>"


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class Function(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: Function


class ChoiceName(_Body):
    name: str


class NamedChoice(_Body):
    type: Literal["function"]
    function: ChoiceName


def message(m: Any, i: int) -> dict[str, Any]:
    """A request message (protocol.Message) as the chat template takes it."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            try:
                args = json.loads(c.function.arguments or "{}")
            except json.JSONDecodeError as e:
                param = f"messages[{i}].tool_calls[{j}].function.arguments"
                raise RequestError(f"'{param}' is not JSON: {e}", param) from None
            fn = {"name": c.function.name, "arguments": args}
            calls.append({"id": c.id, "type": "function", "function": fn})
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def choose(req: Any, tools: list[Tool] | None, choice: str | NamedChoice | None) -> None:
    """Check `tools` and `tool_choice` and set them on the request (protocol.Request)."""
    if choice is not None and not tools:
        raise RequestError("'tool_choice' needs 'tools'", "tool_choice")
    if not tools:
        return
    names = [t.function.name for t in tools]
    for k, name in enumerate(names):
        if name in names[:k]:
            raise RequestError(f"'tools[{k}].function.name': {name!r} is defined twice", "tools")
    if isinstance(choice, NamedChoice):
        if choice.function.name not in names:
            raise RequestError(
                f"'tool_choice' names the function {choice.function.name!r}, which is not "
                f"in 'tools' ({', '.join(names)})",
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice.function.name}}
    req.tool_choice = choice or "auto"
    if req.tool_choice != "none":  # "none": the model answers in text, as without tools
        req.tools = [t.model_dump(exclude_none=True) for t in tools]


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
    (OpenAI's `tool_calls` entries). A call that does not parse stays content.
    """

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None):
        self.fmt, self.tools = fmt, tools
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
        except (ValueError, AttributeError):  # json.JSONDecodeError is a ValueError
            return text, []
        return "", [_openai(c) for c in calls]

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


def _openai(call: dict) -> dict:
    args = call["arguments"]
    return {
        "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
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


def forced_call_grammar(req: Any, tokenizer: Any) -> str | None:
    """The grammar of one call in the model's format, for `tool_choice` "required" or a
    named function (None: "auto", "none", or a format this cannot spell)."""
    from ..engine.grammar import lark_grammar

    choice = req.tool_choice
    if choice in ("auto", "none") or not req.tools:
        return None
    fmt = tool_format(tokenizer)
    if fmt is None or fmt.kind not in _SPELLING:
        return None
    before, key, after = _SPELLING[fmt.kind]
    fns = [t["function"] for t in req.tools]
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
