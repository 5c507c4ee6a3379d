"""The front door: a FastAPI app that stays up while the ranks behind it come and go.

Every API route (/v1/..., /api/...) is proxied to rank 0's server on its private port.
A request waits in `Supervisor.admit` while no generation serves, and is replayed there
when the ranks fail before it has shown its client anything: an error answer from
them (503) or no answer, or a stream that had sent no output yet (`streams.Events`).
A stream that has sent output ends with an error event naming the fault instead.
The front door answers itself: `/health` (200 while serving, 503 with the state
otherwise), `GET /` (the chat page), `/v1/status` (rank 0's last status with a
`supervisor` section), `/metrics` (rank 0's and the supervisor's), and
`POST /v1/supervisor/restart` (a planned restart on every host). The API key guards
everything but the page and /health, as on the server itself.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations.

import asyncio
import contextlib
from pathlib import Path

from ..server.app import route_error
from ..server.guard import Guard, Hosts, key_matches
from .admission import ClientGone, Unavailable
from .control import Supervisor
from .streams import ERROR, OUTPUT, Events, api_of, error_body, is_stream

MAX_REPLAYS = 3  # a request interrupted by more faults than this gets the last one's 503
PAGE = Path(__file__).resolve().parent.parent / "server" / "page" / "index.html"
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
        "upgrade", "accept-encoding", "proxy-authorization"}  # fmt: skip
FRONT_BODY = 64 << 20  # the largest body the front reads, without --max-body-bytes
_PASSED = ("content-type", "cache-control", "x-accel-buffering", "retry-after")


class _Gone(Exception):
    """Rank 0 failed this attempt before it showed the client anything: replay."""


def build_front(sup: Supervisor, client):
    """The front door's app for `sup`; `client` (httpx2.AsyncClient) reaches rank 0."""
    import httpx2
    from fastapi import FastAPI, Request
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

    from .metrics import supervisor_metrics

    spec = sup.spec
    app = FastAPI(title="llama_tp supervisor", docs_url=None, redoc_url=None, openapi_url=None)
    # The server's guard (server/guard.py) at the door browsers reach: the Host a request
    # names (rank 0 sees the front's own), the key before the body is read, a JSON body of
    # a bounded size (rank 0 holds it to the model's own bound after).
    app.add_middleware(
        Guard,
        hosts=Hosts(spec.host, spec.allowed_hosts),
        api_key=spec.api_key,
        max_body=lambda: spec.max_body or FRONT_BODY,
        error=route_error,
    )
    if spec.cors:
        app.add_middleware(
            CORSMiddleware, allow_origins=spec.cors, allow_methods=["*"], allow_headers=["*"]
        )

    def denied(request: Request):
        """401 in the route's shape unless the request carries the API key."""
        if spec.api_key is None:
            return None
        if key_matches({k.lower(): v for k, v in request.headers.items()}, spec.api_key):
            return None
        message = "invalid or missing API key (Authorization: Bearer ... or x-api-key: ...)"
        body = error_body(api_of(request.url.path), message, 401)
        if "error" in body and isinstance(body["error"], dict) and "code" in body["error"]:
            body["error"].update(type="invalid_request_error", code="invalid_api_key")
        return JSONResponse(body, status_code=401)

    def unavailable(path: str, e: Unavailable):
        headers = {} if e.retry_after is None else {"Retry-After": str(e.retry_after)}
        return JSONResponse(error_body(api_of(path), str(e), 503), 503, headers=headers)

    @app.get("/health")
    async def health():
        if sup.serving:
            return {"status": "ok", "state": sup.state}
        return JSONResponse({"status": sup.state}, 503)

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text(), headers={"Cache-Control": "no-cache"})

    @app.get("/v1/status")
    async def status(request: Request):
        return denied(request) or status_body()

    def status_body() -> dict:
        body = dict(sup.rank_status or skeleton(len(sup.current.hosts)))
        if not sup.serving:  # its ranks are gone: their figures are history
            body.update(ranks=[], running=0, tokens_per_second=0.0, queue=sup.held)
            body["state"] = sup.state
        body["supervisor"] = sup.status()
        return body

    @app.get("/metrics")
    async def metrics(request: Request):
        if (no := denied(request)) is not None:
            return no
        text = b""
        if sup.serving:
            with contextlib.suppress(Exception):
                r = await client.get(f"{sup.base}/metrics", headers=sup.headers, timeout=5.0)
                text = r.content if r.status_code == 200 else b""
        ours, content_type = supervisor_metrics(sup)
        return Response(text + ours, media_type=content_type)

    @app.post("/v1/supervisor/restart")
    async def restart(request: Request):
        if (no := denied(request)) is not None:
            return no
        if not sup.request_restart():
            return JSONResponse(
                error_body("openai", f"a restart cannot start now: the server is {sup.state}", 409),
                409,
            )
        return JSONResponse({"object": "supervisor.restart", "state": "restarting"}, 202)

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]

    @app.api_route("/{path:path}", methods=methods)
    async def proxy(request: Request, path: str):
        path = "/" + path
        if path.startswith(("/v1/", "/api/")) and (no := denied(request)) is not None:
            return no
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        after, replays, held = 0, 0, False
        while True:
            held = held or not (sup.serving and sup.generation > after)
            try:
                gen = await sup.admit(after, replays > 0, request.is_disconnected)
                answer = await attempt(request, f"{sup.base}{path}", headers, body, gen, held)
            except Unavailable as e:
                return unavailable(path, e)
            except ClientGone:
                return Response(status_code=499)
            except _Gone as e:
                sup.suspect(gen, str(e))
                replays += 1
                after = gen
                if replays > MAX_REPLAYS:
                    message = f"the request was interrupted by {replays} faults; the last: "
                    message += await sup.fault_text(gen)
                    return unavailable(path, Unavailable(message, sup.retry_after()))
                continue
            if answer is not None:
                return answer
            await asyncio.sleep(0.25)  # rank 0's queue was full for a held request

    async def attempt(request: Request, url: str, headers: dict, body: bytes, gen: int, held: bool):
        """One try at rank 0 of `gen`: the answer, None (retry: its queue is full and the
        request was held), or _Gone (replay after recovery)."""
        req = client.build_request(
            request.method, url, params=request.query_params, headers=headers, content=body
        )
        sup.inflight += 1
        done = False
        try:
            try:
                up = await client.send(req, stream=True)
            except httpx2.HTTPError as e:
                raise _Gone(f"did not answer ({type(e).__name__})") from None
            try:
                if up.status_code == 503:
                    raise _Gone(f"answered 503: {_message(await _read(up))}")
                if up.status_code == 429 and held:
                    return None
                passed = {k: v for k, v in up.headers.items() if k.lower() in _PASSED}
                content_type = up.headers.get("content-type", "")
                if not is_stream(content_type):
                    data = await _until_done(request, up)
                    if up.status_code < 400:
                        sup.answered(gen)
                    return Response(data, up.status_code, headers=passed)
                events = Events(api_of(request.url.path), content_type)
                chunks = up.aiter_raw()
                head = await _until_output(events, chunks)
                done = True  # the stream owns the upstream answer and the count now
                return StreamingResponse(
                    relay(head, events, chunks, up, gen), up.status_code, headers=passed
                )
            finally:
                if not done:
                    await up.aclose()
        finally:
            if not done:
                sup.inflight -= 1

    async def relay(head: bytes, events: Events, chunks, up, gen: int):
        """The held head, then the rest as it comes; a fault ends it with an error event."""
        ended = failed = False
        try:
            yield head
            try:
                async for data in chunks:
                    out = []
                    for event in events.feed(data):
                        failed = failed or events.kind(event) == ERROR  # rank 0 failed it
                        if not failed:
                            out.append(event)
                    if out:
                        yield b"".join(out)
                    if failed:
                        break
                else:
                    ended = True
                    if rest := events.rest():
                        yield rest
                    sup.answered(gen)
            except httpx2.HTTPError as e:
                why = f"broke off a stream ({type(e).__name__}: {e})"
            else:
                why = "ended a stream with an error event"
            if not ended:
                sup.suspect(gen, why)
                yield events.fault_event(await sup.end_message(gen))
        finally:
            sup.inflight -= 1
            await up.aclose()

    return app


