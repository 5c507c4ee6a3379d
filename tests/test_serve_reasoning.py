"""Reasoning apart from the answer through the real clients (`openai`, `anthropic`,
`ollama`), on tiny models that carry a release's chat template and special tokens
(tests/chat_families.py): DeepSeek-V3.1's (its generation prompt opens `<think>` when
`thinking` is on), Qwen3's (`enable_thinking` off writes an empty block) and Kimi K3's
tags. The random model never closes the block itself, so the budget does: after N
tokens the server forces `</think>`, and the reply's own tokens (its log-probabilities)
say where the reasoning ends and the answer starts. One process (the server in this
process) here; the same on 2 ranks in `test_serve_families.py`.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
ollama = pytest.importorskip("ollama")
from chat_families import write_family_model  # noqa: E402
from serve_client import KEY, http, openai_client, serving  # noqa: E402

ASK = [{"role": "user", "content": "What is the capital of France?"}]
THINK = {"chat_template_kwargs": {"thinking": True}}
TOKENIZERS = {}  # the families' tokenizers, by name (the `served` fixture's)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """name -> base URL of an in-process server of each family's tiny model (Qwen3's
    twice: the second with the server's default `--chat-template-args`)."""
    from llama_tp import load
    from llama_tp.server.protocol import Defaults
    from llama_tp.server.runner import create_app

    root = tmp_path_factory.mktemp("reasoning")
    apps = {}
    for name in ("deepseek_v3_1", "qwen3", "kimi_k3"):
        model, tokenizer = load(write_family_model(name, root / name, max_position_embeddings=1024))
        TOKENIZERS[name] = tokenizer
        apps[name] = create_app(model, tokenizer, api_key=KEY)
        if name == "qwen3":
            off = Defaults(template_kwargs={"enable_thinking": False})
            apps["qwen3_off"] = create_app(model, tokenizer, api_key=KEY, defaults=off)
    with ExitStack() as stack:
        yield {name: stack.enter_context(serving(app)) for name, app in apps.items()}


def _chat(base, stream=False, **kw):
    """(reasoning, content, the reply's tokens, usage) of a greedy chat."""
    c = openai_client(base)
    kw = {"model": "m", "messages": ASK, "max_tokens": 14, "temperature": 0, **kw}
    if not stream:
        r = c.chat.completions.create(logprobs=True, **kw)
        m = r.choices[0].message
        tokens = [t.token for t in r.choices[0].logprobs.content]
        return getattr(m, "reasoning_content", None), m.content, tokens, r.usage
    reasoning, content, tokens, usage, kinds = [], [], [], None, []
    for ch in c.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, logprobs=True, **kw
    ):
        usage = ch.usage or usage
        for choice in ch.choices:
            d = choice.delta
            r, t = getattr(d, "reasoning_content", None), d.content
            kinds.append((bool(r), bool(t)))
            reasoning.append(r or "")
            content.append(t or "")
            assert (getattr(d, "reasoning", None) or None) == (r or None)  # mlx-lm's name
            tokens += [t.token for t in (choice.logprobs.content if choice.logprobs else [])]
    assert (True, True) not in kinds  # never both in one chunk
    return "".join(reasoning) or None, "".join(content), tokens, usage


def test_the_budget_closes_the_block_and_the_reply_splits_there(served):
    base = served["deepseek_v3_1"]
    # thinking on: the prompt opens the block and the model never closes it
    reasoning, content, tokens, _ = _chat(base, extra_body=THINK)
    assert "</think>" not in tokens and content == ""
    assert reasoning == "".join(tokens).strip()
    for n in (0, 3, 6):
        body = {**THINK, "reasoning_budget_tokens": n}
        reasoning, content, tokens, _ = _chat(base, extra_body=body)
        assert tokens[n] == "</think>", (n, tokens)  # forced after n tokens
        assert (reasoning or "") == "".join(tokens[:n]).strip()
        assert content == "".join(tokens[n + 1 :]).lstrip()
        assert _chat(base, stream=True, extra_body=body)[:3] == (reasoning, content, tokens)
    # llama.cpp's other name for it
    assert _chat(base, extra_body={**THINK, "thinking_budget_tokens": 3})[2][3] == "</think>"


def test_a_completion_whose_prompt_opened_the_block(served):
    """The text completion route splits a reply only where its own prompt opened the
    block (the client rendered the template itself); else the text is as written."""
    from llama_tp.checkpoints.chat_template import renderer_for

    base = served["deepseek_v3_1"]
    chat = _chat(base, extra_body={**THINK, "reasoning_budget_tokens": 4})
    c = openai_client(base)
    ids = renderer_for(TOKENIZERS["deepseek_v3_1"]).encode(ASK, thinking=True)
    kw = {"model": "m", "max_tokens": 14, "temperature": 0}
    done = c.completions.create(prompt=ids, extra_body={"reasoning_budget_tokens": 4}, **kw)
    choice = done.choices[0]
    assert (getattr(choice, "reasoning_content", None), choice.text) == chat[:2]
    plain = c.completions.create(prompt="The capital of France is", **kw).choices[0]
    assert getattr(plain, "reasoning_content", None) is None and plain.text


