"""The Ollama routes' translations to and from OpenAI's wire shapes, both directions,
without a server: request bodies (tools, options, format), bad bodies' 400s, and
OpenAI stream chunks becoming Ollama's NDJSON lines."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from wire_samples import SCHEMA, TOOL_STREAM  # noqa: E402

from llama_tp.server import ollama  # noqa: E402
from llama_tp.server.protocol import RequestError  # noqa: E402


def test_ollama_chat_body_becomes_the_openai_chat_body():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    body = {
        "model": "llama3.2",
        "keep_alive": "5m",  # ignored
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"function": {"name": "get_time", "arguments": {}}},
                ],
            },
            {"role": "tool", "content": "12:00", "tool_name": "get_time"},
            {"role": "tool", "content": "18 C"},
        ],
        "tools": tools,
        "format": SCHEMA,
        "options": {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "num_predict": 20,
            "seed": 3,
            "stop": ["\n\n"],
            "repeat_penalty": 1.1,
            "num_ctx": 8192,
        },
    }
    out = ollama.chat_body(body, context=2048)
    assert out["messages"][2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_2_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2_1",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    }
    # A tool message names its tool (or nothing): it answers that call, else the first open one.
    assert out["messages"][3] == {
        "role": "tool",
        "content": "12:00",
        "tool_call_id": "call_2_1",
        "name": "get_time",
    }
    assert out["messages"][4] == {"role": "tool", "content": "18 C", "tool_call_id": "call_2_0"}
    assert out["tools"] == tools
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "format", "schema": SCHEMA, "strict": True},
    }
    settings = {
        k: out[k]
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "max_tokens",
            "seed",
            "stop",
            "repetition_penalty",
        )
    }
    assert settings == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "max_tokens": 20,
        "seed": 3,
        "stop": ["\n\n"],
        "repetition_penalty": 1.1,
    }
    assert out["stream"] and out["stream_options"] == {"include_usage": True}
    simple = ollama.chat_body(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "format": "json",
            "options": {"num_predict": -1},
        },
        2048,
    )
    assert simple["response_format"] == {"type": "json_object"} and simple["max_tokens"] == 2048
    assert ollama.chat_body({"model": "m"}, 2048) is None  # "load the model"


def test_ollama_generate_body():
    out, raw = ollama.generate_body(
        {"prompt": "Why?", "system": "Be brief.", "stream": False}, 2048
    )
    assert not raw and out["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
    ]
    out, raw = ollama.generate_body(
        {"prompt": "Once upon", "raw": True, "options": {"num_predict": 4}}, 2048
    )
    assert raw and out["prompt"] == "Once upon" and out["max_tokens"] == 4
    assert ollama.generate_body({"prompt": ""}, 2048) == (None, False)


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
            "messages.0.images",
        ),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ("chat", {"messages": [], "options": {"temperature": "hot"}}, "options.temperature"),
        ("chat", {"messages": [], "options": {"num_predict": 1.5}}, "options.num_predict"),
        ("chat", {"messages": [], "format": "xml"}, "format"),
        ("chat", {"messages": [], "stream": "yes"}, "stream"),
        ("generate", {"prompt": "hi", "images": ["aGk="]}, "images"),
        ("generate", {"prompt": "hi", "suffix": "end"}, "suffix"),
        ("generate", {"prompt": 5}, "prompt"),
    ],
)
def test_a_bad_ollama_body_is_a_400_naming_the_field(route, body, field):
    translate = ollama.chat_body if route == "chat" else ollama.generate_body
    with pytest.raises(RequestError) as e:
        translate(body, 2048)
    assert (
        e.value.status == 400 and e.value.param == field and str(e.value).startswith(f"{field}: ")
    )
    assert ollama.error_body(str(e.value)) == {"error": str(e.value)}


def test_openai_chunks_become_ollama_lines_with_tool_calls():
    reply = ollama.Reply("tiny:latest", chat=True)
    lines = [line for c in TOOL_STREAM for line in reply.feed(c)]
    assert [(x["message"]["content"], x["done"]) for x in lines] == [
        ("Let me ", False),
        ("check.", False),
    ]
    last = reply.end()
    assert last["done"] and last["message"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_time", "arguments": {}}},
        ],
    }
    assert (last["done_reason"], last["prompt_eval_count"], last["eval_count"]) == ("stop", 11, 6)
    assert last["total_duration"] == last["prompt_eval_duration"] + last["eval_duration"] > 0
    whole = reply.whole()
    assert (
        whole["message"]["content"] == "Let me check." and len(whole["message"]["tool_calls"]) == 2
    )
    json.dumps(whole)  # one NDJSON line
    text = ollama.Reply("tiny:latest", chat=False)
    completion_chunks = [
        {"choices": [{"index": 0, "text": t, "finish_reason": f}]}
        for t, f in [("a", None), ("b", "length")]
    ]
    assert [x["response"] for c in completion_chunks for x in text.feed(c)] == ["a", "b"]
    assert (text.whole()["response"], text.whole()["done_reason"]) == ("ab", "length")
