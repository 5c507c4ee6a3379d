"""The supervisor's front door against a stand-in rank 0 (no ranks, no model): what a
client sees when rank 0 fails before or after an answer's first token, requests held
while recovering and the bound on them, the state on /v1/status, /health and /metrics.

The stand-in is a small FastAPI app speaking the server's stream shapes; the front door
and the `Supervisor` run on one event loop in a thread, as in the supervisor's process,
and the test plays the supervisor's loop: it marks faults and recoveries.
"""

# No `from __future__ import annotations`: FastAPI reads the stand-in's annotations.

import asyncio
import json
import threading
import time

import openai
import pytest
from serve_client import KEY, free_port, http

pytest.importorskip("httpx2")

CHUNK = {"object": "chat.completion.chunk", "model": "m", "created": 1, "id": "chatcmpl-1"}


def chunk(delta: dict, finish: str | None = None) -> str:
    body = {**CHUNK, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n"


def stand_in(behaviour: dict):
    """Rank 0's stand-in: each prompt's n-th attempt does behaviour[prompt][n] (the last
    one thereafter): "ok", "503", "error-first" (an error event before any token),
    "error-later" (after two tokens), "drop-later" (the connection drops after two)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    attempts: dict[str, int] = {}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from fastapi.responses import PlainTextResponse

        return PlainTextResponse("llama_tp_queue_depth 0.0\n")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        n = attempts[prompt] = attempts.get(prompt, 0) + 1
        plan = behaviour.get(prompt, ["ok"])
        what = plan[min(n, len(plan)) - 1]
        if what == "503":
            error = {"message": "a rank of the server failed", "type": "server_error"}
            return JSONResponse({"error": error}, 503)
        if not body.get("stream"):
            message = {"role": "assistant", "content": f"answer to {prompt}"}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            return {**CHUNK, "object": "chat.completion", "choices": [choice]}

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            if what == "error-first":
                yield f"data: {json.dumps({'error': {'message': 'failed', 'code': 503}})}\n\n"
                return
            for word in ("answer ", "to ", prompt):
                yield chunk({"content": word})
                await asyncio.sleep(0.05)
                if word == "to " and what == "error-later":
                    yield f"data: {json.dumps({'error': {'message': 'failed'}})}\n\n"
                    return
                if word == "to " and what == "drop-later":
                    raise RuntimeError("rank 0 went away")
            yield chunk({}, "stop")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class Front:
    """The front door and a Supervisor on one loop in a thread; the stand-in beside."""

    def __init__(self, behaviour: dict, max_queue: int = 2):
        import uvicorn

        from llama_tp.supervisor.command import parse
        from llama_tp.supervisor.hosts import layout_of

        self.spec = parse(
            ["-n", "2", "--restart", "-m", "llama_tp.serve", "--api-key", KEY,
             "--max-queue", str(max_queue)]
        )  # fmt: skip
        self.layout = layout_of(self.spec.launcher)
        self.rank0_port, self.port = free_port(), free_port()
        rank0 = uvicorn.Config(stand_in(behaviour), port=self.rank0_port, log_level="error")
        self.rank0 = uvicorn.Server(rank0)
        threading.Thread(target=self.rank0.run, daemon=True).start()
        self.ready = threading.Event()
        threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True).start()
        assert self.ready.wait(30)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while http(f"http://127.0.0.1:{self.rank0_port}/health", timeout=2)[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    async def _main(self):
        import httpx2
        import uvicorn

        from llama_tp.supervisor.control import Supervisor
        from llama_tp.supervisor.front import build_front

        self.loop = asyncio.get_running_loop()
        async with httpx2.AsyncClient(timeout=httpx2.Timeout(None, connect=5.0)) as client:
            self.sup = Supervisor(self.spec, self.layout, client)
            config = uvicorn.Config(
                build_front(self.sup, client), port=self.port, log_level="error", lifespan="off"
            )
            self.server = uvicorn.Server(config)
            self.serve(1)
            task = asyncio.create_task(self.server.serve())
            while not self.server.started:
                await asyncio.sleep(0.01)
            self.ready.set()
            await task

    def serve(self, generation: int) -> None:
        """Play the supervisor's loop: generation `generation` serves."""
        self.sup.generation = generation
        self.sup.base = f"http://127.0.0.1:{self.rank0_port}"
        r = self.sup.recovery
        if r is not None:
            r.described.set()
            r.ready = time.monotonic()
        self.sup._enter("serving")

    def call(self, fn, *args):
        done = threading.Event()
        self.loop.call_soon_threadsafe(lambda: (fn(*args), done.set()))
        assert done.wait(10)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=KEY, max_retries=0, timeout=30)

    def state(self) -> dict:
        code, body = http(f"{self.base}/v1/status", headers={"Authorization": f"Bearer {KEY}"})
        assert code == 200, body
        return json.loads(body)["supervisor"]

    def wait(self, cond, timeout: float = 10) -> dict:
        deadline = time.monotonic() + timeout
        while not cond(s := self.state()):
            assert time.monotonic() < deadline, s
            time.sleep(0.02)
        return s

    def close(self):
        self.server.should_exit = self.rank0.should_exit = True


