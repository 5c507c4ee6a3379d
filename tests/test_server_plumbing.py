"""The server's plumbing with the real `openai` client: the API key, the "still loading"
answer and CORS, on an app served in this process (no ranks)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from serve_client import http, serving  # noqa: E402

from llama_tp.server.app import build_app  # noqa: E402
from llama_tp.server.runner import create_app  # noqa: E402
from llama_tp.server.scheduler import Scheduler  # noqa: E402

KEY = "sesame"
ORIGIN = "https://app.example"


def client(base: str, key: str = KEY, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30, **kw)


@pytest.fixture(scope="module")
def served(tiny_dir):
    """The tiny model behind an API key, browsers allowed from ORIGIN."""
    from llama_tp import load

    model, tokenizer = load(tiny_dir)
    app = create_app(model, tokenizer, model_name="tiny", api_key=KEY, cors=[ORIGIN])
    with serving(app) as base:
        yield base


def test_the_api_key_guards_every_route(served):
    assert [m.id for m in client(served).models.list().data] == ["tiny"]
    for key in ("wrong", KEY + "x", KEY[:-1]):
        c = client(served, key)
        with pytest.raises(openai.AuthenticationError) as e:
            c.models.list()
        assert e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model="m", prompt="hi")
    # A bad key is refused before the body is looked at.
    code, text = http(f"{served}/v1/chat/completions", {"temperature": "hot"})
    assert code == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    assert http(f"{served}/health")[0] == 200  # probes need no key


def test_validation_errors_name_openais_param(served):
    c = client(served)
    hi = [{"role": "user", "content": "hi"}]
    for kw, param in [
        ({"temperature": 3}, "temperature"),
        ({"extra_body": {"top_k": -1}}, "top_k"),  # not an openai argument: passed on
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", **{"messages": hi, **kw})
        assert e.value.body["param"] == param, e.value.body
        assert e.value.body["type"] == "invalid_request_error"


def test_cors_for_the_allowed_origin_only(served):
    allowed = client(served, default_headers={"Origin": ORIGIN})
    r = allowed.models.with_raw_response.list()
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = client(served, default_headers={"Origin": "https://elsewhere.example"})
    assert "access-control-allow-origin" not in other.models.with_raw_response.list().headers
    # A browser's preflight: answered without the key (browsers send none there).
    headers = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    import urllib.request

    req = urllib.request.Request(f"{served}/v1/chat/completions", method="OPTIONS", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in r.headers["access-control-allow-methods"]


def test_no_cors_headers_without_cors():
    app = build_app(Scheduler())
    with serving(app) as base:
        c = client(base, default_headers={"Origin": ORIGIN})
        with pytest.raises(openai.APIStatusError) as e:
            c.models.list()
        assert "access-control-allow-origin" not in e.value.response.headers


def test_still_loading_is_one_answer_everywhere():
    scheduler = Scheduler()
    app = build_app(scheduler, api_key=KEY)
    with serving(app) as base:
        c = client(base)
        calls = [
            lambda: c.models.list(),
            lambda: c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]
            ),
            lambda: c.completions.create(model="m", prompt="hi"),
        ]
        for call in calls:
            with pytest.raises(openai.APIStatusError) as e:
                call()
            assert e.value.status_code == 503, e.value
            assert e.value.body["code"] == "loading" and "still loading" in e.value.message
        code, text = http(f"{base}/health")
        assert code == 503 and json.loads(text) == {"status": "loading"}
        with pytest.raises(openai.AuthenticationError):  # the key is checked first
            client(base, "wrong").models.list()
        scheduler.request_stop("the server is shutting down")
        with pytest.raises(openai.APIStatusError) as e:
            c.models.list()
        assert e.value.status_code == 503 and e.value.body["code"] == "unavailable"
        assert json.loads(http(f"{base}/health")[1]) == {"status": "stopping"}
