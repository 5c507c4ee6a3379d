"""Issue #37's most important hostile inputs against `python -m llama_tp.serve` on 2
ranks (the built-in model): the request that used to stop every rank, a grammar that
fails mid-reply on every rank at once (the step loop's guard), grammars every rank
compiles before their requests join, bodies refused before they are read, and generated
malformed bodies; after each, both ranks serve the same greedy text."""

from __future__ import annotations

import json
import random
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from hostile import ROUTES, Normal, malformed, message, post, raw, token_ids  # noqa: E402
from serve_client import Server  # noqa: E402

pytestmark = [pytest.mark.ranks, pytest.mark.exclusive]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(default_gguf, tmp_path_factory):
    s = Server(
        2,
        default_gguf,
        tmp_path_factory.mktemp("hostile-ranks"),
        "--max-tokens",
        "8",
        launcher="llama_tp",
    )
    try:
        s.wait_ready(180)
        yield s, Normal(s)
    finally:
        s.close()


def failure(call) -> tuple[int | None, str]:
    try:
        call()
    except openai.APIError as e:
        return getattr(e, "status_code", None), e.message
    raise AssertionError("the call succeeded")


def test_a_huge_penalty_context_stops_no_rank(served):
    s, normal = served
    c = s.client(timeout=300)  # 2 ranks on a busy machine can be slow
    x = {"repetition_context_size": 2**31 + 1, "presence_penalty": 1.0}
    for call in (
        lambda: c.chat.completions.create(model="m", messages=HI, extra_body=x),
        lambda: c.completions.create(model="m", prompt="hi", stream=True, extra_body=x),
    ):
        status, text = failure(call)  # refused while prepared: before any stream starts
        assert status == 400 and "repetition_context_size" in text, text
    assert s.proc.poll() is None
    assert normal.ask()[1] == normal.text


def test_a_grammar_failing_mid_reply_ends_that_reply_on_every_rank(served):
    s, normal = served
    c = s.client(timeout=300)  # 2 ranks on a busy machine can be slow
    wide = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(600)}}
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": wide},
        "required": ["a", "b"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    (quote,) = token_ids(s.model, '"')
    kw = dict(
        model="m",
        messages=HI,
        max_tokens=16,
        response_format=fmt,
        extra_body={"logit_bias": {str(quote): 100}},
    )

    def ask():
        return failure(lambda: c.chat.completions.create(**kw))

    def plain():  # the same requests without their schema: the batch's own load
        return c.chat.completions.create(model="m", messages=HI, max_tokens=16)

    for status, text in normal.beside(ask, n=2, like=plain):
        assert status == 400 and "'response_format' failed while generating" in text, text
    assert s.proc.poll() is None


def test_every_rank_compiles_grammars_before_their_requests_join(served):
    s, normal = served
    c = s.client(timeout=300)  # 2 ranks on a busy machine can be slow
    salts = iter(range(1000))

    def ask():
        salt = next(salts)
        options = [{"const": f"option-{salt}-{i}"} for i in range(1000)]
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": options}}}
        r = c.chat.completions.create(model="m", messages=HI, max_tokens=12, response_format=fmt)
        return r.choices[0].message.content

    def plain():
        return c.chat.completions.create(model="m", messages=HI, max_tokens=12)

    answers = normal.beside(ask, n=8, like=plain)
    assert all(a.startswith('"option-') for a in answers), answers


def test_bodies_refused_before_they_reach_the_ranks(served):
    s, normal = served
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat"):
        status, text = post(s, path, b"[" * 100_000)
        assert status == 400 and "deeper than 64" in message(text), (path, text)
    status, text = post(s, "/v1/completions", b'{"prompt": "\\ud800"}')
    assert status == 400 and "lone surrogate" in message(text), text
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(40_000)]
    body = json.dumps({"messages": HI, "tools": tools, "tool_choice": "none"}).encode()
    for status, text in normal.beside(lambda: post(s, "/v1/chat/completions", body), n=4):
        assert status == 400 and "'tools': 40000 tools; at most 512" in message(text), text
    status, _, _ = raw(
        s,
        "POST",
        "/api/chat",
        json.dumps(ROUTES["/api/chat"]).encode(),
        {"Content-Type": "text/plain"},
    )
    assert status == 401  # the key first, then the content type


def test_generated_malformed_bodies_get_no_5xx_on_two_ranks(served):
    s, normal = served
    rng = random.Random(3702)
    deadline, sent = time.monotonic() + 5, 0
    while time.monotonic() < deadline:
        path = rng.choice(list(ROUTES))
        data, headers = malformed(rng, ROUTES[path])
        try:
            status, _, text = raw(s, "POST", path, data, headers, timeout=5)
        except TimeoutError:
            assert raw(s, "GET", "/health", timeout=5)[0] == 200, (path, data[:300])
            continue
        assert status < 500, (path, data[:300], text)
        sent += 1
    assert sent > 20 and s.proc.poll() is None
    assert normal.ask()[1] == normal.text
