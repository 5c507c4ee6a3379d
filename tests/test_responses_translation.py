"""The Responses API's translations to and from the OpenAI chat route's shapes, without a
server: request bodies (items, reasoning handed back, tools, tool_choice, formats), chat
completions and stream chunks that carry reasoning (`reasoning_content`, contract
interface 2) turned into response objects and into the event sequence the real `openai`
client's own stream parser reads (over an in-memory transport), and the store's bounds."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from wire_samples import SCHEMA, TOOL_STREAM, USAGE, chunk  # noqa: E402

from llama_tp.server.errors import RequestError  # noqa: E402
from llama_tp.server.response_store import ResponseStore, Stored  # noqa: E402
from llama_tp.server.responses_answers import Events, respond  # noqa: E402
from llama_tp.server.responses_request import chat_body  # noqa: E402

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": SCHEMA,
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}, "strict": True}
CALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
    "id": "fc_1",
    "status": "completed",
}


def test_a_responses_body_becomes_the_chat_body():
    body = {
        "model": "gpt-x",
        "instructions": "You help.",
        "input": [
            {"role": "developer", "content": "Be terse."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather "},
                    {"type": "input_text", "text": "in Paris?"},
                ],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "s"}],
                "content": [{"type": "reasoning_text", "text": "raw"}],
                "encrypted_content": None,
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            CALL,
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": [{"type": "input_text", "text": "18 C"}],
            },
            {
                "type": "reasoning",
                "id": "rs_2",
                "summary": [{"type": "summary_text", "text": "ok"}],
            },
            {"role": "assistant", "content": "Sunny."},
            {"role": "system", "content": "Now in French."},
        ],
        "tools": [WEATHER, TIME],
        "tool_choice": {
            "type": "allowed_tools",
            "mode": "required",
            "tools": [{"type": "function", "name": "get_time"}],
        },
        "parallel_tool_calls": False,
        "max_output_tokens": 50,
        "temperature": 0.5,
        "text": {"format": {"type": "json_object"}, "verbosity": "low"},
        "reasoning": {"effort": "max", "summary": "detailed"},
        "metadata": {"user": "u1"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
        "stream": True,
        "top_k": 3,  # an extension the chat route takes
        "service_tier": "auto",  # ignored
    }
    out = chat_body(body, ResponseStore())
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert out["messages"] == [
        {"role": "system", "content": "You help.\n\nBe terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "raw",
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C", "name": "get_weather"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "ok"},
        {"role": "system", "content": "Now in French."},
    ]
    assert out["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert out["tool_choice"] == "required" and out["parallel_tool_calls"] is False
    assert (out["max_tokens"], out["temperature"], out["top_k"]) == (50, 0.5, 3)
    assert out["response_format"] == {"type": "json_object"}
    assert out["reasoning_effort"] == "high"  # the chat route's highest
    assert out["stream"] and out["stream_options"] == {"include_usage": True}
    turn = out.turn
    assert turn.stream and not turn.store and turn.summary and len(turn.items) == 9
    assert (
        turn.echo["metadata"] == {"user": "u1"} and turn.echo["tools"][0]["name"] == "get_weather"
    )
    assert turn.echo["text"] == {"format": {"type": "json_object"}}
    # A string input, a named function, a schema; no tools: "auto" is dropped.
    out = chat_body(
        {
            "input": "hi",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {
                "format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
            },
        },
        ResponseStore(),
    )
    assert out["messages"] == [{"role": "user", "content": "hi"}]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
    }
    assert "stream" not in out and out.turn.store and not out.turn.summary
    assert "tool_choice" not in chat_body({"input": "hi", "tool_choice": "auto"}, ResponseStore())


def test_previous_response_id_continues_the_stored_conversation():
    store = ResponseStore()
    first = [{"role": "user", "content": "Weather?"}]
    store.put("resp_1", Stored({"id": "resp_1"}, (*first, CALL), 100))
    output = {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}
    out = chat_body(
        {"previous_response_id": "resp_1", "input": [output], "instructions": "Be brief."}, store
    )
    assert [m["role"] for m in out["messages"]] == ["system", "user", "assistant", "tool"]
    assert out.turn.items == (*first, CALL, output) and out.turn.previous.size == 100
    # A bad item there is named in the input; one from the store cannot be bad.
    with pytest.raises(RequestError) as e:
        chat_body({"previous_response_id": "resp_1", "input": [{**output, "call_id": "x"}]}, store)
    assert e.value.param == "input[0].call_id"
    with pytest.raises(RequestError) as e:
        chat_body({"previous_response_id": "resp_2", "input": "hi"}, store)
    assert e.value.param == "previous_response_id" and e.value.code == "previous_response_not_found"


def completion(message: dict, finish: str) -> dict:
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    return {"id": "chatcmpl-1-2", "model": "tiny", "choices": [choice], "usage": USAGE}


def body(summary: bool = False) -> dict:
    return {"input": "hi", **({"reasoning": {"summary": "auto"}} if summary else {})}


def test_a_chat_completion_becomes_a_response_with_reasoning_items():
    calls = [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'},
        }
    ]
    message = {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Hm.",
        "reasoning": "Hm.",
        "tool_calls": calls,
    }
    turn = chat_body(body(summary=True), ResponseStore()).turn
    r = respond(completion(message, "tool_calls"), "resp_9", 7, turn)
    assert [o["type"] for o in r["output"]] == ["reasoning", "message", "function_call"]
    reasoning, text, call = r["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Hm."}]
    assert reasoning["summary"] == [{"type": "summary_text", "text": "Hm."}]
    assert text["content"][0]["text"] == "Let me check." and text["role"] == "assistant"
    assert (call["call_id"], call["name"], call["arguments"], call["id"]) == (
        "call_a",
        "get_weather",
        '{"city": "Lima"}',
        "fc_a",
    )
    assert (r["id"], r["created_at"], r["status"], r["model"]) == ("resp_9", 7, "completed", "tiny")
    assert r["usage"] == {
        "input_tokens": 11,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 6,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 17,
    }
    # Cut short while reasoning (mlx-lm's name only): reasoning alone, incomplete.
    turn = chat_body(body(), ResponseStore()).turn
    r = respond(
        completion({"role": "assistant", "content": "", "reasoning": "Hm"}, "length"),
        "resp_8",
        7,
        turn,
    )
    assert [(o["type"], o["status"]) for o in r["output"]] == [("reasoning", "incomplete")]
    assert r["output"][0]["summary"] == [] and r["status"] == "incomplete"
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    r = respond(completion({"role": "assistant", "content": ""}, "stop"), "resp_7", 7, turn)
    assert [(o["type"], o["content"][0]["text"]) for o in r["output"]] == [("message", "")]


# wire_samples' tool stream after two pieces of reasoning
REASONING_STREAM = [
    TOOL_STREAM[0],
    chunk({"reasoning_content": "The user ", "reasoning": "The user "}),
    chunk({"reasoning_content": "asks.", "reasoning": "asks."}),
    *TOOL_STREAM[1:],
]


def events_of(stream: list[dict], request: dict) -> str:
    events = Events("resp_1", 7, chat_body(request, ResponseStore()).turn)
    return "".join(e for c in stream for e in events.feed(c)) + "".join(events.end())


def client(sse: str):
    """The real OpenAI client, its requests answered with `sse` in memory."""
    import httpx2

    def reply(request):
        return httpx2.Response(
            200, headers={"content-type": "text/event-stream"}, content=sse.encode()
        )

    http = httpx2.Client(transport=httpx2.MockTransport(reply))
    return openai.OpenAI(api_key="k", base_url="http://test/v1", http_client=http, max_retries=0)


@pytest.mark.parametrize("summary", [False, True])
def test_stream_chunks_become_the_events_the_openai_client_reads(summary):
    sse = events_of(REASONING_STREAM, body(summary))
    with client(sse).responses.stream(model="m", input="hi") as s:
        events = list(s)
        r = s.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    summarized = [
        "response.reasoning_summary_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ]
    reasoning = summarized if summary else [k for k in summarized if "summary" not in k]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *reasoning,
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert deltas == ["The user ", "asks."]  # each piece once, not once per name
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call", "function_call"]
    thought, text, weather, time_ = r.output
    assert [c.text for c in thought.content] == ["The user asks."]
    assert [p.text for p in thought.summary] == (["The user asks."] if summary else [])
    assert r.output_text == "Let me check." and text.status == "completed"
    assert (weather.call_id, weather.name, json.loads(weather.arguments)) == (
        "call_a",
        "get_weather",
        {"city": "Paris"},
    )
    assert (time_.call_id, time_.name, time_.arguments) == ("call_b", "get_time", "{}")
    assert (r.status, r.usage.input_tokens, r.usage.output_tokens) == ("completed", 11, 6)
    # The same reply not streamed gives the same output (ids aside).
    message = {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "The user asks.",
        "tool_calls": [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in (weather, time_)
        ],
    }
    whole = respond(
        completion(message, "tool_calls"),
        "resp_1",
        7,
        chat_body(body(summary), ResponseStore()).turn,
    )
    streamed = r.model_dump(include={"output"}, exclude_none=True)["output"]
    for got, item in zip(streamed, whole["output"], strict=True):
        assert {k: v for k, v in got.items() if k not in ("id", "parsed", "parsed_arguments")} == {
            k: v for k, v in item.items() if k != "id"
        }


def test_a_cut_reply_is_incomplete_and_a_failure_fails():
    cut = [chunk({"reasoning_content": "Hm"}), chunk({}, "length"), chunk(None, usage=USAGE)]
    events = list(
        client(events_of(cut, body())).responses.create(model="m", input="hi", stream=True)
    )
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status) for o in last.response.output] == [("reasoning", "incomplete")]
    failed = [
        chunk({"content": "Par"}),
        {"error": {"message": "rank 1 died", "type": "server_error", "param": None, "code": 503}},
    ]
    events = list(
        client(events_of(failed, body())).responses.create(model="m", input="hi", stream=True)
    )
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert (events[-2].code, events[-2].message) == ("server_error", "rank 1 died")
    assert events[-1].response.error.message == "rank 1 died"
    assert events[-1].response.status == "failed" and events[-1].response.output_text == "Par"
    with client(events_of(failed, body())).responses.stream(model="m", input="hi") as s:
        with pytest.raises(RuntimeError, match="response.completed"):
            s.get_final_response()


def stored(size: int) -> Stored:
    return Stored({}, (), size)


def test_the_store_keeps_the_newest_within_its_count_and_bytes():
    store = ResponseStore(count=3, size=100)
    for k in range(5):
        assert store.put(f"r{k}", stored(10))
    assert [store.get(f"r{k}") is not None for k in range(5)] == [False, False, True, True, True]
    assert store.usage() == (3, 30)
    assert store.put("big", stored(85))  # the bytes evict the oldest two
    assert [store.get(r) is not None for r in ("r2", "r3", "r4", "big")] == [
        False,
        False,
        True,
        True,
    ]
    assert store.usage() == (2, 95)
    assert not store.put("huge", stored(101)) and store.get("huge") is None
    assert store.usage() == (2, 95)  # what cannot be kept evicts nothing
    assert store.delete("r4") and not store.delete("r4") and store.usage() == (1, 85)
    assert not ResponseStore(0, 100).put("r", stored(1))
    with pytest.raises(ValueError, match="must be >= 0"):
        ResponseStore(-1, 100)
    # Several threads at once: the bounds hold, no update is lost.
    store = ResponseStore(count=50, size=10_000)

    def work(t: int) -> None:
        for k in range(200):
            store.put(f"t{t}-{k}", stored(1 + k % 7))
            store.get(f"t{t}-{k - 3}")
            if k % 5 == 0:
                store.delete(f"t{t}-{k - 1}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    count, size = store.usage()
    assert count <= 50 and size == sum(s.size for s in store._held.values())
