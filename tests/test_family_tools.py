"""Forced tool calls in every native family's own format, on tiny random models that carry
each release's chat template and tokens (tests/chat_families.py).

For each release: the forced-call grammar compiles against the release's tokens and
accepts the call exactly as the release's template writes it (read back by the parser
into the same call); then, through the real `openai` client on an in-process server, a
call forced by name and one forced by "required" (streamed) come back as `tool_calls`
with `finish_reason: "tool_calls"`, their arguments valid against the function's schema,
and the call and its result go back through the template. A template that shows no tool
format gets a 400 naming `tools` for a forced call, never unconstrained text.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import jsonschema
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
from chat_families import FAMILIES, write_family_model  # noqa: E402
from test_tool_formats import TEMPLATE_FORMAT  # noqa: E402

from llama_tp.conversation.tool_calls import forced_call_grammar, tool_format  # noqa: E402
from llama_tp.conversation.tool_formats import ReplySplitter  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, for some days",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
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
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
FORCE = {"type": "function", "function": {"name": "get_weather"}}
CALL = {"city": "Paris", "days": 3}
NATIVE = sorted(n for n, f in FAMILIES.items() if f.tools)
# transformers' sandbox refuses this template's tool-call rendering (tests/data/chat_templates)
UNRENDERED = {"kimi_k2_thinking"}
# R1's template renders an assistant's calls only when its content is None, which the
# OpenAI route passes as "" (as Qwen's and others' templates need)
CALLS_DROPPED = {"deepseek_v3_0324", "deepseek_r1_distill_llama"}
# where the template's text of a call starts, when not at the format's `start`
CALL_FROM = {"kimi_k3": "<|open|>response<|sep|>"}
CALL_AFTER = {"llama3_json": "<|end_header_id|>\n\n", "harmony": "<|start|>assistant"}
# releases whose prompt can open a reasoning block, and the marker that closes it
THINK_END = {"qwen3_5": "</think>", "deepseek_v3_1": "</think>", "kimi_k3": "<|close|>think<|sep|>"}
# every request of both kinds, streamed and not, for these (the others: one of each)
FULL = {"qwen3", "deepseek_v3_1", "qwen3_5", "gpt_oss"}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """name -> (model, tokenizer) of the release's tiny model (written once)."""
    from llama_tp import load

    root, loaded = tmp_path_factory.mktemp("families"), {}

    def get(name: str):
        if name not in loaded:
            path = write_family_model(name, root / name, max_position_embeddings=8192)
            loaded[name] = load(path)
        return loaded[name]

    return get


def _template_call(tok, name: str, fmt, calls=(("get_weather", CALL),)) -> str:
    """The text the release's template writes for `calls` ((name, arguments)), from the
    first call's first marker to the last one's last (or to the end of the turn)."""
    from llama_tp.checkpoints.chat_template import renderer_for

    r = renderer_for(tok)
    call = [
        {"id": f"call{k}abcd", "type": "function", "function": {"name": n, "arguments": a}}
        for k, (n, a) in enumerate(calls)
    ]
    turn = r.apply(ASK + [{"role": "assistant", "content": "", "tool_calls": call}],
                   tokenize=False, tools=TOOLS, add_generation_prompt=False)  # fmt: skip
    text = turn[turn.rindex(ASK[0]["content"]) :]  # the question, then the answer's turn
    if fmt.name in CALL_AFTER:
        text = text[text.rindex(CALL_AFTER[fmt.name]) + len(CALL_AFTER[fmt.name]) :]
    else:
        text = text[text.index(CALL_FROM.get(fmt.name, fmt.start)) :]
    if fmt.end and fmt.end in text:
        return text[: text.rindex(fmt.end) + len(fmt.end)]
    ends = [text.index(e) for e in FAMILIES[name].eos_tokens if e in text]
    return text[: min(ends)] if ends else text


