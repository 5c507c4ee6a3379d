"""Anthropic's Messages API (POST /v1/messages) as a thin translation onto the OpenAI chat
route: the same engine request, the same text.

`openai_body` turns a Messages body into an OpenAI chat body (`system` -> a system message,
an assistant's tool_use blocks -> its `tool_calls`, tool_result blocks -> role "tool"
messages, `tools` -> functions, `stop_sequences` -> `stop`, a final assistant message ->
vLLM's `continue_final_message`: the reply continues that "prefill" and holds only what
follows it); the routes answer with the
chat completion turned back into a Message or its stream chunks into Anthropic's events
(`server/anthropic_answers.py`). A bad body is a 400 in Anthropic's error shape naming
the field as Anthropic does ("messages.0.content.1.type").
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations.

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .anthropic_answers import Events, message
from .bodies import dotted, dotted_place, validate
from .preparation import Api
from .protocol import MAX_STOPS, RequestError
from .translation import OpenAIRoutes, chunks

JOIN = "\n\n"  # between a message's text blocks (and a system prompt's)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # e.g. cache_control, metadata


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool | None = None


class ThinkingBlock(_Body):
    """An earlier turn's reasoning, handed back by the client: the assistant message's
    reasoning, which the chat template renders as its release does (most drop it)."""

    type: Literal["thinking"]
    thinking: str = ""


class RedactedThinkingBlock(_Body):
    """Reasoning the client never saw (its text is not ours to read back): left out."""

    type: Literal["redacted_thinking"]


BLOCKS: dict[str, type[_Body]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
}


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[dict[str, Any]], Field(min_length=1)]


class Tool(_Body):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    """Extended thinking: "enabled" with a budget (the think block closed after that many
    tokens), "adaptive" or "between_tools" (the model decides), or "disabled"; `display`
    "omitted" sends the thinking blocks without their text."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class MessagesBody(_Body):
    model: str | None = None  # one model is served: any name is taken
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


def openai_body(body: Any) -> dict[str, Any]:
    """A Messages body -> the OpenAI chat body asking the same (RequestError naming the
    field of a bad one). Fields the server leaves out (temperature, top_p, top_k) take the
    server's defaults, as on the OpenAI route."""
    b = validate(MessagesBody, body, dotted())
    messages: list[dict[str, Any]] = []
    if b.system:
        system = b.system if isinstance(b.system, str) else JOIN.join(t.text for t in b.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(b.messages):
        messages += _messages(m, f"messages.{i}")
    out: dict[str, Any] = {"messages": messages, "max_tokens": b.max_tokens}
    if b.messages[-1].role == "assistant" and _prefill(messages[-1], len(b.messages) - 1):
        out["continue_final_message"] = True
    for name in ("temperature", "top_p", "top_k"):
        if getattr(b, name) is not None:
            out[name] = getattr(b, name)
    if b.stop_sequences:
        out["stop"] = b.stop_sequences
    if b.tools:
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in b.tools
        ]
    if b.tool_choice is not None:
        out.update(_tool_choice(b.tool_choice, [t.name for t in b.tools or []]))
    if b.thinking is not None:
        out.update(_thinking(b.thinking, b.max_tokens))
    if b.stream:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def _thinking(t: Thinking, max_tokens: int) -> dict[str, Any]:
    """The chat body's reasoning controls of Anthropic's `thinking` (its rule kept: the
    budget below max_tokens; its 1,024 floor is not, small models think less)."""
    on = t.type != "disabled"
    out: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": on}}
    if t.type == "enabled":
        if t.budget_tokens is None:
            raise RequestError("thinking.budget_tokens: Field required", "thinking.budget_tokens")
        if t.budget_tokens >= max_tokens:
            raise RequestError(
                f"thinking.budget_tokens: must be less than max_tokens ({max_tokens}), got "
                f"{t.budget_tokens}",
                "thinking.budget_tokens",
            )
        out["reasoning_budget_tokens"] = t.budget_tokens
    return out


