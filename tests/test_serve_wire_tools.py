"""Tool use end to end through the Anthropic and Ollama routes: the OpenAI route's tool
calls (server/tools.py) come back as tool_use blocks with stop_reason "tool_use", and a
conversation's tool_use / tool_result blocks (Ollama's tool_calls and tool messages) go
back into the template as the OpenAI route's tool_calls and "tool" messages do.

The tiny model is served with test_serve_tools' Hermes template; a named tool
(Anthropic's tool_choice {"type": "tool"}) makes it write a call, constrained."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
pytest.importorskip("llama_tp.server.tools")  # the OpenAI route's tool calls
anthropic = pytest.importorskip("anthropic")
from serve_client import KEY, Server, chat, http  # noqa: E402
from test_serve_tools import ASK, FORCE, TOOLS, _model  # noqa: E402

pytestmark = pytest.mark.ranks
# The same tools in Anthropic's shape
CLAUDE_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
NAMED = {"type": "tool", "name": "get_weather"}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("wire-tools")
    s = Server(2, _model(tiny_dir, root, "hermes"), root, launcher="llama_tp")
    try:
        s.wait_ready(180)
        yield s
    finally:
        s.close()


def test_tool_use_through_the_anthropic_and_ollama_routes(server):
    c = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=300)
    o = server.client(timeout=300)
    ask = {"model": "m", "max_tokens": 200, "messages": ASK, "tools": CLAUDE_TOOLS}
    r = o.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice=FORCE, max_tokens=200
    )
    (call,) = r.choices[0].message.tool_calls
    m = c.messages.create(**ask, tool_choice=NAMED)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.input == json.loads(call.function.arguments) and use.input["city"] in (
        "Paris",
        "Tokyo",
        "Lima",
    )
    with c.messages.stream(**ask, tool_choice=NAMED) as st:
        sm = st.get_final_message()
    assert sm.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in sm.content if b.type == "tool_use"] == [
        (use.name, use.input)
    ]

    # The next turn: the call and its result go back into the template.
    turn = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}],
        },
    ]
    openai_turn = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": json.dumps(use.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "18 C"},
    ]
    text, _, usage = chat(o, None, messages=openai_turn, tools=TOOLS, max_tokens=8)
    m = c.messages.create(model="m", max_tokens=8, messages=turn, tools=CLAUDE_TOOLS)
    assert m.content[0].text == text
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    counted = c.messages.count_tokens(model="m", messages=turn, tools=CLAUDE_TOOLS).input_tokens
    assert (
        counted
        == usage.prompt_tokens
        > c.messages.count_tokens(model="m", messages=ASK).input_tokens
    )
    # ... and as Ollama sends it: arguments as an object, the tool message naming the tool
    ollama_turn = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": use.name, "arguments": use.input}}],
        },
        {"role": "tool", "content": "18 C", "tool_name": use.name},
    ]
    body = {"messages": ollama_turn, "tools": TOOLS, "stream": False, "options": {"num_predict": 8}}
    code, answer = http(
        f"{server.base}/api/chat", body, {"Authorization": f"Bearer {KEY}"}, timeout=300
    )
    assert code == 200, answer
    line = json.loads(answer)
    assert line["message"]["content"] == text and line["prompt_eval_count"] == usage.prompt_tokens
