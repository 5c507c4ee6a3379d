"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}, POST
/v1/responses/input_tokens) as a thin translation onto the OpenAI chat route: the same
engine request, the same text.

A body becomes an OpenAI chat body while it is prepared (server/responses_request.py,
with the Api below: how the Responses API names the chat body's fields), is answered by
the chat route's handlers (`OpenAIRoutes`), and the chat completion or its stream chunks
become a response object or the Responses events (server/responses_answers.py). A
response kept (`store`, by default) is answered by GET and continued by a request naming
it as `previous_response_id` (server/response_store.py). Errors are OpenAI's shape,
naming the field as the Responses API does ("input[2].call_id", "max_output_tokens").
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations.

import json
import time
from typing import Any

from .bodies import openai_param
from .errors import RequestError
from .preparation import Api
from .response_store import ResponseStore, Stored
from .responses_answers import Events, new_id, respond
from .responses_request import NAMES, Turn, chat_body
from .translation import OpenAIRoutes, chunks


def api(store: ResponseStore) -> Api:
    """How a Responses body becomes a chat body, with `store`'s conversations."""
    return Api(lambda data, context: (chat_body(data, store), True), openai_param, NAMES)


def routes(openai: OpenAIRoutes, store: ResponseStore):
    """The router of the Responses API (mounted under /v1)."""
    from fastapi import APIRouter
    from fastapi.responses import StreamingResponse
    from starlette.requests import Request as HTTPRequest

    router = APIRouter()
    responses = api(store)

    @router.post("/responses")
    async def create(request: HTTPRequest):
        prepared = await openai.prepare(request, responses)
        turn: Turn = prepared.body.turn
        rid, created = new_id("resp"), int(time.time())
        # The bytes the response counts in the store: the conversation it continues, and
        # this request's (its whole body: more than its input items).
        size = (turn.previous.size if turn.previous else 0) + len(await request.body())
        answer = await openai.answer(request, prepared)
        if not turn.stream:
            response = respond(answer, rid, created, turn)
            keep(store, turn, response, size)
            return response

        async def events():
            stream = Events(rid, created, turn)
            async for c in chunks(answer):
                for e in stream.feed(c):
                    yield e
                if "error" in c:
                    return
            for e in stream.end():
                yield e
            keep(store, turn, stream.response, size)

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @router.post("/responses/input_tokens")
    async def input_tokens(request: HTTPRequest):
        prepared = await openai.prepare(request, responses, count_only=True)
        return {"object": "response.input_tokens", "input_tokens": len(prepared.ids)}

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str):
        return held(store, response_id).response

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str):
        if not store.delete(response_id):
            held(store, response_id)  # the 404
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return router


def keep(store: ResponseStore, turn: Turn, response: dict[str, Any], size: int) -> None:
    """Keep a finished response and its conversation (its input, then its output), unless
    the request said `store: false`."""
    if turn.store:
        size += len(json.dumps(response["output"], ensure_ascii=False))
        store.put(response["id"], Stored(response, (*turn.items, *response["output"]), size))


def held(store: ResponseStore, rid: str) -> Stored:
    stored = store.get(rid)
    if stored is None:
        raise RequestError(
            f"no response with id {rid!r} is stored (never stored, deleted, or evicted)",
            None,
            404,
            "not_found",
        )
    return stored
