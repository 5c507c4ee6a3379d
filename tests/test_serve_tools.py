"""Structured output and the logits processors through the real `openai` client against
`python -m llama_tp.serve` on 1 and 2 ranks: the built-in model answers JSON-schema
requests with text that validates, the same on 1 and 2 ranks; logit bias and the
penalties give the same text on both; bad requests are 400s naming the field.

Tool calls are tested on the releases' own templates: every family's forced calls in
tests/test_family_tools.py, on 2 ranks and through every API in
tests/test_serve_family_ranks.py (their tools, and `Chat`'s, are these: `TOOLS`).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
from serve_client import KEY, Server, chat, http  # noqa: E402

TIMEOUT = 300  # seconds a request may take: the machine may be shared

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, today",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time of day",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCE = {"type": "function", "function": {"name": "get_weather"}}
CITY = {  # the built-in model's answers must validate against this
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def servers(default_gguf, tmp_path_factory):
    """The built-in model on 1 and 2 ranks."""
    root = tmp_path_factory.mktemp("tools")
    started = {("builtin", 1): Server(1, default_gguf, root)}
    started[("builtin", 2)] = Server(2, default_gguf, root, launcher="llama_tp")
    try:
        for s in started.values():
            s.wait_ready(180)
        yield started, {}
    finally:
        for s in started.values():
            s.close()


def _valid(text: str) -> dict:
    """The reply parsed and validated against CITY (jsonschema: ValidationError)."""
    obj = json.loads(text)
    jsonschema.validate(obj, CITY)
    return obj


def test_json_schema_and_json_object_on_the_builtin_model(servers):
    started, _ = servers
    ask = [{"role": "user", "content": "Describe Paris as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    texts = {}
    for n in (1, 2):
        c = started[("builtin", n)].client(timeout=TIMEOUT)
        text, finish, _ = chat(c, "", messages=ask, max_tokens=60, response_format=fmt)
        assert finish == "stop", text
        _valid(text)
        streamed = chat(c, "", messages=ask, max_tokens=60, response_format=fmt, stream=True)
        assert streamed[0] == text
        obj, finish, _ = chat(
            c, "", messages=ask, max_tokens=60, response_format={"type": "json_object"}
        )
        assert finish == "stop" and isinstance(json.loads(obj), dict), obj
        sampled = chat(c, "", messages=ask, max_tokens=60, response_format=fmt,
                       temperature=1.0, seed=3)[0]  # fmt: skip
        _valid(sampled)
        texts[n] = (text, obj, sampled)
    assert texts[1] == texts[2]
    plain = chat(started[("builtin", 1)].client(timeout=TIMEOUT), "", messages=ask, max_tokens=60)[
        0
    ]
    # without the schema, the model writes prose (or JSON of another shape)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        _valid(plain)


def test_logit_bias_and_penalties_on_1_and_2_ranks(servers):
    started, _ = servers
    out = {}
    for n in (1, 2):
        c = started[("builtin", n)].client(timeout=TIMEOUT)
        token = 1000  # "()" in SmolLM2's vocabulary: at +100 it is every token
        biased = chat(c, "Hi", max_tokens=6, logit_bias={str(token): 100})[0]
        count = "Count: one two one two one two"
        plain = chat(c, count, max_tokens=20)[0]
        kw = dict(max_tokens=20, presence_penalty=1.5, frequency_penalty=1.0)
        penalized = chat(c, count, **kw)[0]
        repeated = chat(c, count, max_tokens=20, extra_body={"repetition_penalty": 1.5})[0]
        assert plain not in (penalized, repeated)
        out[n] = (biased, penalized, repeated)
    assert out[1] == out[2]
    assert out[1][0] == "()" * 6


def test_bad_requests_get_their_400_and_the_servers_keep_serving(servers):
    started, _ = servers
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    cases = [
        ({"response_format": bad_schema}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tools"),  # SmolLM2's shows no tools
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ]  # fmt: skip
    for key in (("builtin", 2),):
        s = started[key]
        url = f"{s.base}/v1/chat/completions"
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(
                    lambda case, url=url: http(
                        url,
                        {"messages": ASK, "max_tokens": 4, **case[0]},
                        {"Authorization": f"Bearer {KEY}"},
                    ),
                    cases,
                )
            )
        for (case, param), (status, body) in zip(cases, answers, strict=True):
            assert status == 400, (case, body)
            assert json.loads(body)["error"]["param"] == param, (case, body)
        assert (
            chat(s.client(timeout=TIMEOUT), "hello", max_tokens=3)[1] == "length"
        )  # still serving
