"""OpenAI tool calling: `tools` into the chat template, the reply's calls out of it.

The request's tools and earlier calls are checked here and go to the tokenizer's chat
template as transformers and mlx-lm pass them (`apply_chat_template(messages,
tools=...)`, a call's arguments as a dict). What the model writes is split into text
and calls by the format its family and template teach, and `tool_choice` "required" or
a named function constrains the reply to calls in that format (a 400 when it is not
known), in `conversation/tool_calls.py` (which `Chat` uses too): `ToolStream`,
`tool_format`, `forced_call_grammar`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..conversation.reply import ReplyStream
from ..conversation.tool_calls import (  # noqa: F401
    ForcedCallError,
    ToolStream,
    forced_call_grammar,
    json_after_reasoning,
    tool_format,
)
from .bodies import loads, openai_param
from .errors import RequestError


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


def message(m: Any, i: int, max_depth: int) -> dict[str, Any]:
    """A request message (protocol.Message) as the chat template takes it (a call's
    `arguments` decoded as the body is: at most `max_depth` deep)."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        calls = []
        for j, c in enumerate(m.tool_calls):
            where = ("messages", i, "tool_calls", j, "function", "arguments")
            args = loads(c.function.arguments or "{}", max_depth, openai_param, where)
            fn = {"name": c.function.name, "arguments": args}
            calls.append({"id": c.id, "type": "function", "function": fn})
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if thought and m.role == "assistant":  # an earlier reply's reasoning, handed back
        out["reasoning_content"] = thought
    return out


def choose(req: Any, tools: list[Tool] | None, choice: str | NamedChoice | None) -> None:
    """Check `tools` and `tool_choice` and set them on the request (protocol.Request)."""
    if choice is not None and not tools:
        raise RequestError("'tool_choice' needs 'tools'", "tool_choice")
    if not tools:
        return
    names = [t.function.name for t in tools]
    seen: set[str] = set()
    for k, name in enumerate(names):  # one pass: a set, not a scan of the earlier names
        if name in seen:
            raise RequestError(f"'tools[{k}].function.name': {name!r} is defined twice", "tools")
        seen.add(name)
    if isinstance(choice, NamedChoice):
        if choice.function.name not in names:
            raise RequestError(
                f"'tool_choice' names the function {choice.function.name!r}, which is not "
                f"in 'tools' ({', '.join(names[:10])}{', ...' if len(names) > 10 else ''})",
                "tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice.function.name}}
    req.tool_choice = choice or "auto"
    if req.tool_choice != "none":  # "none": the model answers in text, as without tools
        req.tools = [t.model_dump(exclude_none=True) for t in tools]


def reply_stream(info: Any, req: Any) -> ReplyStream:
    """The splitter of a request's (protocol.Request) reply into reasoning, content and
    tool calls for the model `info` (app.ModelInfo): a chat's reasoning by the model's
    markers, a text completion's only where its prompt opened the block."""
    fmt = tool_format(info.renderer.tokenizer, info.model_type or None) if req.tools else None
    markers = info.markers if req.chat or req.reasoning_open else None
    return ReplyStream(markers, req.reasoning_open, fmt, req.tools)