def skeleton(ranks: int) -> dict:
    """/v1/status before any rank 0 has answered (the server's shape, nothing known)."""
    return {
        "object": "status",
        "model": None,
        "mesh": {"ranks": ranks, "tp": ranks, "pp": 1, "dp": 1},
        "ranks": [],
        "queue": 0,
        "running": 0,
        "max_batch": None,
        "tokens_per_second": 0.0,
        "watchdog": {"active": False, "timeouts": {}, "stage": None, "seconds_left": None},
    }


async def _read(up) -> bytes:
    with contextlib.suppress(Exception):
        return await up.aread()
    return b""


def _message(data: bytes) -> str:
    """The message of a JSON error answer (any API's shape), else its text."""
    import json

    try:
        obj = json.loads(data)
    except ValueError:
        return data.decode(errors="replace")[:200]
    error = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(error, dict):
        return str(error.get("message"))
    return str(error or obj)


async def _until_done(request, up) -> bytes:
    """The whole answer; _Gone if rank 0 fails meanwhile; the client leaving closes it."""
    import httpx2

    read = asyncio.ensure_future(up.aread())
    try:
        while True:
            finished, _ = await asyncio.wait([read], timeout=0.5)
            if finished:
                try:
                    return read.result()
                except httpx2.HTTPError as e:
                    raise _Gone(f"broke off an answer ({type(e).__name__})") from None
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        read.cancel()


async def _until_output(events: Events, chunks) -> bytes:
    """The stream's bytes up to and including its first event with output (or its end):
    _Gone when rank 0 fails before that."""
    import httpx2

    head = []
    try:
        async for data in chunks:
            for event in events.feed(data):
                kind = events.kind(event)
                if kind == ERROR:
                    raise _Gone(f"failed a stream before its first token: {_message(_data(event))}")
                head.append(event)
                if kind == OUTPUT:
                    return b"".join(head)
    except httpx2.HTTPError as e:
        raise _Gone(f"broke off a stream before its first token ({type(e).__name__})") from None
    return b"".join(head) + events.rest()


def _data(event: bytes) -> bytes:
    """An event's JSON: its `data:` line (server-sent events) or itself (a line)."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            return line[5:].strip()
    return event.strip()
