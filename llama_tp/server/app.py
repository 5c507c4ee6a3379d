"""The HTTP app (FastAPI on Starlette): routes, authentication, streaming.

Every /v1 route depends on `authorized` (the API key, compared in constant time)
and on `available` (the one place that decides "still loading" or "stopping":
`Scheduler.unavailable`); request errors, the models' validation errors included,
go through one exception handler as OpenAI's error body. Handlers translate
the request body to the engine's one request (prompt tokens and
`SamplingParams`), queue it with rank 0's `Scheduler`, and relay its events: as
one JSON body, or as server-sent events ending with `data: [DONE]`. A streaming
client that disconnects cancels its sequence (Starlette cancels the stream; the
`finally` tells the scheduler).

`GET /` is the chat page (server/page/, package data); `GET /v1/status` the JSON
of its cluster panel (rank 0's `status.Monitor`); `GET /metrics` Prometheus' text
(server/metrics.py). The status route and /metrics take the API key like /v1's
routes (they name hosts and traffic); the page itself does not (it holds no data,
and asks for the key when a request gets a 401).
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations,
# which name classes imported inside build_app.

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from importlib import resources
from typing import Annotated, Any

from ..checkpoints.chat_template import PromptRenderer
from . import anthropic, anthropic_answers, ollama
from .protocol import (
    ChatBody,
    CompletionBody,
    Defaults,
    Request,
    RequestError,
    chat_request,
    completion_request,
    constrain,
    error_body,
    fit,
    parse_chat,
    parse_completion,
    prompt_tokens,
    validation_error,
)
from .responses import Logprobs, chunk, completion_body, usage_chunk
from .scheduler import Failure, Scheduler
from .status import Monitor
from .tools import ToolStream, tool_format
from .translation import OpenAIRoutes

POLL = 0.5  # seconds between checks that a non-streaming client is still connected


@dataclass
class ModelInfo:
    """What the HTTP side needs to know about the model (set once it has loaded)."""

    name: str
    context: int
    vocab_size: int
    renderer: PromptRenderer  # the prompt renderer (and its tokenizer) of the model


def build_app(
    scheduler: Scheduler,
    defaults: Defaults | None = None,
    api_key: str | None = None,
    cors: list[str] | None = None,
):
    """The FastAPI app serving `scheduler`'s model (OpenAI's routes, /health). The app
    answers before the model has loaded: `app.state.model` (a ModelInfo) is set then.
    `cors`: the origins browsers may call from ("*": any)."""
    from fastapi import APIRouter, Depends, FastAPI, Header
    from fastapi.exceptions import RequestValidationError
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.requests import Request as HTTPRequest

    from .metrics import CONTENT_TYPE, Metrics, RequestCounter

    defaults = defaults or Defaults()
    app = FastAPI(title="llama_tp", docs_url=None, redoc_url=None)
    app.state.model = None
    created = int(time.time())
    if cors:
        app.add_middleware(
            CORSMiddleware, allow_origins=cors, allow_methods=["*"], allow_headers=["*"]
        )
    # Status and metrics: the runner sets the monitor's ranks and mesh once loaded.
    metrics = Metrics()
    scheduler.monitor = app.state.monitor = Monitor(sink=metrics)
    metrics.watch(scheduler.monitor, scheduler)
    app.add_middleware(RequestCounter, metrics=metrics)

    @app.exception_handler(RequestError)
    async def request_error(request: HTTPRequest, e: RequestError):
        return JSONResponse(route_error(request.url.path, e), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: HTTPRequest, e: RequestValidationError):
        return await request_error(request, validation_error(list(e.errors())))

    def authorized(
        authorization: Annotated[str | None, Header()] = None,
        x_api_key: Annotated[str | None, Header()] = None,  # Anthropic's header
    ) -> None:
        if api_key is None:
            return
        bearer = secrets.compare_digest(
            (authorization or "").encode(), f"Bearer {api_key}".encode()
        )
        if bearer or secrets.compare_digest((x_api_key or "").encode(), api_key.encode()):
            return
        raise RequestError(
            "invalid or missing API key (Authorization: Bearer ... or x-api-key: ...)",
            None,
            401,
            "invalid_api_key",
        )

    def available() -> ModelInfo:
        problem = scheduler.unavailable()
        if problem is not None:
            raise problem
        return app.state.model

    Model = Annotated[ModelInfo, Depends(available)]

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @app.get("/health")
    async def health():
        problem = scheduler.unavailable()
        if problem is not None:
            status = "loading" if problem.code == "loading" else "stopping"
            return JSONResponse({"status": status}, status_code=503)
        if scheduler.replicas > 1:  # requests each data-parallel replica has admitted
            return {"status": "ok", "replicas": list(scheduler.served)}
        return {"status": "ok"}

    @v1.get("/models")
    async def models(info: Model):
        entry = {"id": info.name, "object": "model", "created": created, "owned_by": "llama_tp"}
        return {"object": "list", "data": [entry]}

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatBody, request: HTTPRequest, info: Model):
        return await complete(request, chat_request(body, defaults), info)

    @v1.post("/completions")
    async def completions(body: CompletionBody, request: HTTPRequest, info: Model):
        return await complete(request, completion_request(body, defaults), info)

    @v1.get("/status")
    async def status():
        model = app.state.model.name if app.state.model is not None else None
        return app.state.monitor.snapshot(scheduler, model)

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    page = resources.files(__package__).joinpath("page", "index.html").read_text()

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    app.include_router(v1)

    # The Anthropic and Ollama routes: their bodies translated to OpenAI's, answered here.
    async def openai_chat(request: HTTPRequest, body: dict):
        return await complete(request, parse_chat(body, defaults), available())

    async def openai_completion(request: HTTPRequest, body: dict):
        return await complete(request, parse_completion(body, defaults), available())

    def count(body: dict) -> int:
        info = available()
        return len(prompt_tokens(parse_chat(body, defaults), info.renderer, info.vocab_size)[0])

    openai = OpenAIRoutes(openai_chat, openai_completion, available, count)
    auth = [Depends(authorized)]
    app.include_router(anthropic.routes(openai), prefix="/v1", dependencies=auth)
    app.include_router(ollama.routes(openai), prefix="/api", dependencies=auth)

    async def complete(request: HTTPRequest, req: Request, info: ModelInfo):
        ids, stops = prompt_tokens(req, info.renderer, info.vocab_size)
        fit(req, len(ids), info.context)
        constrain(req, info.renderer, info.vocab_size)
        if stops:
            req.params = req.params.but(stop=(*req.params.stop, *stops))
        seed = req.seed if req.seed is not None else defaults.seed
        job = scheduler.submit(ids, req.params, seed, asyncio.get_running_loop())
        prefix = "chatcmpl" if req.chat else "cmpl"
        rid = f"{prefix}-{job.uid}-{int(time.time() * 1000)}"
        decode = info.renderer.tokenizer.decode
        lp = Logprobs(req.chat, lambda t: decode([t])) if req.params.logprobs is not None else None
        fmt = tool_format(info.renderer.tokenizer) if req.tools else None
        calls = ToolStream(fmt, req.tools) if fmt is not None else None
        if req.stream:
            return StreamingResponse(
                stream(req, rid, job, lp, info.name, calls),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await collect(request, req, rid, job, lp, info.name, calls)

    async def collect(request: HTTPRequest, req: Request, rid: str, job, lp, name: str, calls):
        text = []
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), POLL)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    scheduler.cancel(job.uid)
                    raise RequestError("client closed the request", None, 499, None) from None
                continue
            if isinstance(item, Failure):
                raise RequestError(item.message, None, item.status, "unavailable", "server_error")
            text.append(item.text)
            if lp is not None and wants_logprob(item):
                lp.add(item)
            if item.finish_reason:
                text, tool_calls = "".join(text), None
                if calls is not None:
                    text = calls.feed(text)
                    rest, tool_calls = calls.finish()
                    text += rest
                return completion_body(
                    req, rid, name, text, item.finish_reason, item, lp, tool_calls
                )

    async def stream(req: Request, rid: str, job, lp, name: str, calls):
        done = False
        try:
            if req.chat:
                yield sse(chunk(req, rid, name, "", role=True))
            while True:
                item = await job.queue.get()
                if isinstance(item, Failure):
                    done = True
                    yield sse(error_body(item.message, "server_error", None, item.status))
                    return
                entry = lp.add(item) if lp is not None and wants_logprob(item) else None
                text = item.text if calls is None else calls.feed(item.text)
                if text or entry is not None:
                    yield sse(chunk(req, rid, name, text, logprobs=entry))
                if item.finish_reason:
                    done = True
                    finish = item.finish_reason
                    if calls is not None:
                        rest, tool_calls = calls.finish()
                        if rest or tool_calls:
                            yield sse(chunk(req, rid, name, rest or None, tool_calls=tool_calls))
                        finish = "tool_calls" if tool_calls else finish
                    yield sse(chunk(req, rid, name, None, finish, stop_reason=item.stop_string))
                    if req.include_usage:
                        yield sse(usage_chunk(req, rid, name, item))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not done:  # the client went away mid-stream
                scheduler.cancel(job.uid)

    return app


def route_error(path: str, e: RequestError) -> dict:
    """`e` in the error shape of the API `path` belongs to."""
    if path.startswith("/v1/messages"):
        return anthropic_answers.error_body(str(e), e.status)
    if path.startswith("/api/"):
        return ollama.error_body(str(e))
    return e.body()


def wants_logprob(e) -> bool:
    """An event's token is reported with its log-probability unless it is the end of
    sequence (not part of the text)."""
    return e.logprob is not None and not e.eos


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
