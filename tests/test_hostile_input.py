"""No request can take the server down, starve the others or get a 500: issue #37's
hostile inputs against `python -m llama_tp.serve` on the built-in model (one process),
through the real clients (`openai`, `anthropic`, `ollama`) where they can send the
request and raw HTTP otherwise. Each case checks the status and the message, that a
normal request sent beside it gets its own greedy text within a bound of its time alone
(tests/hostile.py: `Normal.beside`), and the server's memory after the large ones; then
generated malformed bodies go to every route. One server serves the whole module."""

from __future__ import annotations

import json
import random
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")
from hostile import (  # noqa: E402
    AUTH,
    GETS,
    JSON,
    ROUTES,
    Normal,
    declared_only,
    malformed,
    message,
    post,
    raw,
    resident,
    token_ids,  # noqa: E402
)
from serve_client import KEY, Server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]
MB = 1 << 20
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(default_gguf, tmp_path_factory):
    """(the server, its normal request): the built-in model on one process; requests
    that say nothing generate 8 tokens at most."""
    s = Server(
        1,
        default_gguf,
        tmp_path_factory.mktemp("hostile"),
        "--max-tokens",
        "8",
        "--allowed-hosts",
        "llm.example",
    )
    try:
        s.wait_ready()
        yield s, Normal(s)
    finally:
        s.close()


def claude(s: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=s.base, api_key=KEY, max_retries=0, timeout=120)


def ollama_client(s: Server) -> ollama.Client:
    return ollama.Client(host=s.base, headers=AUTH, timeout=120)


def bad_request(call) -> tuple[int, str]:
    """(status, message) of a client call that must fail with a 4xx."""
    try:
        call()
    except (openai.APIError, anthropic.APIError) as e:  # a stream's error event has no status
        return getattr(e, "status_code", None), e.message
    except ollama.ResponseError as e:
        return e.status_code, e.error
    raise AssertionError("the call succeeded")