def _accepts(grammar: str, tok, model, text: str) -> bool:
    """Whether `grammar` takes the tokens of `text` and is then complete."""
    from llama_tp.checkpoints.chat_template import renderer_for
    from llama_tp.engine.grammar import compile_grammar

    eos = renderer_for(tok).eos
    matcher = compile_grammar(grammar, tok, model.args.vocab_size, eos)
    ids = list(tok.encode(text, add_special_tokens=False))
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize("name", NATIVE)
def test_the_forced_grammar_takes_the_call_as_the_template_writes_it(name, release):
    model, tok = release(name)
    family = FAMILIES[name]
    fmt = tool_format(tok, family.model_type)
    assert fmt.name == TEMPLATE_FORMAT[name]
    required = forced_call_grammar(TOOLS, "required", tok, family.model_type)
    named = forced_call_grammar(TOOLS, FORCE, tok, family.model_type)
    if name in UNRENDERED or name in CALLS_DROPPED:
        return  # (the grammars compiled: `_accepts` below would compile them too)
    text = _template_call(tok, name, fmt)
    assert _accepts(required, tok, model, text) and _accepts(named, tok, model, text), text
    split = ReplySplitter(fmt, TOOLS)
    rest = split.feed(text) + split.finish()
    assert rest.content == "" and rest.reasoning == "", rest
    (call,) = split.tool_calls()
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == CALL
    # Another city than the schema's, or a function not forced, is refused.
    wrong = text.replace("Paris", "Berlin")
    assert not _accepts(named, tok, model, wrong), wrong
    other = forced_call_grammar(TOOLS, {"type": "function", "function": {"name": "get_time"}}, tok)
    assert not _accepts(other, tok, model, text)


@pytest.mark.parametrize("name", sorted(THINK_END))
def test_a_forced_call_can_start_inside_the_reasoning_block(name, release):
    model, tok = release(name)
    fmt = tool_format(tok, FAMILIES[name].model_type)
    end = THINK_END[name]
    grammar = forced_call_grammar(TOOLS, FORCE, tok, FAMILIES[name].model_type, think_end=end)
    call = _template_call(tok, name, fmt)
    assert _accepts(grammar, tok, model, f"The user wants Paris.\nOK{end}\n\n{call}")
    assert _accepts(grammar, tok, model, f"{end}{call}")
    assert not _accepts(grammar, tok, model, call)  # the block must be closed first
    assert not _accepts(grammar, tok, model, f"Paris{end} then {end}{call}")


# one call a turn: Llama 3.x's template refuses more, harmony's renders the first
ONE_CALL = {"llama3_1", "llama3_3", "gpt_oss"}


@pytest.mark.parametrize("name", sorted(set(NATIVE) - UNRENDERED - CALLS_DROPPED - ONE_CALL))
def test_several_calls_unless_parallel_tool_calls_is_false(name, release):
    model, tok = release(name)
    fmt = tool_format(tok, FAMILIES[name].model_type)
    two = _template_call(tok, name, fmt, [("get_weather", CALL), ("get_time", {})])
    several = forced_call_grammar(TOOLS, "required", tok, FAMILIES[name].model_type)
    one = forced_call_grammar(TOOLS, "required", tok, FAMILIES[name].model_type, parallel=False)
    assert _accepts(several, tok, model, two), two
    assert not _accepts(one, tok, model, two)
    split = ReplySplitter(fmt, TOOLS)
    split.feed(two)
    split.finish()
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in split.tool_calls()
    ]
    assert calls == [("get_weather", CALL), ("get_time", {})]


@contextmanager
def _serving(model, tok, model_type: str):
    """An in-process server of `model` (its family's row as `model_type`): an openai client."""
    from llama_tp.server.runner import HTTPThread, bind, create_app

    app = create_app(model, tok, model_name="m")
    app.state.model.model_type = model_type  # the tiny folder says "llama"
    sock = bind("127.0.0.1", 0)
    thread = HTTPThread(app, sock)
    try:
        base = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        yield openai.OpenAI(base_url=base, api_key="k", max_retries=0, timeout=120)
    finally:
        thread.stop()
        app.state.scheduler.request_stop()
        app.state.steps.join(10)


