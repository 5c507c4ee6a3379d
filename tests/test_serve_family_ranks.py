"""A release's own chat language on 2 ranks, through every client: DeepSeek-V3.1's template
and tokens (tests/chat_families.py; its `<｜tool▁calls▁begin｜>` calls, its `<think>` opened
by the generation prompt) served by `python -m llama_tp.launch -n 2 -m llama_tp.serve`,
against the same folder served in this process (1 rank).

On both: forced calls (by name and "required", streamed and not) parse back into the
same `tool_calls`; a reasoning budget splits the same reply at the same token; the
Anthropic route gives its thinking and tool_use blocks, the Responses route its reasoning
and function_call items, Ollama its `thinking`; a call and its result sent back through
each API render to the same prompt; bad requests are 400s naming the field and the
server keeps serving. One 2-rank launch for the module.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")
from chat_families import write_family_model  # noqa: E402
from serve_client import KEY, Server, http, openai_client, serving  # noqa: E402
from test_family_tools import ASK, FORCE, SCHEMAS, TOOLS  # noqa: E402

pytestmark = pytest.mark.ranks
TIMEOUT = 300
THINK = {"chat_template_kwargs": {"thinking": True}}
CLAUDE_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{1: the in-process server's base URL, 2: the 2-rank server's}."""
    from llama_tp import load
    from llama_tp.server.runner import create_app

    root = tmp_path_factory.mktemp("family-ranks")
    folder = write_family_model("deepseek_v3_1", root / "ds", max_position_embeddings=2048)
    two = Server(2, folder, root, launcher="llama_tp")
    try:
        model, tokenizer = load(folder)
        app = create_app(model, tokenizer, api_key=KEY)
        app.state.model.model_type = "deepseek_v3"  # the release's family (the folder: llama)
        with serving(app) as one:
            two.wait_ready(180)
            yield {1: one, 2: two.base}
    finally:
        two.close()


def _calls(base: str, stream: bool, **kw) -> tuple[list, str, str | None, str | None]:
    """([(name, arguments)], finish_reason, content, reasoning) of a chat with TOOLS."""
    c = openai_client(base, timeout=TIMEOUT)
    kw = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 120, **kw}
    if not stream:
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
        assert all(t.id and t.type == "function" for t in m.tool_calls or [])
        return calls, r.choices[0].finish_reason, m.content, getattr(m, "reasoning_content", None)
    calls, finish, content, reasoning = {}, None, [], []
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content.append(ch.delta.content or "")
            reasoning.append(getattr(ch.delta, "reasoning_content", None) or "")
            for t in ch.delta.tool_calls or []:  # a call's arguments come in fragments
                name, args = calls.get(t.index, ("", ""))
                calls[t.index] = (
                    name + (t.function.name or ""),
                    args + (t.function.arguments or ""),
                )
    out = [(n, json.loads(a)) for n, a in (calls[k] for k in sorted(calls))]
    return out, finish, "".join(content) or None, "".join(reasoning) or None


def test_forced_calls_and_reasoning_the_same_on_1_and_2_ranks(bases):
    budget = {**THINK, "reasoning_budget_tokens": 2}  # the prompt opens <think>: 2 tokens
    off = {"chat_template_kwargs": {"thinking": False}}
    for kw, thinks in (
        ({"tool_choice": FORCE, "extra_body": budget}, True),
        ({"tool_choice": "required", "parallel_tool_calls": False, "extra_body": budget}, True),
        ({"tool_choice": "required", "temperature": 1.0, "seed": 7,
          "parallel_tool_calls": False, "extra_body": off}, False),
    ):  # fmt: skip
        got = {n: [_calls(bases[n], s, **kw) for s in (False, True)] for n in (1, 2)}
        assert got[1] == got[2], kw
        for calls, finish, content, reasoning in got[1]:
            assert finish == "tool_calls" and not content, (kw, calls, content)
            for name, args in calls:
                jsonschema.validate(args, SCHEMAS[name])
            assert (reasoning is not None) is thinks, (kw, reasoning)
        if kw["tool_choice"] == FORCE:
            assert [name for name, _ in got[1][0][0]] == ["get_weather"]
    # the reasoning budget alone: the same split on both
    ask = {"messages": [{"role": "user", "content": "Hi"}], "tools": None, "max_tokens": 10}
    split = {n: _calls(bases[n], False, extra_body=budget, **ask)[1:] for n in (1, 2)}
    assert split[1] == split[2] and split[1][2]  # some reasoning, the same


