"""The Anthropic (/v1/messages, with the real `anthropic` client) and Ollama (/api/*, its
documented NDJSON wire format over plain HTTP) routes of `python -m llama_tp.serve`, on
the tiny model on 1 and 2 ranks and the built-in model on 2 ranks: the same greedy text
as the OpenAI route, a prefill continued, stop reasons, usage, keys, and bad input
answered with a 4xx while the server keeps serving. One launch per server serves the
whole module."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
anthropic = pytest.importorskip("anthropic")
from serve_client import KEY, Server, chat, complete, http  # noqa: E402

pytestmark = pytest.mark.ranks
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def servers(tiny_dir, default_gguf, tmp_path_factory):
    """{"tiny-1", "tiny-2", "built-in-2"}: the tiny model on 1 and 2 ranks, the built-in
    (an instruct model that answers "Paris") on 2, behind the API key."""
    tmp = tmp_path_factory.mktemp("wire-logs")
    running = {}
    try:
        for name, ranks, model in [
            ("tiny-1", 1, tiny_dir),
            ("tiny-2", 2, tiny_dir),
            ("built-in-2", 2, default_gguf),
        ]:
            running[name] = Server(ranks, model, tmp, launcher="llama_tp")
        for s in running.values():
            s.wait_ready()
        yield running
    finally:
        for s in running.values():
            s.close()


def claude(s: Server, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", KEY)
    return anthropic.Anthropic(base_url=s.base, max_retries=0, timeout=60, **kw)


def ollama(s: Server, route: str, body: dict) -> list[dict]:
    """The NDJSON lines (or the one JSON answer) of an Ollama route."""
    code, text = http(f"{s.base}/api/{route}", body, BEARER, timeout=60)
    assert code == 200, text
    return [json.loads(line) for line in text.splitlines()]


def streamed(s: Server, messages, max_tokens: int, **kw):
    """(text, stop_reason, final message) of an Anthropic stream."""
    with claude(s).messages.stream(model="m", max_tokens=max_tokens, messages=messages, **kw) as st:
        text = "".join(st.text_stream)
        m = st.get_final_message()
    return text, m.stop_reason, m


STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


@pytest.mark.parametrize("name, max_tokens", [("tiny-1", 12), ("tiny-2", 12), ("built-in-2", 40)])
def test_anthropic_and_ollama_give_the_openai_text(servers, name, max_tokens):
    s = servers[name]
    text, finish, usage = chat(s.client(), None, True, messages=QUESTION, max_tokens=max_tokens)
    assert text
    if name == "built-in-2":
        assert "Paris" in text and finish == "stop"  # an answer that ends on its own
    # Anthropic, streamed and not
    m = claude(s).messages.create(model="claude-x", max_tokens=max_tokens, messages=QUESTION)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert m.stop_reason == STOP_REASONS[finish] and m.stop_sequence is None
    assert m.usage.output_tokens == usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    stext, sreason, sm = streamed(s, QUESTION, max_tokens)
    assert (stext, sreason) == (text, m.stop_reason)
    assert sm.usage.output_tokens == usage.completion_tokens
    assert sm.usage.input_tokens + sm.usage.cache_read_input_tokens == usage.prompt_tokens
    # Ollama: stream defaults to true
    options = {"num_predict": max_tokens}
    lines = ollama(s, "chat", {"model": "m", "messages": QUESTION, "options": options})
    assert len(lines) > 2 and not any(x["done"] for x in lines[:-1]) and lines[-1]["done"]
    assert "".join(x["message"]["content"] for x in lines) == text
    last = lines[-1]
    assert last["done_reason"] == finish
    assert (last["eval_count"], last["prompt_eval_count"]) == (
        usage.completion_tokens,
        usage.prompt_tokens,
    )
    assert last["total_duration"] >= last["eval_duration"] > 0
    (whole,) = ollama(s, "chat", {"messages": QUESTION, "options": options, "stream": False})
    assert whole["done"] and whole["message"] == {"role": "assistant", "content": text}
    prompt = QUESTION[0]["content"]
    gen = ollama(s, "generate", {"prompt": prompt, "options": options})
    assert "".join(x["response"] for x in gen) == text
    # raw: the text completion route, no template
    raw = {"prompt": prompt, "raw": True, "stream": False, "options": options}
    assert ollama(s, "generate", raw)[0]["response"] == complete(
        s.client(), prompt, max_tokens=max_tokens
    )
    count = claude(s).messages.count_tokens(model="m", messages=QUESTION)
    assert count.input_tokens == usage.prompt_tokens


PREFILL = "The capital of France"


def test_a_final_assistant_message_is_a_prefill_the_reply_continues(
    servers, tiny_dir, default_gguf
):
    from llama_tp import load
    from llama_tp.checkpoints.chat_template import renderer_for

    messages = [*QUESTION, {"role": "assistant", "content": PREFILL}]
    for name, model, n in [("tiny-1", tiny_dir, 12), ("built-in-2", default_gguf, 30)]:
        s = servers[name]
        # What the model writes after the rendered prompt with the prefill, through the
        # raw completion route (token ids: no template).
        ids = renderer_for(load(model)[1]).encode(messages, continue_final=True)
        raw = s.client().completions.create(model="m", prompt=ids, max_tokens=n, temperature=0)
        expected = raw.choices[0].text
        m = claude(s).messages.create(model="m", max_tokens=n, messages=messages)
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected, name
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
        # The same prompt again: read from the prompt cache, the same text.
        assert m.usage.cache_read_input_tokens > 0
        stext, _, sm = streamed(s, messages, n)
        assert stext == expected and sm.usage.cache_read_input_tokens > 0
        prefill = {"continue_final_message": True, "add_generation_prompt": False}
        assert (
            chat(s.client(), None, messages=messages, max_tokens=n, extra_body=prefill)[0]
            == expected
        )
        lines = ollama(s, "chat", {"messages": messages, "options": {"num_predict": n}})
        assert "".join(x["message"]["content"] for x in lines) == expected
    # The built-in model finishes the sentence; the reply holds only what follows the prefill.
    assert "Paris" in expected and not expected.startswith(PREFILL)
    # The next turn holds the prefill and reply as one finished turn: read from the cache.
    turn2 = [
        *QUESTION,
        {"role": "assistant", "content": PREFILL + expected},
        {"role": "user", "content": "And of Germany?"},
    ]
    m2 = claude(s).messages.create(model="m", max_tokens=4, messages=turn2)
    assert m2.usage.cache_read_input_tokens >= len(ids)


def test_system_prompt_stop_sequences_and_sampling_options(servers):
    s = servers["built-in-2"]
    system = "You answer in one word."
    with_system = [{"role": "system", "content": system}, *QUESTION]
    text, finish, usage = chat(s.client(), None, messages=with_system, max_tokens=30)
    _, _, plain = chat(s.client(), None, messages=QUESTION, max_tokens=30)
    assert usage.prompt_tokens != plain.prompt_tokens  # the system prompt is in the prompt
    for form in (system, [{"type": "text", "text": system}]):
        m = claude(s).messages.create(model="m", max_tokens=30, system=form, messages=QUESTION)
        assert m.content[0].text == text and m.stop_reason == STOP_REASONS[finish]
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    (gen,) = ollama(
        s,
        "generate",
        {
            "prompt": QUESTION[0]["content"],
            "system": system,
            "stream": False,
            "options": {"num_predict": 30},
        },
    )
    assert gen["response"] == text and gen["prompt_eval_count"] == usage.prompt_tokens

    # A stop sequence ends the reply before it, as OpenAI's stop does.
    cut, cfinish, _ = chat(s.client(), None, messages=QUESTION, max_tokens=40, stop=["Paris"])
    assert cfinish == "stop" and "Paris" not in cut
    m = claude(s).messages.create(
        model="m", max_tokens=40, messages=QUESTION, stop_sequences=["Paris", "Rome"]
    )
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == (cut, "stop_sequence", "Paris")
    stext, sreason, sm = streamed(s, QUESTION, 40, stop_sequences=["Paris"])
    assert (stext, sreason, sm.stop_sequence) == (cut, "stop_sequence", "Paris")
    (line,) = ollama(
        s, "chat", {"messages": QUESTION, "stream": False, "options": {"stop": ["Paris"]}}
    )
    assert line["message"]["content"] == cut and line["done_reason"] == "stop"

    # Sampled: Ollama's options (temperature, top_p, top_k, seed) as OpenAI's fields.
    sampling = {"temperature": 1.0, "top_p": 0.9, "seed": 7}
    want, _, _ = chat(
        s.client(), None, messages=QUESTION, max_tokens=10, **sampling, extra_body={"top_k": 20}
    )
    options = {**sampling, "top_k": 20, "num_predict": 10}
    (line,) = ollama(s, "chat", {"messages": QUESTION, "stream": False, "options": options})
    assert line["message"]["content"] == want
    # Anthropic's temperature / top_p / top_k (sent in the body; no seed: the server picks)
    m = claude(s).messages.create(
        model="m", max_tokens=10, messages=QUESTION, extra_body={"temperature": 0, "top_k": 1}
    )
    assert m.content[0].text == chat(s.client(), None, messages=QUESTION, max_tokens=10)[0]


BAD = [  # (a change to a good Messages body, the field its 400 names)
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content.0.type",
    ),
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
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    (
        {
            "tools": [{"name": "f", "input_schema": {}}],
            "tool_choice": {"type": "tool", "name": "g"},
        },
        "tool_choice.name",
    ),
]


def test_keys_and_bad_input_get_a_4xx_in_each_apis_shape(servers):
    good = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    for name in ("tiny-1", "tiny-2"):
        s = servers[name]
        url = f"{s.base}/v1/messages"
        # The key: x-api-key (the client's default), or a bearer token; the version header
        assert claude(s).messages.create(**good).stop_reason == "max_tokens"
        assert claude(s, api_key=None, auth_token=KEY).messages.create(**good).content
        assert http(url, good, {"x-api-key": KEY, "anthropic-version": "2023-06-01"})[0] == 200
        assert http(f"{s.base}/v1/models", None, {"x-api-key": KEY})[0] == 200
        with pytest.raises(anthropic.AuthenticationError) as e:
            claude(s, api_key="wrong").messages.create(**good)
        assert e.value.body["type"] == "error"
        assert e.value.body["error"]["type"] == "authentication_error"
        code, text = http(url, good)
        assert code == 401 and json.loads(text)["error"]["type"] == "authentication_error"
        code, text = http(f"{s.base}/api/chat", {"messages": good["messages"]})
        assert code == 401 and "API key" in json.loads(text)["error"]
        assert http(f"{s.base}/api/tags", None, {"x-api-key": "wrong"})[0] == 401

        # A bad body: 400 naming the field, in Anthropic's shape
        for change, field in BAD:
            code, text = http(url, {**good, **change}, {"x-api-key": KEY})
            err = json.loads(text)
            assert code == 400 and err["type"] == "error", (change, text)
            assert err["error"]["type"] == "invalid_request_error"
            assert err["error"]["message"].startswith(f"{field}: "), (field, err)
        with pytest.raises(anthropic.BadRequestError) as e:
            claude(s).messages.create(
                model="m", messages=good["messages"], max_tokens=3, system=[{"type": "image"}]
            )
        assert "system.0.type" in e.value.body["error"]["message"]
        code, text = http(url, b"{not json", {"x-api-key": KEY})
        assert code == 400 and "not valid JSON" in json.loads(text)["error"]["message"]
        long = {**good, "messages": [{"role": "user", "content": "hi " * 5000}]}
        code, text = http(url, long, {"x-api-key": KEY})
        assert code == 400 and "context" in json.loads(text)["error"]["message"], text
        # ... and Ollama's
        for route, body, field in [
            (
                "chat",
                {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
                "messages.0.images",
            ),
            (
                "chat",
                {"messages": good["messages"], "options": {"temperature": "hot"}},
                "options.temperature",
            ),
            ("generate", {"prompt": "hi", "options": {"top_p": 0}}, "options.top_p"),
        ]:
            code, text = http(f"{s.base}/api/{route}", body, BEARER)
            assert code == 400 and json.loads(text)["error"].startswith(f"{field}: "), text
        assert http(f"{s.base}/api/chat", b"[1, 2", BEARER)[0] == 400
        # ... and the server keeps serving, its ranks in agreement
        m = claude(s).messages.create(**{**good, "max_tokens": 8})
        assert m.content[0].text == chat(s.client(), "hi", max_tokens=8)[0]


def test_ollama_tags_show_and_version(servers):
    s = servers["tiny-2"]
    (tags,) = ollama(s, "tags", None)
    (model,) = tags["models"]
    ids = [m.id for m in s.client().models.list().data]
    assert model["name"] == model["model"] == f"{ids[0]}:latest"
    code, text = http(f"{s.base}/api/show", {"model": model["name"]}, BEARER)
    info = json.loads(text)["model_info"]
    assert code == 200 and info["llama_tp.context_length"] > 0
    code, text = http(f"{s.base}/api/version", None, BEARER)
    assert code == 200 and json.loads(text)["version"]
    # Ollama's "load the model" requests: an empty prompt or no messages
    (line,) = ollama(s, "generate", {"model": model["name"]})
    assert line["done"] and line["done_reason"] == "load" and line["response"] == ""