def test_a_huge_penalty_context_is_a_400_naming_it(served):
    s, normal = served
    c = s.client()
    huge = {"repetition_context_size": 2**31 + 1}
    for penalty in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        x = {**huge, penalty: 1.5}
        calls = [
            lambda x=x: c.chat.completions.create(model="m", messages=HI, extra_body=x),
            lambda x=x: c.completions.create(model="m", prompt="hi", extra_body=x),
            lambda x=x: c.chat.completions.create(
                model="m", messages=HI, stream=True, extra_body=x
            ),
        ]
        for call in calls:
            status, text = bad_request(call)
            assert status == 400 and "repetition_context_size" in text, text
    # Within the context, the penalties apply (mlx-lm's, over the whole reply here).
    r = c.chat.completions.create(
        model="m",
        messages=HI,
        max_tokens=4,
        extra_body={"repetition_context_size": 8192, "repetition_penalty": 1.3},
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    status, text = post(s, "/v1/chat/completions", {"messages": HI, **huge, "top_k": 10**6})
    assert status == 400 and "(the model's" in message(text), text
    assert normal.ask()[1] == normal.text


def test_forty_thousand_tools_are_refused_by_count_beside_a_normal_request(served):
    s, normal = served
    fn = {"parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}
    tools = [{"type": "function", "function": {"name": f"f{i}", **fn}} for i in range(40_000)]
    before = resident(s.proc.pid)
    # 200,000 objects: refused on a count of the body's brackets, before it is parsed.
    body = json.dumps({"messages": HI, "tools": tools, "tool_choice": "none"}).encode()
    assert len(body) > 5_000_000
    for status, text in normal.beside(lambda: post(s, "/v1/chat/completions", body), n=4):
        assert status == 400 and "the body holds 200004 JSON objects" in message(text), text
    # 5,000: parsed, and refused on their count before they are validated.
    body = json.dumps({"messages": HI, "tools": tools[:5000], "tool_choice": "none"}).encode()
    for status, text in normal.beside(lambda: post(s, "/v1/chat/completions", body), n=4):
        assert status == 400 and "'tools': 5000 tools; at most 512" in message(text), text
    # The Anthropic client, the same bound.
    few = [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(600)]
    status, text = bad_request(
        lambda: claude(s).messages.create(model="m", max_tokens=2, messages=HI, tools=few)
    )
    assert status == 400 and "tools: 600 tools" in text, text
    # At the limit, a name defined twice is found in one pass.
    dup = [*tools[:511], tools[3]]
    status, text = post(s, "/v1/chat/completions", {"messages": HI, "tools": dup})
    assert status == 400 and "'f3' is defined twice" in message(text), text
    assert resident(s.proc.pid) < before + 200 * MB


def test_huge_prompts_are_refused_by_size_before_they_are_tokenized(served):
    s, normal = served
    before = resident(s.proc.pid)
    huge = "word " * (4 * MB)  # 20 MB: past the body limit, refused unread
    cases = [
        ("/v1/messages", {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}),
        ("/api/generate", {"prompt": huge, "stream": False}),
        ("/v1/completions", {"prompt": huge}),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": huge}]}),
    ]
    for path, body in cases:
        status, text = normal.beside(lambda: post(s, path, body))[0]  # noqa: B023
        assert status == 413 and "at most 8388608 are read" in message(text), (path, text)
    # 2 MB: read, and refused by the size of its text, before the tokenizer sees it.
    big = "word " * (400 * 1024)
    for path, body in [
        ("/v1/completions", {"prompt": big}),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": big}]}),
        ("/api/chat", {"messages": [{"role": "user", "content": big}]}),
    ]:
        t0 = time.monotonic()
        status, text = normal.beside(lambda: post(s, path, body), n=2)[0]  # noqa: B023
        assert status == 400, (path, text)
        assert "the prompt's text is 2048000 bytes, but at most 1327104" in message(text), text
        assert time.monotonic() - t0 < 30
    # 600 KB fits by size: tokenized off the event loop, then refused by its tokens.
    mid = "word " * (120 * 1024)
    for status, text in normal.beside(lambda: post(s, "/v1/completions", {"prompt": mid}), n=2):
        assert status == 400, text
        assert "tokens, but the model's context is 8192 tokens" in message(text), text
    status, text = post(
        s, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": mid}]}
    )
    assert status == 200 and json.loads(text)["input_tokens"] > 122880, text
    assert resident(s.proc.pid) < before + 200 * MB


def test_concurrent_large_schemas_wait_for_their_own_grammars(served):
    s, normal = served
    c = s.client()

    def schema(n: int, salt: int) -> dict:
        options = [{"const": f"option-{salt}-{i}"} for i in range(n)]
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": options}}}

    def ask(fmt: dict):
        r = c.chat.completions.create(model="m", messages=HI, max_tokens=12, response_format=fmt)
        return r.choices[0].message.content

    salts = iter(range(1000))

    def plain():  # the same requests without their schemas: the batch's own load
        return c.chat.completions.create(model="m", messages=HI, max_tokens=12)

    answers = normal.beside(lambda: ask(schema(1000, next(salts))), n=8, like=plain)
    assert all(a.startswith('"option-') for a in answers), answers
    # Past the size a schema may have: 400 naming it, nothing compiled.
    status, text = bad_request(lambda: ask(schema(3000, 0)))
    assert status == 400 and "'response_format': the schema is" in text, text
    objects = [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(3000)
    ]
    big = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"anyOf": objects}}}
    status, text = bad_request(lambda: ask(big))
    assert status == 400 and "bytes as JSON; at most 32768" in text, text


UNMATCHABLE = {
    "a $ref loop": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a",
    },
    "itself": {"$ref": "#"},
    "a row past the item limit": {
        "type": "object",
        "properties": {f"k{i}": {"type": "integer"} for i in range(600)},
    },
}


def test_schemas_no_reply_can_follow_are_a_400_naming_the_field(served):
    """(A forced tool call's schema is refused alike: tests/test_request_limits.py; the
    built-in model's template shows no tools.)"""
    s, _ = served
    c, ollama_c = s.client(), ollama_client(s)

    def openai_call(sch):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": sch}}
        return c.chat.completions.create(model="m", messages=HI, response_format=fmt)

    for name, sch in UNMATCHABLE.items():
        for call, start in [
            (openai_call, "'response_format' cannot be compiled"),
            (lambda x: ollama_c.chat(model="m", messages=HI, format=x), "format: cannot be"),
        ]:
            status, text = bad_request(lambda call=call, sch=sch: call(sch))
            assert status == 400 and start in text, (name, text)


