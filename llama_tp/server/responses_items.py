"""The Responses API's input items as OpenAI chat messages (server/responses_request.py
reads the rest of a body).

`messages(items, first)` turns a conversation's items into the chat route's messages:
messages (roles user, system, developer, assistant; content a string or text parts),
`function_call` items (an assistant's `tool_calls`, the `call_id` as the call's id),
`function_call_output` items ("tool" messages, with the function's name) and `reasoning`
handed back (its raw content, else its summary, as the assistant message's
`reasoning_content`). Consecutive assistant-side items become one assistant message, as
the chat templates expect a turn; a developer message is a system one (few templates
know the role). An item is checked by its type, and a bad one named as OpenAI names a
field ("input[2].call_id"); images, files and built-in tools' items are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .bodies import loads, openai_param, validate
from .errors import RequestError
from .limits import Limits

JOIN = "\n\n"  # between the texts of merged messages


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # e.g. id, status, annotations


class TextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Body):
    type: Literal["refusal"]
    refusal: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str  # JSON text


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[dict[str, Any]]


class SummaryPart(_Body):
    type: Literal["summary_text"]
    text: str


class ReasoningPart(_Body):
    type: Literal["reasoning_text", "text"]
    text: str


class ReasoningItem(_Body):
    """Reasoning handed back: its text (the raw content, else the summary) becomes the
    assistant message's `reasoning_content`; `encrypted_content` is ignored."""

    type: Literal["reasoning"]
    summary: list[SummaryPart] = []
    content: list[ReasoningPart] | None = None


ITEMS: dict[str, type[_Body]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


FIELDS = {
    n
    for m in (*ITEMS.values(), TextPart, RefusalPart, SummaryPart, ReasoningPart)
    for n in m.model_fields
}


def named(prefix: tuple = (), fields: set[str] | None = None):
    """pydantic's errors as a RequestError naming the field as OpenAI does, under
    `prefix` (a place: ("input", 2)); union members' tags are left out of the name, which
    holds the `fields` of the models validated (default: the items')."""

    def name(errors: list[dict]) -> RequestError:
        e = max(errors, key=lambda x: len(x["loc"]))  # of a union's, the deepest says most
        if e["type"] == "model_attributes_type" and not prefix:
            return RequestError("the body is not a JSON object", None)
        loc = (*prefix, *(p for p in e["loc"] if isinstance(p, int) or p in (fields or FIELDS)))
        param = openai_param(loc)
        message = f"'{param}': {e['msg'][:1].lower()}{e['msg'][1:]}" if param else e["msg"]
        if "input" in e and e["type"] != "missing":
            message += f", got {e['input']!r}"[:200]
        return RequestError(message, param or None)

    return name


def refuse(loc: tuple, why: str) -> RequestError:
    where = openai_param(loc)
    return RequestError(f"'{where}': {why}", where)


def messages(items: tuple[dict[str, Any], ...], first: int) -> list[dict[str, Any]]:
    """The conversation's items as chat messages (`first`: the index of this request's
    first input item; those before it come from the store)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # the function each call_id called
    for i, raw in enumerate(items):
        at = ("input", i - first) if i >= first else ("previous_response_id",)
        item = _item(raw, at)
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if isinstance(item, MessageItem):
            text = _text(item.content, (*at, "content"), item.role == "assistant")
            if item.role != "assistant":
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": text})
            elif last is not None and not last.get("tool_calls"):
                last["content"] = JOIN.join(t for t in (last["content"], text) if t) or None
            else:
                out.append({"role": "assistant", "content": text})
        elif isinstance(item, FunctionCallItem):
            loads(item.arguments or "{}", Limits.json_depth, openai_param, (*at, "arguments"))
            names[item.call_id] = item.name
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if last is None:
                out.append(last := {"role": "assistant", "content": None})
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:
                raise refuse(
                    (*at, "call_id"), f"no function_call before it has call_id {item.call_id!r}"
                )
            text = _text(item.output, (*at, "output"), False)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.call_id,
                    "content": text,
                    "name": names[item.call_id],
                }
            )
        else:
            text = JOIN.join(p.text for p in (item.content or item.summary))
            if not text:
                continue
            if last is None or last["content"] or last.get("tool_calls"):
                out.append(last := {"role": "assistant", "content": None})
            last["reasoning_content"] = JOIN.join(
                t for t in (last.get("reasoning_content"), text) if t
            )
    return out


def _item(raw: Any, at: tuple) -> _Body:
    """One input item by its type (a message may leave its type out)."""
    kind = raw.get("type", "message" if "role" in raw else None) if isinstance(raw, dict) else None
    model = ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        if not isinstance(raw, dict):
            raise refuse(at, f"an item is a JSON object, got {type(raw).__name__}")
        known = ", ".join(repr(k) for k in ITEMS)
        raise refuse(
            (*at, "type"),
            f"this server reads items of types {known}; got {kind!r}"
            + (" (send the item itself)" if kind == "item_reference" else ""),
        )
    return validate(model, raw, named(at))


def _text(content: str | list[dict[str, Any]], at: tuple, assistant: bool) -> str:
    """A message's (or a function call output's) text: its text parts, joined."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            texts.append(validate(TextPart, part, named((*at, j))).text)
        elif kind == "refusal" and assistant:
            texts.append(validate(RefusalPart, part, named((*at, j))).refusal)
        else:
            why = (
                "this server's model reads text only"
                if kind in ("input_image", "input_file", "input_audio")
                else "text parts are 'input_text' and 'output_text'"
            )
            raise refuse((*at, j, "type"), f"{why}; got {kind!r}")
    return "".join(texts)


def merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system messages that open the conversation as one (templates read one)."""
    n = next((k for k, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if n < 2:
        return messages
    system = JOIN.join(m["content"] for m in messages[:n] if m["content"])
    return [{"role": "system", "content": system}, *messages[n:]]
