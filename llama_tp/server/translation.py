"""What the Anthropic and Ollama routes share: their bodies are translated to an OpenAI
body while they are prepared (server/preparation.py, with the API's `Api`: how it names
fields), answered by the OpenAI handlers themselves (`OpenAIRoutes`), and the answer
translated back; this module reads that answer (a JSON body, or the chunks of its
server-sent events).

Nothing here knows Anthropic's or Ollama's formats (anthropic.py, ollama.py do).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any


@dataclass
class OpenAIRoutes:
    """The OpenAI handlers: `prepare(request, api, count_only=False)` reads the HTTP
    request's body through `api` (preparation.Api) into a `Prepared` request, off the
    event loop; `answer(request, prepared)` returns the route's JSON answer (a dict), or
    its streaming response (the SSE lines) when the body asked to stream."""

    prepare: Callable[..., Awaitable[Any]]
    answer: Callable[[Any, Any], Awaitable[Any]]
    model: Callable[[], Any]  # the served model's ModelInfo (RequestError 503 while loading)


async def chunks(response) -> AsyncIterator[dict]:
    """The JSON chunks of an OpenAI streaming response, without the closing `[DONE]` (a
    mid-stream failure is a chunk with an "error" key). Closing this iterator closes the
    response's, which cancels the request when a client goes away."""
    async with aclosing(response.body_iterator) as lines:
        async for text in lines:
            for line in text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[len("data: ") :])