def _messages(m: InputMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages: a user's tool_result blocks become "tool"
    messages (before its text, as Anthropic puts them first), an assistant's tool_use
    blocks its `tool_calls`."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, raw in enumerate(m.content):
        at = f"{where}.content.{j}"
        block = _block(raw, at)
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock) and m.role == "assistant" and block.thinking:
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            if m.role != "assistant":
                raise RequestError(f"{at}: tool_use blocks belong to assistant messages", at)
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ToolResultBlock):
            if m.role != "user":
                raise RequestError(f"{at}: tool_result blocks belong to user messages", at)
            content = _result_text(block, at)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
    if m.role == "assistant":
        reply: dict[str, Any] = {"role": "assistant", "content": JOIN.join(texts)}
        if thoughts:
            reply["reasoning_content"] = JOIN.join(thoughts)
        if calls:
            reply["tool_calls"] = calls
            reply["content"] = reply["content"] or None
        return [reply]
    return results + ([{"role": "user", "content": JOIN.join(texts)}] if texts else [])


def _prefill(last: dict[str, Any], i: int) -> bool:
    """Whether a final assistant message is a prefill the reply continues: one with text
    and no tool_use (which stays a finished turn, as before its tool_result comes); as in
    Anthropic's API, its text may not end with whitespace."""
    text = last["content"] or ""
    if last.get("tool_calls") or not text:
        return False
    if text != text.rstrip():
        at = f"messages.{i}.content"
        raise RequestError(f"{at}: final assistant content cannot end with trailing whitespace", at)
    return True


def _block(raw: Any, at: str) -> _Body:
    kind = raw.get("type") if isinstance(raw, dict) else None
    model = BLOCKS.get(kind) if isinstance(kind, str) else None
    if model is None:
        known = ", ".join(repr(k) for k in BLOCKS)
        why = "this server's model reads text only" if kind in ("image", "document") else ""
        raise RequestError(
            f"{at}.type: content blocks are {known}; got {kind!r}" + (f" ({why})" if why else ""),
            f"{at}.type",
        )
    return validate(model, raw, dotted(at))


def _result_text(block: ToolResultBlock, at: str) -> str:
    """A tool_result's content as text (its text blocks; an error result says so)."""
    if isinstance(block.content, str):
        text = block.content
    else:
        text = JOIN.join(
            validate(TextBlock, part, dotted(f"{at}.content.{k}")).text
            for k, part in enumerate(block.content)
        )
    return f"Error: {text}" if block.is_error else text


def _tool_choice(choice: ToolChoice, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if choice.type == "tool":
        if choice.name not in names:
            raise RequestError(
                f"tool_choice.name: {choice.name!r} is not one of the tools ({names})",
                "tool_choice.name",
            )
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


# The OpenAI fields a Messages body becomes, by their Anthropic names (in errors).
NAMES = {
    **{n: n for n in ("max_tokens", "temperature", "top_p", "top_k", "messages", "tools")},
    "stop": "stop_sequences",
    "tool_choice": "tool_choice",
    "continue_final_message": "messages",
    "reasoning_budget_tokens": "thinking.budget_tokens",
    "chat_template_kwargs": "thinking",
}
MESSAGES = Api(lambda data, context: (openai_body(data), True), dotted_place, NAMES)


def _count_body(data: Any, context: int) -> tuple[dict, bool]:
    if isinstance(data, dict):
        data = {"max_tokens": 1, **data}  # count_tokens bodies have none
    return openai_body(data), True


COUNT = Api(_count_body, dotted_place, NAMES)


def routes(openai: OpenAIRoutes):
    """The router of POST /messages and /messages/count_tokens (mounted under /v1)."""
    from fastapi import APIRouter
    from fastapi.responses import StreamingResponse
    from starlette.requests import Request as HTTPRequest

    router = APIRouter()

    @router.post("/messages")
    async def messages(request: HTTPRequest):
        prepared = await openai.prepare(request, MESSAGES)
        body = prepared.body
        stops = body.get("stop", [])
        answer = await openai.answer(request, prepared)
        shown = _shown(prepared.data)
        if not body.get("stream"):
            return message(answer, stops, shown)
        return StreamingResponse(
            _stream(answer, stops, shown),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @router.post("/messages/count_tokens")
    async def count_tokens(request: HTTPRequest):
        prepared = await openai.prepare(request, COUNT, count_only=True)
        return {"input_tokens": len(prepared.ids)}

    return router


def _shown(data: Any) -> bool:
    """Whether the thinking blocks carry their text (`thinking.display` not "omitted")."""
    thinking = data.get("thinking") if isinstance(data, dict) else None
    return not (isinstance(thinking, dict) and thinking.get("display") == "omitted")


async def _stream(response, stops: list[str], shown: bool = True):
    events = Events(stops, shown)
    async for c in chunks(response):
        for e in events.feed(c):
            yield e
        if "error" in c:
            return
    for e in events.end():
        yield e