def test_a_grammar_that_fails_mid_reply_ends_that_reply_with_a_400(served):
    """A schema whose matcher gives way only once the reply reaches its second field (past
    the first free choice, which compiling tries): the step loop's guard ends that
    request with an error naming response_format, never a truncated object reported as
    a normal stop, and the others go on."""
    s, normal = served
    c = s.client()
    wide = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(600)}}
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": wide},
        "required": ["a", "b"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    (quote,) = token_ids(s.model, '"')
    extra = {"logit_bias": {str(quote): 100}}  # "a" is "": the reply reaches "b" at once

    def ask(stream: bool):
        kw = dict(model="m", messages=HI, max_tokens=16, response_format=fmt, extra_body=extra)
        if not stream:
            return c.chat.completions.create(**kw)
        return [ch for ch in c.chat.completions.create(stream=True, **kw)]

    def plain():  # the same requests without their schema: the batch's own load
        return c.chat.completions.create(model="m", messages=HI, max_tokens=16)

    for stream in (False, True):
        hostile = lambda st=stream: bad_request(lambda: ask(st))  # noqa: E731
        for status, text in normal.beside(hostile, n=2, like=plain):
            assert "response_format" in text and "failed while generating" in text, text
            assert "items; max is 2000" in text, text
            assert status == (None if stream else 400), (status, text)


def test_deep_json_is_a_400_naming_the_body_or_the_field(served):
    s, normal = served
    deep = b"[" * 100_000
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/api/chat",
        "/api/generate",
    ):
        status, text = normal.beside(lambda: post(s, path, deep))[0]  # noqa: B023
        assert status == 400 and "nests JSON deeper than 64 levels" in message(text), (path, text)
    nested: object = {}
    for _ in range(100):
        nested = {"a": nested}
    status, text = post(s, "/api/chat", {"messages": HI, "format": nested})
    assert status == 400 and message(text).startswith("format.a.a."), text
    args = "[" * 5000 + "]" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    msgs = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}]
    status, text = bad_request(lambda: s.client().chat.completions.create(model="m", messages=msgs))
    param = "'messages[1].tool_calls[0].function.arguments': JSON nested deeper than 64"
    assert status == 400 and param in text, text