def _ask(client, stream: bool, **kw) -> tuple[list[tuple[str, dict, str]], str, str | None]:
    """([(name, arguments, id)], finish_reason, content) of a chat with TOOLS."""
    kw = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 300, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        calls = [
            (c.function.name, json.loads(c.function.arguments), c.id) for c in m.tool_calls or []
        ]
        return calls, r.choices[0].finish_reason, m.content
    calls, finish, content = {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content.append(ch.delta.content or "")
            for c in ch.delta.tool_calls or []:
                name, args, cid = calls.get(c.index, ("", "", ""))
                fn = c.function
                calls[c.index] = (name + (fn.name or ""), args + (fn.arguments or ""), cid or c.id)
    out = [(n, json.loads(a), i) for n, a, i in (calls[k] for k in sorted(calls))]
    return out, finish, "".join(content) or None


def _valid(calls: list[tuple[str, dict, str]]) -> None:
    assert calls
    for fn, args, cid in calls:
        assert cid, calls
        jsonschema.validate(args, SCHEMAS[fn])


@pytest.mark.parametrize("name", NATIVE)
def test_forced_calls_through_the_openai_client(name, release):
    model, tok = release(name)
    family = FAMILIES[name]
    # a random model left in gpt-oss's analysis channel writes on: let it close it at once
    bias = (
        {"logit_bias": {str(tok.convert_tokens_to_ids("<|end|>")): 100}}
        if name == "gpt_oss"
        else {}
    )
    with _serving(model, tok, family.model_type) as client:
        kinds = [(False, FORCE), (True, "required")]
        if name in FULL:
            kinds += [(True, FORCE), (False, "required")]
        first = None
        for stream, choice in kinds:
            # one call: a random model asked for several writes calls to its token limit
            kw = {"parallel_tool_calls": False, **bias}
            if name != "gpt_oss":  # a prompt's open think block: closed after 2 tokens
                kw["extra_body"] = {"reasoning_budget_tokens": 2}
            calls, finish, content = _ask(client, stream, tool_choice=choice, **kw)
            assert finish == "tool_calls" and not content, (stream, choice, calls, content)
            _valid(calls)
            if isinstance(choice, dict):
                assert [fn for fn, _, _ in calls] == ["get_weather"], calls
            first = first or calls
        if name in UNRENDERED:
            return
        # The call and its result go back through the template.
        fn, args, cid = first[0]
        sent = {
            "id": cid,
            "type": "function",
            "function": {"name": fn, "arguments": json.dumps(args)},
        }
        turn = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [sent]},
            {"role": "tool", "tool_call_id": cid, "content": "sunny, 21 C"},
        ]
        r = client.chat.completions.create(model="m", messages=turn, tools=TOOLS, max_tokens=1)
        from llama_tp.checkpoints.chat_template import renderer_for

        shown = {**sent, "function": {"name": fn, "arguments": args}}
        rendered = [turn[0], {**turn[1], "content": "", "tool_calls": [shown]}, turn[2]]
        text = renderer_for(tok).apply(rendered, tokenize=False, tools=TOOLS)
        answer = text[text.rindex(ASK[0]["content"]) :]  # what follows the question
        assert "sunny, 21 C" in answer
        assert fn in answer or name in CALLS_DROPPED, answer
        assert r.usage.prompt_tokens == len(renderer_for(tok).apply(rendered, tools=TOOLS))


def test_a_forced_call_without_a_known_format_is_refused_naming_tools(release):
    model, tok = release("gemma3")  # Gemma 3's template shows no tools
    with _serving(model, tok, FAMILIES["gemma3"].model_type) as client:
        for choice in ("required", FORCE):
            with pytest.raises(openai.BadRequestError) as e:
                _ask(client, False, tool_choice=choice)
            assert e.value.body["param"] == "tools"
            assert "no tool-call format llama_tp knows" in e.value.body["message"]
        calls, finish, content = _ask(client, False, tool_choice="auto", max_tokens=4)
        assert calls == [] and finish == "length" and content
