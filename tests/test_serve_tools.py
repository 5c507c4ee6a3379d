"""Tool calls, structured output and the logits processors, through the real `openai`
client against `python -m llama_tp.serve` on 1 and 2 ranks.

The tiny model is served with three chat templates, one per tool-call format
(Hermes `<tool_call>` JSON as Qwen's, Mistral's `[TOOL_CALLS]`, Llama 3.x's bare
JSON): `tool_choice` naming a function makes the random model write a call in
the template's format (constrained by llguidance), which must come back as
structured `tool_calls`, streamed and not. The built-in model answers JSON-schema
requests with text that validates, the same on 1 and 2 ranks.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
from serve_client import KEY, Server, chat, http  # noqa: E402

TIMEOUT = 300  # seconds a request may take: the machine may be shared

HERMES = (  # Qwen2.5's way: tools in <tools>, calls in <tool_call>, results as tool turns
    "{% if tools %}<|system|>\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    '\n</tools>\nCall a tool as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>'
    "</s>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>"
    "{% for tool_call in m.tool_calls %}{% if tool_call.function %}"
    "{% set tool_call = tool_call.function %}{% endif %}\n<tool_call>\n"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}</s>\n"
    "{% elif m.role == 'tool' %}<|tool|>\n<tool_response>{{ m.content }}</tool_response></s>\n"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MISTRAL = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]["
    "{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "{% endfor %}]</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% elif m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)
LLAMA3 = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nFunctions:"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\nAnswer a call as "
    '{"name": function name, "parameters": its arguments}</s>{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}</s>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}</s>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}</s>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TEMPLATES = {"hermes": HERMES, "mistral": MISTRAL, "llama3": LLAMA3}

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


def _model(tiny_dir: Path, root: Path, name: str) -> Path:
    d = root / name
    shutil.copytree(tiny_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATES[name]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    config = json.loads((d / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # tools take room: the tokenizer is tiny
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def servers(tiny_dir, default_gguf, tmp_path_factory):
    """Tiny models with each tool template (hermes also on 2 ranks), the built-in model
    on 1 and 2 ranks."""
    root = tmp_path_factory.mktemp("tools")
    dirs = {name: _model(tiny_dir, root, name) for name in TEMPLATES}
    started = {(name, 1): Server(1, d, root) for name, d in dirs.items()}
    started[("hermes", 2)] = Server(2, dirs["hermes"], root, launcher="llama_tp")
    started[("builtin", 1)] = Server(1, default_gguf, root)
    started[("builtin", 2)] = Server(2, default_gguf, root, launcher="llama_tp")
    try:
        for s in started.values():
            s.wait_ready(180)
        yield started, dirs
    finally:
        for s in started.values():
            s.close()


def _calls(client, stream: bool, **kw) -> tuple[list[tuple[str, dict]], str, str | None]:
    """([(name, arguments)], finish_reason, content) of a chat with tools."""
    kw = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 200, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        assert all(c.id and c.type == "function" for c in m.tool_calls or [])
        return calls, r.choices[0].finish_reason, m.content
    calls, finish, content = {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content.append(ch.delta.content or "")
            for c in ch.delta.tool_calls or []:
                calls[c.index] = (c.function.name, json.loads(c.function.arguments))
    return [calls[i] for i in sorted(calls)], finish, "".join(content) or None


def _renders(model_dir: Path, messages: list[dict], tools=None) -> tuple[str, int]:
    """The chat template's text and token count, rendered here as the server must."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from llama_tp.checkpoints.chat_template import renderer_for

    r = renderer_for(load_tokenizer(model_dir))
    return r.apply(messages, tokenize=False, tools=tools), len(r.apply(messages, tools=tools))


def test_tools_reach_the_template_and_calls_come_back_in_each_format(servers):
    started, dirs = servers
    for name, d in dirs.items():
        c = started[(name, 1)].client(timeout=TIMEOUT)
        text, n = _renders(d, ASK, TOOLS)
        assert "get_weather" in text and "The time of day" in text
        r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=1)
        assert r.usage.prompt_tokens == n > _renders(d, ASK)[1], name
        # A named function: the model writes one call in the template's format.
        calls, finish, content = _calls(c, False, tool_choice=FORCE)
        assert finish == "tool_calls" and content is None, (name, calls, content)
        assert len(calls) == 1 and calls[0][0] == "get_weather", name
        assert calls[0][1]["city"] in ("Paris", "Tokyo", "Lima")
        assert _calls(c, True, tool_choice=FORCE) == (calls, "tool_calls", None), name
        # "required": any of the tools
        calls, finish, _ = _calls(c, True, tool_choice="required")
        assert finish == "tool_calls" and calls[0][0] in ("get_weather", "get_time"), name
        # The call and its result go back into the template.
        turn = ASK + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ]
        rendered = [m if m["role"] != "assistant" else _as_template(m) for m in turn]
        text, n = _renders(d, rendered, TOOLS)
        assert "sunny, 21 C" in text and '"city": "Paris"' in text
        r = c.chat.completions.create(model="m", messages=turn, tools=TOOLS, max_tokens=1)
        assert r.usage.prompt_tokens == n, name


def _as_template(m: dict) -> dict:
    """An assistant message as the template gets it: arguments as a dict."""
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]
    return {**m, "content": "", "tool_calls": calls}


def test_tool_calls_the_same_on_1_and_2_ranks(servers):
    started, _ = servers
    one, two = (
        started[("hermes", 1)].client(timeout=TIMEOUT),
        started[("hermes", 2)].client(timeout=TIMEOUT),
    )
    for kw in ({"tool_choice": FORCE}, {"tool_choice": "required", "temperature": 1.0}):
        kw.setdefault("seed", 7)
        assert _calls(one, False, **kw) == _calls(two, False, **kw)
        assert _calls(one, True, **kw) == _calls(two, True, **kw)


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
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
    ]  # fmt: skip
    for key in (("hermes", 2), ("builtin", 2)):
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
    # A forced call whose function's parameters llguidance cannot compile names `tools`.
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
    status, body = http(
        f"{started[('hermes', 2)].base}/v1/chat/completions",
        {"messages": ASK, "tools": [bad], "tool_choice": "required"},
        {"Authorization": f"Bearer {KEY}"},
    )
    assert status == 400 and json.loads(body)["error"]["param"] == "tools", body
