"""A "prefill": a final assistant message the reply continues (Anthropic's prefill,
vLLM's `continue_final_message`, Ollama's final assistant message), rendered with the
built-in model's template and translated from each route's body, without a server. The
served replies (greedy, streamed and not, the prompt cache) are in test_serve_wire.py."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
from llama_tp.server import anthropic, ollama  # noqa: E402
from llama_tp.server.prompts import prompt_tokens  # noqa: E402
from llama_tp.server.protocol import Defaults, RequestError, parse_chat  # noqa: E402

PREFILL = '{"city":'
ASK = [{"role": "user", "content": "Name a city as JSON."}]
PREFILLED = [*ASK, {"role": "assistant", "content": PREFILL}]


@pytest.fixture(scope="module")
def renderer(default_gguf):
    from llama_tp import load
    from llama_tp.checkpoints.chat_template import renderer_for

    return renderer_for(load(default_gguf)[1])


def test_the_prompt_ends_with_the_prefill_and_no_end_of_turn(renderer):
    text = renderer.apply(PREFILLED, tokenize=False, continue_final=True)
    # The new turn's header, then the prefill: the generation prompt's text followed by it.
    assert text == renderer.apply(ASK, tokenize=False) + PREFILL
    ids = renderer.encode(PREFILLED, continue_final=True)
    assert renderer.tokenizer.decode(ids).endswith("assistant\n" + PREFILL)
    assert not renderer.eos & set(ids[-3:])  # <|im_end|> is an end of turn: not there
    finished = renderer.encode(PREFILLED, add_generation_prompt=False)
    assert renderer.eos & set(finished[-3:])  # as a finished turn it is closed
    assert ids == finished[: len(ids)]


def served_ids(renderer, body: dict) -> list[int]:
    req = parse_chat(body, Defaults())
    return prompt_tokens(req, renderer)[0]


def test_each_route_asks_for_the_continuation(renderer):
    continued = renderer.encode(PREFILLED, continue_final=True)
    # OpenAI (vLLM's fields)
    assert served_ids(renderer, {"messages": PREFILLED, "continue_final_message": True}) == (
        continued
    )
    no_prompt = {"messages": ASK, "add_generation_prompt": False}
    assert served_ids(renderer, no_prompt) == renderer.encode(ASK, add_generation_prompt=False)
    assert served_ids(renderer, {"messages": PREFILLED}) == renderer.encode(PREFILLED)
    # Anthropic: a final assistant message is a prefill, in text blocks too
    blocks = [{"type": "text", "text": PREFILL}]
    for content in (PREFILL, blocks):
        body = {"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": content}]}
        assert served_ids(renderer, anthropic.openai_body(body)) == continued
    plain = anthropic.openai_body({"max_tokens": 5, "messages": ASK})
    assert "continue_final_message" not in plain
    # Ollama's /api/chat: the same
    assert served_ids(renderer, ollama.chat_body({"messages": PREFILLED}, 100)) == continued


def refused(renderer, body: dict) -> RequestError:
    with pytest.raises(RequestError) as e:
        served_ids(renderer, body)
    assert e.value.status == 400
    return e.value


def test_a_prefill_that_cannot_be_continued_is_a_400_naming_the_field(renderer):
    field = "continue_final_message"
    both = {"messages": PREFILLED, field: True, "add_generation_prompt": True}
    assert refused(renderer, both).param == field
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    calling = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]}]
    e = refused(renderer, {"messages": calling, field: True})
    assert e.param == field and "tool calls" in str(e)
    # A template that leaves the assistant's text out has nothing to continue.
    from llama_tp.checkpoints.chat_template import PromptRenderer

    drops = PromptRenderer(renderer.tokenizer)
    drops.template = (
        "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    )
    e = refused(drops, {"messages": PREFILLED, field: True})
    assert e.param == field and "final message does not appear" in str(e)
    # Anthropic's own rule, named as Anthropic names fields
    for content in ("The answer is ", "  ", [{"type": "text", "text": "{\n"}]):
        body = {"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": content}]}
        with pytest.raises(RequestError) as e:
            anthropic.openai_body(body)
        assert e.value.param == "messages.1.content" and "trailing whitespace" in str(e.value)
    # A final tool_use turn is no prefill: it stays a finished turn (its result comes next).
    use = [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]
    body = {"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": use}]}
    assert "continue_final_message" not in anthropic.openai_body(body)