def test_anthropic_ollama_and_responses_on_2_ranks(bases):
    one, two = bases[1], bases[2]
    c = anthropic.Anthropic(base_url=two, api_key=KEY, max_retries=0, timeout=TIMEOUT)
    kw = {"model": "m", "max_tokens": 120, "messages": ASK, "tools": CLAUDE_TOOLS}
    named = {"type": "tool", "name": "get_weather"}
    thinking = {"type": "enabled", "budget_tokens": 3}
    m = c.messages.create(**kw, tool_choice=named, thinking=thinking)
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    use = m.content[1]
    jsonschema.validate(use.input, SCHEMAS["get_weather"])
    with c.messages.stream(**kw, tool_choice=named, thinking=thinking) as s:
        streamed = s.get_final_message()
    same = [b.model_dump(exclude={"id"}) for b in m.content]  # (a call's id is its own)
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == same
    # the same reply through the chat route of the 1-rank server
    calls, _, _, reasoning = _calls(
        one, False, tool_choice=FORCE, extra_body={**THINK, "reasoning_budget_tokens": 3}
    )
    assert (reasoning, calls) == (m.content[0].thinking, [(use.name, use.input)])

    # The next turn, as each API sends it back, renders the same prompt
    result = "18 C, sunny"
    block = use.model_dump(include={"type", "id", "name", "input"})
    answered = {"type": "tool_result", "tool_use_id": use.id, "content": result}
    turn = [*ASK, {"role": "assistant", "content": [block]},
            {"role": "user", "content": [answered]}]  # fmt: skip
    sent = {"id": use.id, "type": "function",
            "function": {"name": use.name, "arguments": json.dumps(use.input)}}  # fmt: skip
    openai_turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [sent]},
                   {"role": "tool", "tool_call_id": use.id, "content": result}]  # fmt: skip
    o = openai_client(two, timeout=TIMEOUT)
    r = o.chat.completions.create(model="m", messages=openai_turn, tools=TOOLS, max_tokens=8)
    text, prompt = r.choices[0].message.content, r.usage.prompt_tokens
    reply = c.messages.create(model="m", max_tokens=8, messages=turn, tools=CLAUDE_TOOLS)
    assert reply.content[-1].text == text
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == prompt
    counted = c.messages.count_tokens(model="m", messages=turn, tools=CLAUDE_TOOLS).input_tokens
    assert counted == prompt > c.messages.count_tokens(model="m", messages=ASK).input_tokens
    ollama_turn = [*ASK, {"role": "assistant", "content": "",
                          "tool_calls": [{"function": {"name": use.name, "arguments": use.input}}]},
                   {"role": "tool", "content": result, "tool_name": use.name}]  # fmt: skip
    body = {"messages": ollama_turn, "tools": TOOLS, "stream": False, "options": {"num_predict": 8}}
    code, answer = http(f"{two}/api/chat", body, {"Authorization": f"Bearer {KEY}"}, TIMEOUT)
    line = json.loads(answer)
    assert code == 200 and line["message"]["content"] == text
    assert line["prompt_eval_count"] == prompt
    items = [{"type": "function_call", "call_id": use.id, "name": use.name,
              "arguments": json.dumps(use.input)},
             {"type": "function_call_output", "call_id": use.id, "output": result}]  # fmt: skip
    done = o.responses.create(
        model="m", input=[*ASK, *items], tools=RESPONSES_TOOLS, max_output_tokens=8
    )
    assert done.output_text == text and done.usage.input_tokens == prompt

    # Ollama's think, and the Responses API's reasoning and function_call items
    client = ollama.Client(host=two, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT)
    thought = client.chat(model="m", messages=ASK, think=True, options={"num_predict": 6})
    chat = _calls(two, False, tools=None, max_tokens=6, extra_body=THINK)
    assert thought.message.thinking == chat[3] and thought.message.content == (chat[2] or "")
    forced = o.responses.create(
        model="m", input=ASK[0]["content"], tools=RESPONSES_TOOLS, max_output_tokens=120,
        tool_choice={"type": "function", "name": "get_weather"},
        extra_body={**THINK, "reasoning_budget_tokens": 3},
    )  # fmt: skip
    assert [i.type for i in forced.output] == ["reasoning", "function_call"]
    assert forced.output[0].content[0].text == m.content[0].thinking
    assert (forced.output[1].name, json.loads(forced.output[1].arguments)) == calls[0]


def test_bad_requests_get_their_400_and_the_server_keeps_serving(bases):
    base = bases[2]
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
    cases = [
        ({"tools": [bad], "tool_choice": "required"}, "tools"),  # parameters no grammar takes
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
    ]  # fmt: skip
    url = f"{base}/v1/chat/completions"
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(
                lambda case: http(
                    url,
                    {"messages": ASK, "max_tokens": 4, **case[0]},
                    {"Authorization": f"Bearer {KEY}"},
                ),  # fmt: skip
                cases,
            )
        )
    for (case, param), (status, body) in zip(cases, answers, strict=True):
        assert status == 400, (case, body)
        assert json.loads(body)["error"]["param"] == param, (case, body)
    assert _calls(base, False, tools=None, max_tokens=3)[1] == "length"  # still serving
