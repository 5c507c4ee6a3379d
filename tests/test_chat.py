"""The chat API (`llama_tp.Chat`) in one process and across ranks. The command through
pipes is test_chat_command.py, the terminal test_chat_tty.py; the examples test_examples.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import launch, run_python

WARN = "exited with code"

# Run on every rank: two turns (the second streamed, with an optional stop string),
# then every rank's view, gathered; rank 0 prints it as JSON.
SPMD_CHAT = """
import json, sys
from dataclasses import asdict
from llama_tp import Chat, load
from llama_tp.cluster.distributed import all_gather_object, print0

path, max_tokens, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
chat = Chat(*load(path), system="You are a helpful assistant.", max_tokens=max_tokens)
first = chat.send("What is the capital of France?")
s1 = asdict(chat.last_stats)
chat.stop = stop
pieces = list(chat.stream("And of Germany?"))
view = dict(replies=[first, "".join(pieces)], pieces=pieces, stats=[s1, asdict(chat.last_stats)],
            history=chat.history)
views = all_gather_object(view)
print0(json.dumps(dict(views=views)))
"""


def run_spmd_chat(tmp_path: Path, n: int, model, max_tokens: int, stop: list[str], timeout=300):
    script = tmp_path / "spmd_chat.py"
    script.write_text(SPMD_CHAT)
    args = [str(script), str(model), str(max_tokens), *stop]
    # One rank: a plain process (mlx.launch -n 1 gives the ring backend an empty hostfile).
    r = run_python(args, timeout=timeout) if n == 1 else launch(n, args, timeout=timeout)
    assert WARN not in r.stderr and r.stdout.strip(), r.stderr
    views = json.loads(r.stdout.strip().splitlines()[-1])["views"]
    for view in views:  # speeds are each rank's own
        for s in view["stats"]:
            del s["prompt_tps"], s["generation_tps"]
    assert len(views) == n and all(v == views[0] for v in views), f"ranks disagree: {views}"
    return views[0]


def check_spmd_view(view: dict, stop: list[str]) -> None:
    s1, s2 = view["stats"]
    # The second turn prefills only its own tokens: everything the cache held is reused.
    assert s2["reused_tokens"] == s1["context_tokens"] > s1["prompt_tokens"]
    assert s2["prefilled_tokens"] == s2["prompt_tokens"] - s1["context_tokens"]
    assert 0 < s2["prefilled_tokens"] < s1["prompt_tokens"]
    roles = [m["role"] for m in view["history"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in view["history"][2::2]] == view["replies"]
    if stop:
        assert s2["stop_string"] == stop[0] and s2["finish_reason"] == "stop"
        assert all(s not in view["replies"][1] for s in stop)


# -- in one process -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from llama_tp import load

    return load(tiny_dir)


def make_chat(tiny, **kwargs):
    from llama_tp import Chat

    kwargs.setdefault("max_tokens", 20)
    return Chat(*tiny, **kwargs)


def test_chat_is_exported_lazily():
    r = run_python(
        [
            "-c",
            "import sys, llama_tp; assert 'llama_tp.conversation.chat' not in sys.modules; "
            "from llama_tp import Chat; print(Chat.__module__)",
        ]
    )
    assert r.returncode == 0 and r.stdout.strip() == "llama_tp.conversation.chat", r.stderr


def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_prefill(tiny):
    from mlx_lm.models.cache import make_prompt_cache

    from llama_tp.engine.generation import stream_generate

    chat = make_chat(tiny)
    first = chat.send("hello")
    s1 = chat.last_stats
    assert s1.reused_tokens == 0 and s1.prefilled_tokens == s1.prompt_tokens
    assert s1.generated_tokens == 20 and s1.finish_reason == "length"
    # max_tokens reached: the last token was sampled but never fed to the model.
    assert s1.context_tokens == s1.prompt_tokens + 20 - 1
    second = chat.send("how are you?")
    s2 = chat.last_stats
    assert s2.reused_tokens == s1.context_tokens
    assert s2.prefilled_tokens == s2.prompt_tokens - s1.context_tokens
    assert chat.history == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "how are you?"},
        {"role": "assistant", "content": second},
    ]
    # The cached turn gives what the same prompt gives from an empty cache.
    model, tokenizer = tiny
    prompt = chat._render(chat.history[:3])
    assert len(prompt) == s2.prompt_tokens
    fresh = stream_generate(model, tokenizer, prompt, max_tokens=20, cache=make_prompt_cache(model))
    assert "".join(r.text for r in fresh) == second


def test_first_turn_is_tokenized_like_generate(tiny, default_gguf):
    from llama_tp import Chat, load
    from llama_tp.checkpoints.chat_template import PromptRenderer
    from llama_tp.checkpoints.tokenizer import encode_prompt

    for model, tokenizer in (tiny, load(default_gguf)):
        for system in (None, "Be brief."):
            chat = Chat(model, tokenizer, system)
            messages = [*chat.history, {"role": "user", "content": "hi"}]
            assert chat._render(messages) == encode_prompt(tokenizer, "hi", system)
            # The template's end of turn is an EOS token of both.
            assert PromptRenderer(tokenizer)._end_of_turn() == set(tokenizer.eos_token_ids) == {2}


def pick_stop(text: str, at: int = 10) -> tuple[str, str]:
    """A 3-character stop string that first occurs at or after `at`, and the text before it."""
    for i in range(at, len(text) - 3):
        stop = text[i : i + 3]
        if text.find(stop) == i and stop.strip():
            return stop, text[:i]
    raise AssertionError(f"no stop string in {text!r}")


def test_stop_strings_end_the_reply_and_are_never_shown(tiny):
    full = make_chat(tiny, max_tokens=60).send("hello")
    stop, before = pick_stop(full)
    chat = make_chat(tiny, max_tokens=60, stop=[stop, "never there"])
    pieces = list(chat.stream("hello"))
    assert "".join(pieces) == before  # nothing past the stop string was ever yielded
    assert chat.history[-1] == {"role": "assistant", "content": before}
    s = chat.last_stats
    assert s.finish_reason == "stop" and s.stop_string == stop and s.generated_tokens < 60
    chat.send("go on")  # the conversation continues from a cache that held the stop string
    assert chat.last_stats.reused_tokens > 0 and len(chat.history) == 4


def test_stop_string_helpers():
    from llama_tp.engine.stops import find_stop, partial_stop

    assert find_stop("abc STOP def", ["STOP", "c S"]) == (2, "c S")
    assert find_stop("abc", ["x"]) == (3, None)
    assert partial_stop("hello ST", ["STOP"]) == 2
    assert partial_stop("hello S", ["STOP", "S!"]) == 1
    assert partial_stop("hello", ["STOP"]) == 0
    assert partial_stop("STO", ["STOP"]) == 3


def test_should_stop_and_closing_the_stream_keep_the_reply_so_far(tiny):
    full = make_chat(tiny, max_tokens=30).send("hello")
    calls = []
    chat = make_chat(tiny, max_tokens=30, should_stop=lambda: calls.append(1) or len(calls) >= 5)
    part = chat.send("hello")
    s = chat.last_stats
    assert s.finish_reason == "interrupted" and s.generated_tokens == 5
    assert part and full.startswith(part) and part != full
    assert chat.history[-1]["content"] == part
    chat.should_stop = None
    chat.send("again")
    assert chat.last_stats.reused_tokens == s.context_tokens

    chat = make_chat(tiny, max_tokens=30)
    stream = chat.stream("hello")
    seen = [next(stream) for _ in range(3)]
    stream.close()
    assert chat.history[-1] == {"role": "assistant", "content": "".join(seen)}
    assert chat.last_stats.finish_reason == "interrupted"
    chat.send("again")
    assert len(chat.history) == 4


def test_reset_and_system_prompt(tiny):
    chat = make_chat(tiny, system="You are terse.")
    first = chat.send("hello")
    chat.send("more")
    chat.reset()
    assert chat.history == [{"role": "system", "content": "You are terse."}]
    assert chat.send("hello") == first  # the same conversation again, greedy
    assert chat.last_stats.reused_tokens > 0  # the system prompt was still in the cache
    chat.system = "You are verbose."
    assert chat.history[0] == {"role": "system", "content": "You are verbose."}
    chat.system = None
    assert chat.system is None and chat.history[0]["role"] == "user"
    chat.system = "Back."
    assert chat.history[0]["content"] == "Back." and len(chat.history) == 3


def test_context_overflow_is_an_error_by_default(tiny):
    from llama_tp.chat import ContextOverflowError

    chat = make_chat(tiny, max_context=70)
    chat.send("hello")
    before = list(chat.history)
    with pytest.raises(
        ContextOverflowError,
        match=r"prompt tokens \+ max_tokens 20 = \d+ tokens, "
        r"over the context limit of 70",
    ):
        chat.send("hello again")
    assert chat.history == before  # nothing changed
    assert issubclass(ContextOverflowError, ValueError)
    # The default limit is the model's max_position_embeddings (512 for tiny).
    assert make_chat(tiny).max_context == 512


def test_context_overflow_drops_the_oldest_turns(tiny):
    from llama_tp.chat import ContextOverflowError

    chat = make_chat(tiny, system="Hi.", max_context=140, overflow="drop_oldest")
    dropped = []
    for text in ("one", "two", "three", "four"):
        chat.send(text)
        s = chat.last_stats
        dropped.append(s.dropped_messages)
        assert s.prompt_tokens + chat.max_tokens <= 140
    assert sum(dropped) > 0 and all(d % 2 == 0 for d in dropped)  # whole turns go
    assert chat.history[0] == {"role": "system", "content": "Hi."}
    assert chat.history[-2] == {"role": "user", "content": "four"}
    with pytest.raises(ContextOverflowError, match="the message alone needs"):
        chat.send("x " * 200)


def test_sampling_is_reproducible_with_a_seed(tiny):
    def replies(seed):
        chat = make_chat(tiny, temp=1.0, seed=seed)
        return [chat.send("hello"), chat.send("hello")]

    a = replies(7)
    assert a == replies(7)
    assert a[0] != a[1]  # each turn has its own seed
    assert a != replies(8)


def test_bad_arguments(tiny):
    for kwargs in (
        dict(max_tokens=0),
        dict(temp=-1),
        dict(top_p=0),
        dict(min_p=2),
        dict(top_k=-1),
        dict(overflow="truncate"),
        dict(stop=[""]),
        dict(max_context=0),
    ):
        with pytest.raises(ValueError):
            make_chat(tiny, **kwargs)
    with pytest.raises(TypeError):
        make_chat(tiny).send(["hello"])


def test_models_without_a_chat_template_get_a_plain_one(tmp_path):
    from fixtures import write_hf_model

    from llama_tp import load

    path = write_hf_model(tmp_path / "base")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    chat = make_chat(load(path), system="Be nice.")
    reply = chat.send("hello")
    assert "\nUser:" not in reply
    assert chat.tokenizer.decode(chat._render(chat.history[:2])).endswith("User: hello\nAssistant:")


NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_a_template_that_rejects_the_conversation_is_a_clear_error(tiny_dir):
    from llama_tp import Chat, load
    from llama_tp.chat import ChatTemplateError

    model, tokenizer = load(tiny_dir)
    tokenizer.chat_template = NO_SYSTEM
    chat = Chat(model, tokenizer, max_tokens=5)
    chat.send("hello")
    chat.system = "Be brief."
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        chat.send("again")
    assert len(chat.history) == 3  # unchanged
    chat.system = None
    chat.send("again")
    assert chat.last_stats.reused_tokens > 0


# -- across ranks ------------------------------------------------------------------


def test_chat_api_across_ranks_tiny(tmp_path, tiny_dir):
    plain = run_spmd_chat(tmp_path, 1, tiny_dir, 40, [])
    check_spmd_view(plain, [])
    stop, before = pick_stop(plain["replies"][1])
    views = [run_spmd_chat(tmp_path, n, tiny_dir, 40, [stop]) for n in (1, 2)]
    assert views[0] == views[1]  # greedy: the same on one rank and two
    check_spmd_view(views[0], [stop])
    assert views[0]["replies"] == [plain["replies"][0], before]


def test_chat_api_default_model_one_and_two_ranks(tmp_path, default_gguf):
    stop = [" Berlin"]
    views = [run_spmd_chat(tmp_path, n, default_gguf, 12, stop, timeout=600) for n in (1, 2)]
    for view in views:
        check_spmd_view(view, stop)
        assert "Paris" in view["replies"][0]
        assert view["replies"][1].endswith("Germany is")
    assert views[0]["replies"] == views[1]["replies"]
    assert [s["prefilled_tokens"] for s in views[0]["stats"]] == [
        s["prefilled_tokens"] for s in views[1]["stats"]
    ]
