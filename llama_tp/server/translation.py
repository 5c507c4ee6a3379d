"""What the Anthropic and Ollama routes share: their bodies are translated to an OpenAI
chat body, answered by the /v1/chat/completions handler itself (`OpenAIRoutes`), and its
answer translated back; this module reads that answer (a JSON body, or the chunks of its
server-sent events) and names a pydantic error's field.

Nothing here knows Anthropic's or Ollama's formats (anthropic.py, ollama.py do).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from .protocol import RequestError


@dataclass
class OpenAIRoutes:
    """The OpenAI handlers, called with a decoded OpenAI body and the HTTP request: each
    returns the route's JSON answer (a dict), or its streaming response (the SSE lines)."""

    chat: Callable[[Any, dict], Awaitable[Any]]
    completion: Callable[[Any, dict], Awaitable[Any]]
    model: Callable[[], Any]  # the served model's ModelInfo (RequestError 503 while loading)
    prompt_tokens: Callable[[dict], int]  # how many tokens a chat body's prompt is


async def chunks(response) -> AsyncIterator[dict]:
    """The JSON chunks of an OpenAI streaming response, without the closing `[DONE]` (a
    mid-stream failure is a chunk with an "error" key). Closing this iterator closes the
    response's, which cancels the request when a client goes away."""
    async with aclosing(response.body_iterator) as lines:
        async for text in lines:
            for line in text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[len("data: ") :])


def validate(model: type[BaseModel], body: Any, prefix: str = "") -> BaseModel:
    """`body` as `model`, or a RequestError whose message names the field as Anthropic's
    API does ("messages.0.content.1.type: ..."), under `prefix`."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # Of a union's errors (one per member), the deepest says most: a list's bad item
        # rather than "not a string".
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        if err["type"] == "model_attributes_type" and not prefix:
            raise RequestError("the body is not a JSON object", None) from None
        path = field_path(err["loc"], prefix)
        message = err["msg"]
        if "input" in err and err["type"] != "missing":
            message += f", got {err['input']!r}"[:200]
        raise RequestError(f"{path}: {message}" if path else message, path or None) from None


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}


def field_path(loc: tuple, prefix: str = "") -> str:
    """pydantic's error location as a dotted path; the names pydantic gives the members of
    a union ("str", "list[Block]", "function-after[...]") are left out."""
    parts = [prefix] if prefix else []
    for part in loc:
        if isinstance(part, int) or (part.isidentifier() and part not in _TYPE_NAMES):
            parts.append(str(part))
    return ".".join(parts)


def json_body(raw: bytes) -> Any:
    """A request's decoded JSON body (RequestError 400 when it is not JSON)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"the body is not valid JSON: {e}", None, code="invalid_json") from None