def test_switches_reach_the_template(served):
    base = served["deepseek_v3_1"]
    on, off = THINK, {"chat_template_kwargs": {"thinking": False}}
    _, _, _, u_on = _chat(base, extra_body=on)
    reasoning, content, tokens, u_off = _chat(base, extra_body=off)
    # off: `<think></think>` closes the block in the prompt (one token more): all answer
    assert u_off.prompt_tokens == u_on.prompt_tokens + 1
    assert reasoning is None and content == "".join(tokens)
    # the effort: "none" is off, "high" on; enable_thinking stands for thinking
    assert _chat(base, reasoning_effort="none")[3].prompt_tokens == u_off.prompt_tokens
    assert _chat(base, reasoning_effort="high")[3].prompt_tokens == u_on.prompt_tokens
    on2 = {"chat_template_kwargs": {"enable_thinking": True}}
    assert _chat(base, extra_body=on2)[3].prompt_tokens == u_on.prompt_tokens
    # Qwen3: `enable_thinking: false` writes an empty block (4 tokens), per request or
    # as the server's default
    qwen = [_chat(served["qwen3"], extra_body=b)[3].prompt_tokens for b in ({}, THINK)]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert _chat(served["qwen3"], extra_body=off)[3].prompt_tokens == qwen[0] + 4 == qwen[1] + 4
    assert _chat(served["qwen3_off"])[3].prompt_tokens == qwen[0] + 4
    assert _chat(served["qwen3_off"], extra_body=THINK)[3].prompt_tokens == qwen[0]


def test_bad_controls_are_400s_naming_the_field(served):
    base = served["deepseek_v3_1"]
    url, auth = f"{base}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    for body, param in [
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
    ]:
        code, text = http(url, {"messages": ASK, **body}, auth)
        assert code == 400 and f'"param":"{param}"' in text.replace(" ", ""), (body, text)
    m = [{"role": "user", "content": "hi"}]
    code, text = http(f"{base}/v1/messages", {"max_tokens": 4, "messages": m,
                                              "thinking": {"type": "enabled",
                                                           "budget_tokens": 4}}, auth)  # fmt: skip
    assert code == 400 and "thinking.budget_tokens" in text and "max_tokens" in text


def test_anthropic_thinking_blocks_and_budget(served):
    base = served["deepseek_v3_1"]
    reasoning, content, _, _ = _chat(base, extra_body={**THINK, "reasoning_budget_tokens": 5})
    c = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=60)
    kw = dict(model="m", max_tokens=14, messages=ASK)  # the server's default: greedy
    thinking = {"type": "enabled", "budget_tokens": 5}
    m = c.messages.create(**kw, thinking=thinking)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == reasoning and m.content[0].signature
    assert m.content[1].text == content
    with c.messages.stream(**kw, thinking=thinking) as s:
        streamed = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in streamed.content] == [("thinking", reasoning), ("text", content)]  # fmt: skip
    assert streamed.content[0].signature == m.content[0].signature
    hidden = c.messages.create(**kw, thinking={**thinking, "display": "omitted"})
    assert hidden.content[0].thinking == "" and hidden.content[0].signature
    off = c.messages.create(**kw, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]


def test_earlier_reasoning_handed_back_reaches_the_template(served):
    """Qwen3's template renders the reasoning of the replies after the last user turn
    (a tool loop), whichever API hands it back."""
    base = served["qwen3"]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    turn = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    plain = _chat(base, messages=turn)[3].prompt_tokens
    turn[1] = {**turn[1], "reasoning_content": "I should look it up."}
    assert _chat(base, messages=turn)[3].prompt_tokens > plain
    c = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=60)
    use = {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "call_1", "content": "sunny"}
    counted = []
    for blocks in ([use], [{"type": "thinking", "thinking": "I should look it up.",
                            "signature": "s"}, use]):  # fmt: skip
        messages = [*ASK, {"role": "assistant", "content": blocks},
                    {"role": "user", "content": [result]}]  # fmt: skip
        counted.append(c.messages.count_tokens(model="m", messages=messages).input_tokens)
    assert counted[1] > counted[0]


def test_ollama_think_and_its_thinking_field(served):
    base = served["deepseek_v3_1"]
    o = ollama.Client(host=base, headers={"Authorization": f"Bearer {KEY}"})
    opts = {"num_predict": 14, "temperature": 0}
    reasoning, content, _, _ = _chat(base, extra_body=THINK)
    r = o.chat(model="m", messages=ASK, think=True, options=opts)
    assert (r.message.thinking, r.message.content) == (reasoning, content)
    streamed = list(o.chat(model="m", messages=ASK, think=True, options=opts, stream=True))
    assert "".join(p.message.thinking or "" for p in streamed) == reasoning
    g = o.generate(model="m", prompt=ASK[0]["content"], think=True, options=opts)
    assert g.thinking == reasoning
    off = o.chat(model="m", messages=ASK, think=False, options=opts)
    assert not off.message.thinking and off.message.content
    assert "thinking" in o.show("m").capabilities


def test_kimi_k3s_tags_and_a_prefilled_block(served):
    """Kimi K3 marks reasoning with its tags; a reply continuing a prefilled `<think>`
    (the last assistant message) starts inside the block."""
    reasoning, content, tokens, _ = _chat(
        served["kimi_k3"], extra_body={"reasoning_budget_tokens": 2}
    )
    assert "".join(tokens[2:]).startswith("<|close|>think<|sep|>"), tokens  # forced after 2
    assert reasoning == "".join(tokens[:2]).strip()
    prefill = [*ASK, {"role": "assistant", "content": "<think>\nLet me"}]
    body = {"continue_final_message": True, "add_generation_prompt": False,
            "reasoning_budget_tokens": 2}  # fmt: skip
    reasoning, content, tokens, _ = _chat(served["qwen3"], messages=prefill, extra_body=body)
    assert tokens[2] == "</think>" and reasoning == "".join(tokens[:2]).strip()
