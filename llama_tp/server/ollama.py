"""Ollama's API (/api/chat, /api/generate) as a thin translation onto the OpenAI routes:
the same engine request, the same text. (Its model routes, /api/tags, /api/ps, /api/show
and /api/version, are in ollama_models.py; its embedding routes in ollama_embed.py.)

`chat_body` / `generate_body` turn an Ollama body into an OpenAI one (`options` ->
sampling fields, `format` -> `response_format`, tool calls' argument objects -> JSON
strings); `Reply` turns the OpenAI stream chunks back into Ollama's NDJSON lines (`stream`
defaults to true, as in Ollama) or, for `"stream": false`, into its one answer, with
Ollama's counts and durations (nanoseconds). Errors are Ollama's `{"error": "..."}`.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations.

import asyncio
import json
from time import monotonic_ns
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .bodies import dotted, dotted_place, validate
from .ollama_models import now, tag
from .preparation import Api
from .protocol import MAX_STOPS, RequestError
from .translation import OpenAIRoutes, chunks

POLL = 0.5  # seconds between checks that a non-streaming client is still connected


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # e.g. keep_alive, think


class Function(_Body):
    name: str
    arguments: dict[str, Any] = {}


class ToolCall(_Body):
    function: Function


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # an earlier reply's reasoning, handed back
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None


class Options(_Body):
    """The sampling options taken (others, such as num_ctx, are ignored as by a model
    that cannot change them)."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    num_predict: int | None = None  # <= 0 (Ollama's -1, -2): until the context is full
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


Format = Literal["", "json"] | dict[str, Any] | None


class _Request(_Body):
    model: str | None = None  # one model is served: any name is taken
    format: Format = None
    options: Options | None = None
    stream: bool = True
    think: bool | Literal["low", "medium", "high"] | None = None


class ChatBody(_Request):
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None  # OpenAI's function format already


class GenerateBody(_Request):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


