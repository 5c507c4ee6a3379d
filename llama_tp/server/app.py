"""The HTTP app (FastAPI on Starlette): routes, authentication, streaming.

Handlers validate and tokenize on the HTTP thread, queue the job with rank 0's
`Scheduler`, and relay its events: as one JSON body, or as server-sent events
ending with `data: [DONE]`. A streaming client that disconnects cancels its
sequence (Starlette cancels the stream; the `finally` tells the scheduler).
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations,
# which name classes imported inside build_app.

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from .protocol import (
    Defaults,
    Request,
    RequestError,
    encode,
    error_body,
    fit,
    parse_chat,
    parse_completion,
)
from .responses import Logprobs, chunk, completion_body, usage_chunk
from .scheduler import Failure, Scheduler

POLL = 0.5  # seconds between checks that a non-streaming client is still connected


@dataclass
class ModelInfo:
    """What the HTTP side needs to know about the model."""

    name: str
    context: int
    vocab_size: int
    eos: frozenset[int]


def build_app(
    scheduler: Scheduler,
    tokenizer,
    info: ModelInfo,
    defaults: Defaults | None = None,
    api_key: str | None = None,
):
    """The FastAPI app serving `scheduler`'s model (OpenAI's routes, /health)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.requests import Request as HTTPRequest

    defaults = defaults or Defaults()
    app = FastAPI(title="llama_tp", docs_url=None, redoc_url=None)
    created = int(time.time())

    def error(status: int, message: str, kind: str, param=None, code=None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, param, code), status_code=status)

    def unauthorized(request: HTTPRequest) -> JSONResponse | None:
        if api_key is None or request.headers.get("authorization") == f"Bearer {api_key}":
            return None
        return error(
            401,
            "invalid or missing API key (Authorization: Bearer ...)",
            "invalid_request_error",
            None,
            "invalid_api_key",
        )

    @app.get("/health")
    async def health():
        if scheduler.closed:
            return JSONResponse({"status": "stopping"}, status_code=503)
        if not scheduler.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        if scheduler.replicas > 1:  # requests each data-parallel replica has admitted
            return {"status": "ok", "replicas": list(scheduler.served)}
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        if (denied := unauthorized(request)) is not None:
            return denied
        entry = {"id": info.name, "object": "model", "created": created, "owned_by": "llama_tp"}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await complete(request, chat=False)

    def decode(token: int) -> str:
        return tokenizer.decode([token])

    async def complete(request: HTTPRequest, chat: bool):
        if (denied := unauthorized(request)) is not None:
            return denied
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as e:
                raise RequestError(
                    f"the body is not valid JSON: {e}", None, code="invalid_json"
                ) from None
            req = (parse_chat if chat else parse_completion)(body, defaults)
            if not scheduler.ready or scheduler.closed:
                raise RequestError(
                    scheduler.closed or "the model is still loading",
                    None,
                    503,
                    "unavailable",
                    "server_error",
                )
            ids = encode(req, tokenizer, defaults, info.vocab_size)
            fit(req, len(ids), info.context)
            seed = req.seed if req.seed is not None else defaults.seed
            job = scheduler.submit(ids, req.params, seed, asyncio.get_running_loop())
        except RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        prefix = "chatcmpl" if chat else "cmpl"
        rid = f"{prefix}-{job.uid}-{int(time.time() * 1000)}"
        lp = Logprobs(chat, decode) if req.params.logprobs is not None else None
        if req.stream:
            return StreamingResponse(
                stream(req, rid, job, lp),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await collect(request, req, rid, job, lp)

    def wants_logprob(e) -> bool:
        return e.logprob is not None and not (e.finish_reason == "stop" and e.token in info.eos)

    async def collect(request: HTTPRequest, req: Request, rid: str, job, lp):
        text = []
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), POLL)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    scheduler.cancel(job.uid)
                    return error(499, "client closed the request", "invalid_request_error")
                continue
            if isinstance(item, Failure):
                return error(item.status, item.message, "server_error", None, "unavailable")
            text.append(item.text)
            if lp is not None and wants_logprob(item):
                lp.add(item)
            if item.finish_reason:
                return completion_body(
                    req, rid, info.name, "".join(text), item.finish_reason, item, lp
                )

    async def stream(req: Request, rid: str, job, lp):
        done = False
        try:
            if req.chat:
                yield sse(chunk(req, rid, info.name, "", role=True))
            while True:
                item = await job.queue.get()
                if isinstance(item, Failure):
                    done = True
                    yield sse(error_body(item.message, "server_error", None, item.status))
                    return
                entry = lp.add(item) if lp is not None and wants_logprob(item) else None
                if item.text or entry is not None:
                    yield sse(chunk(req, rid, info.name, item.text, logprobs=entry))
                if item.finish_reason:
                    done = True
                    yield sse(chunk(req, rid, info.name, None, item.finish_reason))
                    if req.include_usage:
                        yield sse(usage_chunk(req, rid, info.name, item))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not done:  # the client went away mid-stream
                scheduler.cancel(job.uid)

    return app


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