def ask(client, prompt: str, stream: bool) -> str:
    kw = dict(model="m", messages=[{"role": "user", "content": prompt}])
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    )


@pytest.fixture
def front(request):
    f = Front(getattr(request, "param", {}))
    yield f
    f.close()


def in_thread(fn, *args):
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except Exception as e:  # noqa: BLE001 (the test looks at it)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_answers_pass_through_and_the_state_shows(front):
    c = front.client()
    assert ask(c, "hi", False) == "answer to hi"
    assert ask(c, "hi", True) == "answer to hi"
    s = front.state()
    assert s["state"] == "serving" and s["generation"] == 1 and s["last_fault"] is None
    assert http(f"{front.base}/v1/status")[0] == 401
    assert http(f"{front.base}/health")[0] == 200
    code, text = http(f"{front.base}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert "llama_tp_queue_depth 0.0" in text  # rank 0's
    assert 'llama_tp_supervisor_state{state="serving"} 1.0' in text
    assert "llama_tp_supervisor_restarts_total 0.0" in text


@pytest.mark.parametrize(
    "front, stream",
    [({"x": ["error-first", "ok"]}, True), ({"x": ["503", "ok"]}, False)],
    indirect=["front"],
)
def test_a_request_without_a_token_yet_is_replayed_after_recovery(front, stream):
    t, out = in_thread(ask, front.client(), "x", stream)
    s = front.wait(lambda s: s["state"] == "recovering")
    assert "rank 0" in s["last_fault"]["what"] and s["waiting"] == 1
    assert http(f"{front.base}/health") == (503, '{"status":"recovering"}')
    front.call(front.serve, 2)
    t.join(10)
    assert out == {"value": "answer to x"}  # one clean answer: nothing of the first try


@pytest.mark.parametrize("front", [{"x": ["error-later"]}, {"x": ["drop-later"]}], indirect=True)
def test_a_stream_that_showed_tokens_ends_with_the_fault(front):
    from llama_tp.supervisor.faults import Fault

    words = []
    with pytest.raises(openai.APIError) as e:
        stream = front.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        )
        for c in stream:
            words.append(c.choices[0].delta.content)
            if words == ["", "answer "]:  # the supervisor learns the cause meanwhile
                front.call(front.sup._detect, 1, Fault("was killed by SIGKILL", 1, weight=6))
                front.call(lambda: front.sup.recovery.described.set())
    assert words == ["", "answer ", "to "]
    assert str(e.value) == (
        "a rank of the server failed: rank 1 (host 127.0.0.1) was killed by SIGKILL; the "
        "server is recovering"
    )


def test_new_requests_wait_while_recovering_up_to_the_bound(front):
    from llama_tp.supervisor.faults import Fault

    front.call(front.sup._detect, 1, Fault("exited with code 1", 1, weight=4))
    waiting = [in_thread(ask, front.client(), f"w{i}", i == 0) for i in range(2)]
    front.wait(lambda s: s["waiting"] == 2)
    with pytest.raises(openai.APIStatusError) as e:
        ask(front.client(), "too many", False)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "10"
    assert "recovering" in str(e.value) and "(--max-queue 2)" in str(e.value)
    front.call(front.serve, 2)
    for i, (t, out) in enumerate(waiting):
        t.join(10)
        assert out == {"value": f"answer to w{i}"}
    s = front.state()
    assert s["last_fault"]["what"] == "rank 1 (host 127.0.0.1) exited with code 1"
    assert s["downtime_seconds"] > 0


def test_down_answers_503_with_the_reason(front):
    front.call(front.sup._enter, "down", "cannot re-place m over 1 of 2 hosts: ...")
    with pytest.raises(openai.APIStatusError) as e:
        ask(front.client(), "hi", False)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "5"
    assert str(e.value).endswith("the server is down: cannot re-place m over 1 of 2 hosts: ...")


def test_the_front_door_guards_as_the_server_does(front):
    """The server's guard at the door browsers reach (issue #37): a Host a rebinding page
    names, a key in any case of its scheme, a body that is not JSON."""
    import http.client

    def raw(method: str, path: str, headers: dict, body: bytes | None = None) -> int:
        host, port = front.base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers)
            return conn.getresponse().status
        finally:
            conn.close()

    key = {"Authorization": f"bearer {KEY}"}
    assert raw("GET", "/v1/status", key) == 200
    assert raw("GET", "/v1/status", {**key, "Host": "rebound.example"}) == 403
    assert raw("GET", "/health", {"Host": "rebound.example:80"}) == 403
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    assert raw("POST", "/v1/chat/completions", {**key, "Content-Type": "text/plain"}, body) == 415
    assert raw("POST", "/v1/chat/completions", {"Content-Type": "application/json"}, body) == 401
