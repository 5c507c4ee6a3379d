"""The Anthropic route's translations to and from OpenAI's wire shapes, both directions,
without a server: request bodies (tool_use / tool_result blocks, tools), answers
carrying tool_calls, and stream chunks read back by the real `anthropic` client's own
stream parser (over an in-memory transport). Ollama's: test_ollama_translation.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from wire_samples import SCHEMA, TOOL_STREAM, USAGE, WEATHER, chunk  # noqa: E402

from llama_tp.server import anthropic as wire  # noqa: E402
from llama_tp.server import anthropic_answers as answers  # noqa: E402
from llama_tp.server.protocol import RequestError  # noqa: E402


def test_anthropic_body_becomes_the_openai_chat_body():
    body = {
        "model": "claude-x",
        "max_tokens": 50,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "metadata": {"user_id": "u1"},  # ignored
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_k": 3,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "stream": True,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "no such city"}],
                    },
                    {
                        "type": "text",
                        "text": "And tomorrow?",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
        ],
    }
    out = wire.openai_body(body)
    assert out["messages"] == [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "hm",  # the thinking handed back: the template's to render
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert out["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": SCHEMA,
            },
        }
    ]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert out["parallel_tool_calls"] is False
    assert (out["max_tokens"], out["stop"], out["temperature"], out["top_k"]) == (
        50,
        ["END"],
        0.5,
        3,
    )
    assert out["stream"] and out["stream_options"] == {"include_usage": True}
    assert "top_p" not in out  # left to the server's default
    # An assistant turn of tool calls alone has no content; tool_choice "any" is "required".
    only = {
        "max_tokens": 5,
        "tools": [WEATHER],
        "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}],
            },
        ],
    }
    out = wire.openai_body(only)
    assert out["messages"][1]["content"] is None and out["tool_choice"] == "required"
    assert "stream" not in out


BAD_MESSAGES = [  # (a change to a good body, the field the 400 names)
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]},
        "messages.0.content.0.type",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages.0.content.0.type",
    ),
    (
        {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
        "messages.0.content.0.type",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        },
        "messages.0.content.0",
    ),
    (
        {
            "messages": [
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}
            ]
        },
        "messages.0.content.0",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}],
                }
            ]
        },
        "messages.0.content.0.input",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}
                    ],
                }
            ]
        },
        "messages.0.content.0.content.0.type",
    ),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"system": [{"type": "image"}]}, "system.0.type"),
    ({"stop_sequences": ["a"] * 17}, "stop_sequences"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
]


@pytest.mark.parametrize("change, field", BAD_MESSAGES)
def test_a_bad_anthropic_body_is_a_400_naming_the_field(change, field):
    good = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    body = {k: v for k, v in {**good, **change}.items() if v is not None}
    with pytest.raises(RequestError) as e:
        wire.openai_body(body)
    assert e.value.status == 400 and e.value.param == field
    assert str(e.value).startswith(f"{field}: "), str(e.value)
    shape = answers.error_body(str(e.value), 400)
    assert shape == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": str(e.value)},
    }


def completion(message: dict, finish: str, stop=None, cached: int = 0) -> dict:
    choice = {"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop}
    usage = {
        "prompt_tokens": 20,
        "completion_tokens": 7,
        "total_tokens": 27,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return {
        "id": "chatcmpl-9-1",
        "object": "chat.completion",
        "model": "tiny",
        "choices": [choice],
        "usage": usage,
    }


def test_an_openai_answer_becomes_an_anthropic_message():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    m = answers.message(
        completion({"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"), []
    )
    assert m["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
    ]
    assert (m["stop_reason"], m["stop_sequence"], m["type"], m["role"]) == (
        "tool_use",
        None,
        "message",
        "assistant",
    )
    assert m["id"] == "msg_9-1" and m["model"] == "tiny"
    assert m["usage"] == {
        "input_tokens": 20,
        "output_tokens": 7,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    text = {"role": "assistant", "content": "Hi"}
    assert answers.message(completion(text, "length"), [])["stop_reason"] == "max_tokens"
    m = answers.message(completion(text, "stop", "END", cached=15), ["END"])
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", "END")
    assert m["content"] == [{"type": "text", "text": "Hi"}]
    assert (m["usage"]["input_tokens"], m["usage"]["cache_read_input_tokens"]) == (5, 15)
    # The template's own end marker is not one of the request's stop sequences.
    assert (
        answers.message(completion(text, "stop", "<|im_end|>"), ["END"])["stop_reason"]
        == "end_turn"
    )
    assert answers.message(completion(text, "stop"), [])["stop_reason"] == "end_turn"


def events_of(stream: list[dict], stops: list[str]) -> str:
    events = answers.Events(stops)
    return "".join(e for c in stream for e in events.feed(c)) + "".join(events.end())


def anthropic_client(sse: str):
    """The real Anthropic client, its requests answered with `sse` in memory."""
    anthropic = pytest.importorskip("anthropic")
    import httpx2

    def reply(request):
        return httpx2.Response(
            200, headers={"content-type": "text/event-stream"}, content=sse.encode()
        )

    http = httpx2.Client(transport=httpx2.MockTransport(reply))
    return anthropic.Anthropic(api_key="k", base_url="http://test", http_client=http, max_retries=0)


def test_openai_stream_chunks_become_the_event_sequence_anthropics_client_reads():
    sse = events_of(TOOL_STREAM, [])
    names = [line[len("event: ") :] for line in sse.splitlines() if line.startswith("event: ")]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    client = anthropic_client(sse)
    with client.messages.stream(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    ) as s:
        texts = list(s.text_stream)
        m = s.get_final_message()
    assert texts == ["Let me ", "check."]
    assert [b.type for b in m.content] == ["text", "tool_use", "tool_use"]
    assert m.content[0].text == "Let me check."
    assert (m.content[1].id, m.content[1].name, m.content[1].input) == (
        "call_a",
        "get_weather",
        {"city": "Paris"},
    )
    assert (m.content[2].name, m.content[2].input) == ("get_time", {})
    assert (m.stop_reason, m.usage.input_tokens, m.usage.output_tokens) == ("tool_use", 11, 6)


def test_a_stream_ending_on_a_stop_sequence_or_with_no_text():
    stream = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "abc"}),
        chunk({}, "stop", stop="END"),
        chunk(None, usage=USAGE),
    ]
    with anthropic_client(events_of(stream, ["END"])).messages.stream(
        model="m", max_tokens=5, messages=[]
    ) as s:
        m = s.get_final_message()
    assert (m.stop_reason, m.stop_sequence, m.content[0].text) == ("stop_sequence", "END", "abc")
    empty = [
        chunk({"role": "assistant", "content": ""}),
        chunk({}, "length"),
        chunk(None, usage=USAGE),
    ]
    with anthropic_client(events_of(empty, [])).messages.stream(
        model="m", max_tokens=5, messages=[]
    ) as s:
        m = s.get_final_message()
    assert (m.stop_reason, [(b.type, b.text) for b in m.content]) == ("max_tokens", [("text", "")])
    failed = answers.Events([]).feed({"error": {"message": "rank 1 died", "type": "server_error"}})
    error = {"type": "error", "error": {"type": "api_error", "message": "rank 1 died"}}
    assert failed == [f"event: error\ndata: {json.dumps(error)}\n\n"]