def chat_body(body: Any, context: int) -> dict[str, Any] | None:
    """An /api/chat body -> the OpenAI chat body asking the same (`context`: the model's,
    for num_predict <= 0). An empty `messages` is Ollama's "load the model": None."""
    b = validate(ChatBody, body, dotted())
    if not b.messages:
        return None
    messages: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (id, name) of tool calls not yet answered
    for i, m in enumerate(b.messages):
        if m.images:
            at = f"messages.{i}.images"
            raise RequestError(f"{at}: this server's model reads text only", at)
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.thinking and m.role == "assistant":
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            msg["tool_calls"] = []
            for k, c in enumerate(m.tool_calls):
                call_id = f"call_{i}_{k}"
                arguments = json.dumps(c.function.arguments, ensure_ascii=False)
                function = {"name": c.function.name, "arguments": arguments}
                msg["tool_calls"].append({"id": call_id, "type": "function", "function": function})
            pending = [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
        if m.role == "tool" and pending:  # Ollama's tool messages name the tool, not the call
            k = next((k for k, (_, n) in enumerate(pending) if n == m.tool_name), 0)
            msg["tool_call_id"] = pending.pop(k)[0]
        if m.tool_name:
            msg["name"] = m.tool_name
        messages.append(msg)
    out = {"messages": messages, **_settings(b, context)}
    last = messages[-1]
    if last["role"] == "assistant" and last["content"] and not last.get("tool_calls"):
        out["continue_final_message"] = True  # Ollama's prefill: the reply continues it
    if b.tools:
        out["tools"] = b.tools
    return out


def generate_body(body: Any, context: int) -> tuple[dict[str, Any] | None, bool]:
    """An /api/generate body -> (the OpenAI body, whether it is a text completion: `raw`)
    (None for an empty prompt: Ollama's "load the model")."""
    b = validate(GenerateBody, body, dotted())
    for name in ("images", "suffix", "template", "context"):
        if getattr(b, name):
            raise RequestError(f"{name}: not supported by this server", name)
    if not b.prompt:
        return None, b.raw
    if b.raw:
        return {"prompt": b.prompt, **_settings(b, context)}, True
    messages = [{"role": "system", "content": b.system}] if b.system else []
    messages.append({"role": "user", "content": b.prompt})
    return {"messages": messages, **_settings(b, context)}, False


def _settings(b: _Request, context: int) -> dict[str, Any]:
    out: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
    o = b.options or Options()
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop"):
        if getattr(o, name) is not None:
            out[name] = getattr(o, name)
    for name, openai in [
        ("repeat_penalty", "repetition_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
    ]:
        if getattr(o, name) is not None:
            out[openai] = getattr(o, name)
    if o.num_predict is not None:
        out["max_tokens"] = o.num_predict if o.num_predict > 0 else context
    if isinstance(b.think, bool):  # on or off; an effort for the templates that take one
        out["chat_template_kwargs"] = {"enable_thinking": b.think}
    elif b.think is not None:
        out["reasoning_effort"] = b.think
    if b.format == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(b.format, dict):
        schema = {"name": "format", "schema": b.format, "strict": True}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    return out


# -- the answer back -----------------------------------------------------------------------


class Reply:
    """OpenAI stream chunks -> Ollama's answer lines: one per piece of text, then the
    last with `done: true`, the done_reason, the counts and durations. `chat`: lines
    carry a `message` (else the /api/generate `response` text)."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.t0 = monotonic_ns()
        self.first: int | None = None  # when the first text arrived (the prompt's time)
        self.text: list[str] = []
        self.thought: list[str] = []  # the reasoning (Ollama's `thinking`)
        self.calls: dict[int, dict[str, Any]] = {}  # tool calls by index, arguments joined
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The lines of one OpenAI chunk (an "error" chunk is Ollama's error line)."""
        if "error" in chunk:
            return [error_body(chunk["error"].get("message", ""))]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") if "delta" in choice else choice.get("text")
            thought = (delta if "delta" in choice else choice).get("reasoning_content")
            if self.first is None and (text or thought or delta.get("tool_calls")):
                self.first = monotonic_ns()
            if thought:
                self.thought.append(thought)
                out.append(self._line("", False, thought))
            for call in delta.get("tool_calls") or []:
                held = self.calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                f = call.get("function") or {}
                held["name"] += f.get("name") or ""
                held["arguments"] += f.get("arguments") or ""
            if text:
                self.text.append(text)
                out.append(self._line(text, False))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> dict[str, Any]:
        """The last line (`done: true`); with `whole`, carrying all the text."""
        return self._done("")

    def whole(self) -> dict[str, Any]:
        """The one answer of a `"stream": false` request."""
        return self._done("".join(self.text), "".join(self.thought))

    def _done(self, text: str, thought: str = "") -> dict[str, Any]:
        end = monotonic_ns()
        first = self.first or end
        line = self._line(text, True, thought)
        if self.chat and self.calls:
            line["message"]["tool_calls"] = [
                {"function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                for _, c in sorted(self.calls.items())
            ]
        line["done_reason"] = "length" if self.finish == "length" else "stop"
        line.update(
            total_duration=end - self.t0,
            load_duration=0,
            prompt_eval_count=self.usage.get("prompt_tokens", 0),
            prompt_eval_duration=first - self.t0,
            eval_count=self.usage.get("completion_tokens", 0),
            eval_duration=end - first,
        )
        return line

    def _line(self, text: str, done: bool, thought: str = "") -> dict[str, Any]:
        line: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.chat:
            line["message"] = {"role": "assistant", "content": text}
            if thought:
                line["message"]["thinking"] = thought
        else:
            line["response"] = text
            if thought:
                line["thinking"] = thought
        line["done"] = done
        return line


def _arguments(text: str) -> Any:
    try:
        return json.loads(text or "{}")
    except ValueError:
        return {"arguments": text}


def error_body(message: str) -> dict[str, str]:
    return {"error": message}


# The OpenAI fields an Ollama body becomes, by their Ollama names (in errors).
NAMES = {
    **{n: f"options.{n}" for n in ("temperature", "top_p", "top_k", "min_p", "seed", "stop")},
    **{n: f"options.{n}" for n in ("presence_penalty", "frequency_penalty")},
    "repetition_penalty": "options.repeat_penalty",
    "max_tokens": "options.num_predict",
    "response_format": "format",
    **{n: n for n in ("messages", "prompt", "tools")},
    "continue_final_message": "messages",
    "chat_template_kwargs": "think",
    "reasoning_effort": "think",
}
CHAT = Api(lambda data, context: (chat_body(data, context), True), dotted_place, NAMES)


def _generate(data: Any, context: int) -> tuple[dict | None, bool]:
    body, text = generate_body(data, context)
    return body, not text


GENERATE = Api(_generate, dotted_place, NAMES)


def routes(openai: OpenAIRoutes):
    """The router of Ollama's routes (mounted under /api)."""
    from fastapi import APIRouter
    from fastapi.responses import StreamingResponse
    from starlette.requests import Request as HTTPRequest

    router = APIRouter()

    async def answer(request: HTTPRequest, api: Api, chat: bool):
        prepared = await openai.prepare(request, api)
        info = openai.model()
        reply = Reply(tag(info.name), chat)
        if prepared.req is None:  # nothing to say: Ollama's answer to "load the model"
            line = reply.whole()
            line["done_reason"] = "load"
            return line
        response = await openai.answer(request, prepared)
        if not prepared.data.get("stream", True):
            await until_done(request, read(response, reply))
            return reply.whole()

        async def ndjson():
            async for c in chunks(response):
                for line in reply.feed(c):
                    yield json.dumps(line, ensure_ascii=False) + "\n"
                if "error" in c:
                    return
            yield json.dumps(reply.end(), ensure_ascii=False) + "\n"

        return StreamingResponse(ndjson(), media_type="application/x-ndjson")

    @router.post("/chat")
    async def chat(request: HTTPRequest):
        return await answer(request, CHAT, True)

    @router.post("/generate")
    async def generate(request: HTTPRequest):
        return await answer(request, GENERATE, False)

    return router


async def read(response, reply: Reply) -> None:
    """Feed `reply` the whole OpenAI stream (RequestError on a mid-stream failure)."""
    async for c in chunks(response):
        lines = reply.feed(c)
        if "error" in c:  # its status: the request's own failure (4xx) or the server's
            code = c["error"].get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 503
            raise RequestError(lines[0]["error"], c["error"].get("param"), status, None)


async def until_done(request, work) -> None:
    """Await `work` (a coroutine) while the client is connected; a client that goes away
    cancels it, which cancels the request (as the OpenAI route's non-streaming answer)."""
    task = asyncio.ensure_future(work)
    while not (await asyncio.wait({task}, timeout=POLL))[0]:
        if await request.is_disconnected():
            task.cancel()
            raise RequestError("client closed the request", None, 499, None)
    task.result()