def test_text_that_is_not_unicode_is_a_400(served):
    s, _ = served
    for path, body in [
        ("/v1/completions", b'{"prompt": "a\\ud800b"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
        ("/api/generate", b'{"prompt": "\\ud800", "stream": false}'),
        ("/v1/responses", b'{"input": [{"role": "user", "content": "a\\udc00"}]}'),
        (
            "/v1/messages",
            b'{"max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}',
        ),
    ]:
        status, text = post(s, path, body)
        assert status == 400 and "lone surrogate" in message(text), (path, text)
    status, text = post(s, "/v1/completions", b'{"prompt": "a\\ud800b"}')
    assert json.loads(text)["error"]["param"] == "prompt"
    status, text = post(s, "/v1/completions", b'{"prompt": "\\ud83d\\ude00"}')  # a pair
    assert status == 200, text


def test_browsers_cannot_reach_the_api_from_elsewhere(served):
    s, _ = served
    ok = json.dumps(ROUTES["/api/chat"]).encode()
    hosts = [
        ("evil.example", 403),
        ("evil.example:8080", 403),
        ("localhost:1", 200),
        ("llm.example", 200),
        ("10.1.2.3", 200),
    ]
    for host, expected in hosts:
        status, _, text = raw(s, "GET", "/v1/models", None, {**AUTH, "Host": host})
        assert status == expected, (host, text)
    status, _, text = raw(s, "GET", "/health", None, {"Host": "rebound.example"})
    assert status == 403 and "--allowed-hosts" in message(text)
    for path in ("/api/chat", "/v1/messages", "/v1/chat/completions", "/api/generate"):
        for kind in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {**AUTH, **({"Content-Type": kind} if kind else {})}
            status, _, text = raw(s, "POST", path, ok, headers)
            assert status == 415 and "application/json" in message(text), (path, kind, text)
    status, _, _ = raw(
        s, "POST", "/api/chat", ok, {**AUTH, "Content-Type": "application/json; charset=utf-8"}
    )
    assert status == 200


def test_the_key_comes_before_the_body_and_on_every_route(served):
    s, _ = served
    status, took = declared_only(s, "/v1/chat/completions", 100 * MB, key=False)
    assert status == 401 and took < 10
    status, took = declared_only(s, "/api/chat", 100 * MB, key=True)
    assert status == 413 and took < 10
    ok = json.dumps(ROUTES["/v1/chat/completions"]).encode()
    for scheme in ("bearer", "BEARER", "Bearer"):
        status, _, text = raw(
            s, "POST", "/v1/chat/completions", ok, {**JSON, "Authorization": f"{scheme} {KEY}"}
        )
        assert status == 200, (scheme, text)
    assert raw(s, "GET", "/openapi.json")[0] == 401
    status, _, text = raw(s, "GET", "/openapi.json", None, AUTH)
    assert status == 200 and "/v1/chat/completions" in json.loads(text)["paths"]
    status, headers, _ = raw(s, "GET", "/")
    assert status == 200 and headers["x-frame-options"] == "DENY"
    policy = headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'sha256-" in policy
    assert "frame-ancestors 'none'" in policy and "connect-src 'self'" in policy
    for path in GETS:
        status = raw(s, "GET", path)[0]
        assert status == (200 if path in ("/health", "/") else 401), path


BEYOND = [  # more fields of the same kinds, each a 400 naming the field
    ({"logit_bias": {"²": 1}}, "logit_bias"),  # str.isdigit() takes it, int() does not
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"top_k": 49153}, "top_k"),
    ({"stop": ["x" * 1001]}, "stop"),
    ({"repetition_context_size": 8193, "presence_penalty": 1}, "repetition_context_size"),
    ({"messages": HI * 8193}, "messages"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
]


def test_more_fields_of_the_same_kinds(served):
    s, normal = served
    for change, param in BEYOND:
        status, text = post(s, "/v1/chat/completions", {"messages": HI, **change})
        assert status == 400 and json.loads(text)["error"]["param"] == param, (change, text)
    status, text = post(s, "/v1/chat/completions", b'{"messages": [], "temperature": NaN}')
    assert status == 400 and "NaN is not a JSON value" in message(text), text
    # Ollama's options are held to the same bounds, named as Ollama names them.
    status, text = bad_request(
        lambda: ollama_client(s).chat(model="m", messages=HI, options={"repeat_penalty": -1.0})
    )
    assert status == 400 and text.startswith("options.repeat_penalty:"), text
    status, text = bad_request(
        lambda: ollama_client(s).generate(model="m", prompt="hi", options={"top_k": 10**6})
    )
    assert status == 400 and text.startswith("options.top_k: must be from 0 to 49152"), text
    status, text = bad_request(
        lambda: claude(s).messages.create(
            model="m", max_tokens=2, messages=HI, stop_sequences=["y" * 2000]
        )
    )
    assert status == 400 and "stop_sequences: strings must have at most 1000" in text, text
    assert normal.ask()[1] == normal.text


def test_generated_malformed_bodies_get_no_5xx(served):
    """A property: whatever body comes, on any route, the answer is not a 5xx and the
    server keeps serving (seeded; bounded to 10 s)."""
    s, normal = served
    rng = random.Random(37)
    deadline, sent, seen = time.monotonic() + 10, 0, set()
    while time.monotonic() < deadline:
        path = rng.choice(list(ROUTES))
        data, headers = malformed(rng, ROUTES[path])
        try:
            status, _, text = raw(s, "POST", path, data, headers, timeout=5)
        except TimeoutError:  # a valid request that generates long (a huge max_tokens)
            assert raw(s, "GET", "/health", timeout=5)[0] == 200, (path, data[:300])
            continue
        assert status < 500, (path, data[:300], text)
        seen.add(status)
        sent += 1
    for path in GETS:
        assert raw(s, "GET", path, None, AUTH)[0] == 200, path
    assert sent > 50 and {400, 415} <= seen, (sent, seen)
    assert normal.ask()[1] == normal.text
