"""The Responses API's reasoning items end to end, through the real `openai` client on an
app served in this process: DeepSeek-V3.1's tiny model (the release's template and
tokens: tests/chat_families.py), whose generation prompt opens `<think>` when
`thinking` is on. The random model never closes the block itself, so the budget does
(`reasoning_budget_tokens`, passed on to the chat route): the reply's first tokens are
reasoning, the rest the answer, as the chat route splits them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from chat_families import write_family_model  # noqa: E402
from test_server_plumbing import serving  # noqa: E402

QUESTION = "What is the capital of France?"
THINK = {"chat_template_kwargs": {"thinking": True}, "reasoning_budget_tokens": 3}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from llama_tp import load
    from llama_tp.server.runner import create_app

    path = tmp_path_factory.mktemp("responses-reasoning") / "deepseek_v3_1"
    model, tokenizer = load(write_family_model("deepseek_v3_1", path, max_position_embeddings=1024))
    with serving(create_app(model, tokenizer)) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def test_reasoning_comes_back_as_a_reasoning_item(served):
    c = served
    chat = c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
        extra_body=THINK,
    )
    m = chat.choices[0].message
    assert m.reasoning_content and m.content  # the budget split the reply
    ask = {"model": "m", "input": QUESTION, "max_output_tokens": 12, "extra_body": THINK}
    r = c.responses.create(**ask)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thought = r.output[0]
    assert thought.id.startswith("rs_") and thought.summary == []
    assert [p.text for p in thought.content] == [m.reasoning_content]
    assert r.output_text == m.content and r.usage.input_tokens == chat.usage.prompt_tokens
    # Streamed, with a summary asked: the reasoning as reasoning_text and summary deltas.
    events = list(c.responses.create(**ask, stream=True, reasoning={"summary": "auto"}))
    kinds = [e.type for e in events]
    for kind, text in [
        ("response.reasoning_text.delta", m.reasoning_content),
        ("response.reasoning_summary_text.delta", m.reasoning_content),
        ("response.output_text.delta", m.content),
    ]:
        assert "".join(e.delta for e in events if e.type == kind) == text, kind
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [p.text for p in final.output[0].summary] == [m.reasoning_content]
    assert final.output_text == m.content
    # The next turn: the reasoning goes back with the turn, as the chat route takes it.
    after = c.responses.create(**{**ask, "input": "And Italy?"}, previous_response_id=r.id)
    items = [
        {"role": "user", "content": QUESTION},
        *[o.model_dump() for o in r.output],
        {"role": "user", "content": "And Italy?"},
    ]
    explicit = c.responses.create(**{**ask, "input": items}, store=False)
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": m.content, "reasoning_content": m.reasoning_content},
        {"role": "user", "content": "And Italy?"},
    ]
    chat2 = c.chat.completions.create(
        model="m", messages=messages, max_tokens=12, temperature=0, extra_body=THINK
    )
    assert after.usage.input_tokens == explicit.usage.input_tokens == chat2.usage.prompt_tokens
    assert after.output_text == explicit.output_text == chat2.choices[0].message.content
    # effort "none" turns thinking off, as on the chat route
    off = c.responses.create(
        model="m", input=QUESTION, max_output_tokens=4, reasoning={"effort": "none"}
    )
    chat_off = c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=4,
        reasoning_effort="none",
    )
    assert off.usage.input_tokens == chat_off.usage.prompt_tokens
    assert [o.type for o in off.output] == ["message"]
