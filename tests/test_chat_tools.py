"""Tool calls in the Python `Chat` (conversation/chat_tools.py), in one process: a tiny model
with Qwen3's release template and tokens (tests/chat_families.py; the built-in model's
SmolLM2 template shows no tools); a named `tool_choice` makes the random model write a
call (constrained), which must come back parsed in `last_tool_calls` and stay in the
history, and a tool result must go back into the template for the next reply, reusing
the cache."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")
from chat_families import write_family_model  # noqa: E402
from test_serve_tools import TOOLS  # noqa: E402

CITIES = TOOLS[0]["function"]["parameters"]["properties"]["city"]["enum"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat-tools") / "qwen3"
    return write_family_model("qwen3", path, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def hermes(qwen3_dir):
    """Qwen3's model: its calls in Hermes' `<tool_call>` JSON."""
    from llama_tp import load

    return load(qwen3_dir)


def test_a_call_comes_back_and_its_result_goes_into_the_next_turn(hermes):
    from mlx_lm.models.cache import make_prompt_cache

    from llama_tp import Chat
    from llama_tp.engine.generation import stream_generate

    model, tokenizer = hermes
    chat = Chat(model, tokenizer, tools=TOOLS, max_tokens=120)
    assert "get_weather" in chat._apply([{"role": "user", "content": "hi"}], tokenize=False)
    pieces = list(chat.stream("What is the weather in Paris?", tool_choice="get_weather"))
    assert pieces == []  # the reply is the call: no text
    (call,) = chat.last_tool_calls
    # Ids are the same on every rank (turn 0, call 0): the history must be.
    assert call["type"] == "function" and call["id"] == "call_0_0"
    assert call["function"]["name"] == "get_weather"
    assert set(call["function"]["arguments"]) == {"city"}
    assert call["function"]["arguments"]["city"] in CITIES
    assert chat.last_stats.finish_reason == "stop"
    assert chat.history[-1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    first = chat.last_stats

    reply = chat.send_tool_result(call["id"], {"temp_c": 18})
    tool = {
        "role": "tool",
        "tool_call_id": call["id"],
        "name": "get_weather",
        "content": '{"temp_c": 18}',
    }
    assert chat.history[-2] == tool and chat.history[-1]["content"] == reply
    assert chat.last_tool_calls == []  # "auto": the random model writes text
    # The template renders the call and its result as the model's format has them.
    shown = chat._apply(chat.history[:-1], tokenize=False)
    city = call["function"]["arguments"]["city"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + city in shown
    assert '<tool_response>\n{"temp_c": 18}\n</tool_response>' in shown
    # The cache held the first turn: its prompt and the call, all the template renders
    # again (but the end of turn the model wrote last, not yet fed). The reply is what the
    # same prompt gives from an empty cache.
    assert chat.last_stats.reused_tokens == first.prompt_tokens + first.generated_tokens - 1
    assert shown.count("<|im_start|>assistant\n<tool_call>") == 1
    prompt = chat._render(chat.history[:-1])
    fresh = stream_generate(
        model, tokenizer, prompt, max_tokens=120, cache=make_prompt_cache(model)
    )
    assert "".join(r.text for r in fresh) == reply

    # A call answered by its function's name; several results before one reply.
    chat.send("And in Lima?", tool_choice="required")
    (again,) = chat.last_tool_calls
    chat.add_tool_result(again["function"]["name"], "cloudy")
    assert chat.history[-1]["tool_call_id"] == again["id"]
    with pytest.raises(ValueError, match="no tool call 'nope' to answer"):
        chat.add_tool_result("nope", "x")


def test_bad_tool_choices_raise_before_anything_changes(hermes, default_gguf):
    from llama_tp import Chat, load

    chat = Chat(*hermes, tools=TOOLS, max_tokens=4)
    with pytest.raises(ValueError, match="tool_choice 'other' is not one of the tools"):
        chat.send("hi", tool_choice="other")
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        Chat(*hermes).send("hi", tool_choice="required")
    # SmolLM2's template has no tool-call format: a call cannot be forced.
    with pytest.raises(ValueError, match="no tool-call format"):
        Chat(*load(default_gguf), tools=TOOLS).send("hi", tool_choice="required")
    assert chat.history == [] and chat.last_stats is None


# Run on every rank: a forced call, its result, the next reply; rank 0 prints every view.
SPMD_TOOLS = """
import json, sys
from llama_tp import Chat, load
from llama_tp.cluster.distributed import all_gather_object, print0

chat = Chat(*load(sys.argv[1]), tools=json.loads(sys.argv[2]), max_tokens=100)
chat.send("What is the weather in Paris?", tool_choice="get_weather")
calls = chat.last_tool_calls
reply = chat.send_tool_result(calls[0]["id"], "sunny")
print0(json.dumps(all_gather_object(dict(calls=calls, reply=reply, history=chat.history))))
"""


def test_ranks_agree_on_the_calls_and_the_history(hermes, qwen3_dir, tmp_path):
    import json

    from conftest import launch

    from llama_tp import Chat

    d = qwen3_dir
    script = tmp_path / "spmd_tools.py"
    script.write_text(SPMD_TOOLS)
    r = launch(2, [str(script), str(d), json.dumps(TOOLS)], timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    views = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(views) == 2 and views[0] == views[1]
    # ... and with one process (the tiny model in float32: the same greedy tokens)
    chat = Chat(*hermes, tools=TOOLS, max_tokens=100)
    chat.send("What is the weather in Paris?", tool_choice="get_weather")
    calls = chat.last_tool_calls
    reply = chat.send_tool_result(calls[0]["id"], "sunny")
    assert views[0] == dict(calls=calls, reply=reply, history=chat.history)
