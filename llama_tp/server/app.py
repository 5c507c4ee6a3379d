"""The HTTP app (FastAPI on Starlette): routes, streaming, and what guards them.

Every request first meets `guard.Guard` (the Host it names, the API key on every route
but /health and the page, a JSON content type, the body's size), before any of its body
is read. Every route that answers depends on `available` (the one place that decides
"still loading" or "stopping": `Scheduler.unavailable`). A body is prepared off the
event loop (`preparation.Preparation`: decoded, validated against the model's
`Limits`, tokenized, its grammar compiled), for the three APIs alike; request errors
go through one exception handler, in the error shape of the API the path belongs to.
Handlers then queue the engine's request with rank 0's `Scheduler` and relay its
events: as one JSON body, or as server-sent events ending with `data: [DONE]`. A
streaming client that disconnects cancels its sequence (Starlette cancels the
stream; the `finally` tells the scheduler). A request whose own processing fails in
the step loop (engine/sequence.py) ends with an error naming the field behind it.

`GET /` is the chat page (server/page/, package data, with a content security policy
that allows its own script and style and nothing else, and no framing); `GET
/v1/status` the JSON of its cluster panel (rank 0's `status.Monitor`); `GET /metrics`
Prometheus' text (server/metrics.py); `GET /openapi.json` the API's description.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations,
# which name classes imported inside build_app.

import asyncio
import base64
import hashlib
import json
import re
import time
from dataclasses import dataclass
from importlib import resources
from typing import Annotated, Any

from ..checkpoints.chat_template import PromptRenderer
from . import anthropic, anthropic_answers, ollama
from .guard import Guard, Hosts
from .limits import Limits
from .preparation import OPENAI_CHAT, OPENAI_COMPLETION, Api, Preparation, Prepared
from .protocol import (
    ChatBody,
    CompletionBody,
    Defaults,
    Request,
    RequestError,
    error_body,
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
    limits: Limits | None = None  # what its requests are held to (None: from the above)
    model_type: str | None = None  # its family's (the tool-call formats its row names)

    def __post_init__(self) -> None:
        if self.limits is None:
            self.limits = Limits.of(self.context, self.vocab_size, self.renderer.tokenizer)


def build_app(
    scheduler: Scheduler,
    defaults: Defaults | None = None,
    api_key: str | None = None,
    cors: list[str] | None = None,
    hosts: Hosts | None = None,
    max_body: int = 0,
):
    """The FastAPI app serving `scheduler`'s model (OpenAI's routes, /health). The app
    answers before the model has loaded: `app.state.model` (a ModelInfo) is set then.
    `cors`: the origins browsers may call from ("*": any); `hosts`: the Host names it
    answers to (default: the local ones and any address); `max_body`: the largest body
    read, in bytes (0: the model's `Limits.body_bytes`)."""
    from fastapi import APIRouter, Depends, FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.requests import Request as HTTPRequest

    from .metrics import CONTENT_TYPE, Metrics, RequestCounter

    defaults = defaults or Defaults()
    app = FastAPI(title="llama_tp", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.model = None
    prep = app.state.preparation = Preparation(defaults)
    created = int(time.time())

    def body_limit() -> int:
        info = app.state.model
        return max_body or (info.limits.body_bytes if info is not None else Limits(1, 1).body_bytes)

    # Innermost first: the guard sees a request after CORS has answered a preflight.
    app.add_middleware(
        Guard, hosts=hosts or Hosts(), api_key=api_key, max_body=body_limit, error=route_error
    )
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

    def available() -> ModelInfo:
        problem = scheduler.unavailable()
        if problem is not None:
            raise problem
        return app.state.model

    Model = Annotated[ModelInfo, Depends(available)]

    v1 = APIRouter(prefix="/v1")

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

    @v1.post("/chat/completions", openapi_extra=_body_schema(ChatBody))
    async def chat_completions(request: HTTPRequest, info: Model):
        return await answer(request, await prepare(request, OPENAI_CHAT))

    @v1.post("/completions", openapi_extra=_body_schema(CompletionBody))
    async def completions(request: HTTPRequest, info: Model):
        return await answer(request, await prepare(request, OPENAI_COMPLETION))

    @v1.get("/status")
    async def status():
        model = app.state.model.name if app.state.model is not None else None
        return app.state.monitor.snapshot(scheduler, model)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi():
        return _with_schemas(app.openapi())

    page = resources.files(__package__).joinpath("page", "index.html").read_text()
    page_headers = {"Cache-Control": "no-cache", **page_policy(page)}

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return HTMLResponse(page, headers=page_headers)

    app.include_router(v1)

    async def prepare(request: HTTPRequest, api: Api, count_only: bool = False) -> Prepared:
        """The request's body as the engine's request, prepared off the event loop."""
        info = available()
        return await prep.prepare(await request.body(), api, info, count_only)

    async def answer(request: HTTPRequest, p: Prepared):
        """Queue a prepared request and answer with its reply (streamed or whole)."""
        info, req, ids = available(), p.req, p.ids
        seed = req.seed if req.seed is not None else defaults.seed
        job = scheduler.submit(ids, req.params, seed, asyncio.get_running_loop())
        prefix = "chatcmpl" if req.chat else "cmpl"
        rid = f"{prefix}-{job.uid}-{int(time.time() * 1000)}"
        decode = info.renderer.tokenizer.decode
        lp = (
            Logprobs(req.chat, lambda t: _text(decode, t))
            if req.params.logprobs is not None
            else None
        )
        fmt = tool_format(info.renderer.tokenizer, info.model_type) if req.tools else None
        calls = ToolStream(fmt, req.tools) if fmt is not None else None
        api = p.api
        if req.stream:
            return StreamingResponse(
                stream(req, rid, job, lp, info.name, calls, api),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await collect(request, req, rid, job, lp, info.name, calls, api)

    def failed(req: Request, item, api: Api) -> RequestError:
        """A job's failure: the server's (a Failure), or its own processing's (an event
        that ended it with an error), 400 naming the field behind it when known."""
        if isinstance(item, Failure):
            return RequestError(item.message, None, item.status, "unavailable", "server_error")
        param = _FIELDS.get(item.error_setting or "")
        if item.error_setting == "grammar":
            param = "response_format" if req.response_format is not None else "tools"
        if param is None:
            why = f"the request failed: {item.error}"
            return RequestError(why, None, 500, "failed", "server_error")
        return api.renamed(RequestError(f"'{param}' failed while generating: {item.error}", param))

    async def collect(request: HTTPRequest, req: Request, rid: str, job, lp, name, calls, api):
        text = []
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), POLL)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    scheduler.cancel(job.uid)
                    raise RequestError("client closed the request", None, 499, None) from None
                continue
            if isinstance(item, Failure) or item.finish_reason == "error":
                raise failed(req, item, api)
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

    async def stream(req: Request, rid: str, job, lp, name: str, calls, api: Api):
        done = False
        try:
            if req.chat:
                yield sse(chunk(req, rid, name, "", role=True))
            while True:
                item = await job.queue.get()
                if isinstance(item, Failure) or item.finish_reason == "error":
                    done = True
                    e = failed(req, item, api)
                    yield sse(error_body(str(e), e.kind, e.param, e.status))
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

    # The Anthropic and Ollama routes: their bodies translated to OpenAI's, answered here.
    openai = OpenAIRoutes(prepare, answer, available)
    app.include_router(anthropic.routes(openai), prefix="/v1")
    app.include_router(ollama.routes(openai), prefix="/api")

    return app


# The engine's settings (an error event's `error_setting`) by the OpenAI field behind them.
_FIELDS = {
    "logit_bias": "logit_bias",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
}


def page_policy(page: str) -> dict[str, str]:
    """The chat page's security headers: a content security policy allowing its own
    inline script and style (by their hashes) and calls to this server, nothing else,
    and no framing by other pages."""

    def hashes(tag: str) -> str:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.S)
        digests = [base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() for b in found]
        return " ".join(f"'sha256-{d}'" for d in digests) or "'none'"

    policy = (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return {
        "Content-Security-Policy": policy,
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
    }


_SCHEMAS: dict[str, Any] = {}  # the request models' schemas, for /openapi.json's components


def _body_schema(model) -> dict:
    """OpenAPI's request body of a route that reads its body itself (in another thread)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _SCHEMAS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _with_schemas(spec: dict) -> dict:
    spec.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMAS)
    return spec


def route_error(path: str, e: RequestError) -> dict:
    """`e` in the error shape of the API `path` belongs to."""
    if path.startswith("/v1/messages"):
        return anthropic_answers.error_body(str(e), e.status)
    if path.startswith("/api/"):
        return ollama.error_body(str(e))
    return e.body()


def _text(decode, token: int) -> str:
    """A token's text for its log-probability ("" for an id the tokenizer lacks: one of a
    padded vocabulary's rows among the top alternatives)."""
    try:
        return decode([token])
    except Exception:
        return ""


def wants_logprob(e) -> bool:
    """An event's token is reported with its log-probability unless it is the end of
    sequence (not part of the text)."""
    return e.logprob is not None and not e.eos


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
