"""OpenAI-shaped samples the Anthropic and Ollama translation tests share: a tool's
parameters schema and an OpenAI stream whose reply calls two tools."""

from __future__ import annotations

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}


def chunk(delta: dict | None = None, finish=None, usage=None, stop=None) -> dict:
    choices = (
        []
        if delta is None
        else [{"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": stop}]
    )
    c = {
        "id": "chatcmpl-4-2",
        "object": "chat.completion.chunk",
        "model": "tiny",
        "choices": choices,
    }
    return {**c, "usage": usage} if usage else c


USAGE = {
    "prompt_tokens": 11,
    "completion_tokens": 6,
    "total_tokens": 17,
    "prompt_tokens_details": {"cached_tokens": 0},
}
TOOL_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Let me "}),
    chunk({"content": "check."}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                }
            ]
        }
    ),
    chunk({}, "tool_calls"),
    chunk(None, usage=USAGE),
]
