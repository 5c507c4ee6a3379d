"""The server's defences without a server (issue #37): the one parsing path (bodies.py),
the model's limits (limits.py), the guard's hosts and keys (guard.py), grammars refused
when no reply can follow them, the step loop's guard in the batch engine (one row's
failure ends that row alone), the scheduler holding grammar requests until every rank
has compiled them, and a model's over-deep tool call staying text."""

from __future__ import annotations

import json

import pytest

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.tokenizer import load_tokenizer
from llama_tp.engine.batch import BatchEngine, Decision, Join, SamplingParams
from llama_tp.server.bodies import BodyError, decode, dotted_place, openai_param
from llama_tp.server.errors import RequestError
from llama_tp.server.guard import Hosts, key_matches
from llama_tp.server.limits import Limits
from llama_tp.server.protocol import Defaults, parse_chat, parse_completion
from llama_tp.server.scheduler import Scheduler


def test_decode_refuses_what_would_choke_the_steps_after_it():
    def refused(raw: bytes, place=openai_param) -> BodyError:
        with pytest.raises(BodyError) as e:
            decode(raw, 1000, 64, place)
        assert e.value.status == 400
        return e.value

    assert "deeper than 64 levels" in str(refused(b"[" * 900 + b"]" * 900))
    assert "deeper than 64 levels" in str(refused(b"[" * 500 + b"]" * 500))
    assert "holds 1001 JSON objects" in str(refused(b"[" * 1001))
    assert "NaN is not a JSON value" in str(refused(b'{"temperature": NaN}'))
    assert "not valid JSON" in str(refused(b'{"a": '))
    e = refused(b'{"messages": [{"role": "user", "content": "a\\ud800"}]}')
    assert e.param == "messages[0].content" and str(e).startswith("'messages[0].content': a lone")
    e = refused(b'{"messages": [{"content": "\\udc00"}]}', dotted_place)
    assert e.param == "messages.0.content" and str(e).startswith("messages.0.content: a lone")
    e = refused(b'{"logit_bias": {"\\ud800": 1}}')  # a key: the object holding it
    assert e.param == "logit_bias"
    deep = {"a": {}}
    for _ in range(70):
        deep = {"a": deep}
    e = refused(json.dumps({"format": deep}).encode(), dotted_place)
    assert str(e).startswith("format.a.a.a") and "deeper than 64" in str(e)
    assert decode(b'{"x": "\\ud83d\\ude00", "y": [1, 2.5, null]}', 1000, 64, openai_param) == {
        "x": "\U0001f600",
        "y": [1, 2.5, None],
    }


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir):
    return load_tokenizer(open_checkpoint(tiny_dir))


def test_no_token_is_longer_than_the_limits_say(tiny_tokenizer, default_gguf):
    """A prompt of n bytes has at least n / token_bytes tokens: no token decodes to more."""
    for tok in (tiny_tokenizer, load_tokenizer(open_checkpoint(default_gguf))):
        limits = Limits.of(2048, 32000, tok)
        longest = max(len(tok.decode([i]).encode()) for i in range(len(tok.get_vocab())))
        assert longest <= limits.token_bytes <= 4 * longest + 8, (longest, limits.token_bytes)


def test_the_model_bounds_every_api_field_in_one_place():
    limits = Limits(context=4096, vocab=1000, token_bytes=10)
    hi = [{"role": "user", "content": "hi"}]

    def refused(body: dict, chat: bool = True) -> RequestError:
        with pytest.raises(RequestError) as e:
            (parse_chat if chat else parse_completion)(body, Defaults(), limits)
        return e.value

    cases = [
        ({"top_k": 1001}, "top_k", "must be from 0 to 1000 (the model's vocabulary)"),
        ({"repetition_context_size": 4097}, "repetition_context_size", "(the model's context)"),
        ({"repetition_context_size": 2**31 + 1}, "repetition_context_size", "4096"),
        ({"stop": ["s" * 1001]}, "stop", "at most 1000 characters"),
        ({"logit_bias": {"1000": 1}}, "logit_bias", "[0, 1000)"),
        ({"logit_bias": {"²": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias", "token ids"),
        ({"messages": hi * 4097}, "messages", "4097 messages; at most 4096"),
        ({"tools": [{}] * 513}, "tools", "513 tools; at most 512"),
    ]
    for change, param, words in cases:
        e = refused({"messages": hi, **change})
        assert e.param == param and words in str(e), (change, str(e))
    e = refused({"messages": [{"role": "user", "content": "é" * 20481}]})  # 40962 bytes
    assert e.param == "messages" and "40962 bytes, but at most 40960 can fit" in str(e)
    e = refused({"prompt": [5, 1000]}, chat=False)
    assert e.param == "prompt" and "[0, 1000)" in str(e)
    assert parse_chat({"messages": hi, "top_k": 1000}, Defaults(), limits).params.top_k == 1000
    assert limits.body_bytes == 8 << 20 and Limits(4096, 1000, 2048).body_bytes == (17 << 20)


def test_hosts_a_rebinding_page_cannot_name():
    local = Hosts("127.0.0.1")
    for host in ("localhost", "localhost:8080", "127.0.0.1:1", "[::1]:8080", "10.1.2.3", "::1"):
        assert local.allows(host), host
    for host in ("evil.example", "evil.example:8080", "localhost.evil.example", "", "[::1"):
        assert not local.allows(host), host
    extra = Hosts("127.0.0.1", ["llm.example", "*.corp.example"])
    assert extra.allows("llm.example:80") and extra.allows("a.corp.example")
    assert not extra.allows("corp.example.evil") and not extra.allows("xcorp.example")
    assert Hosts("127.0.0.1", ["*"]).allows("anything.example")
    import socket

    assert Hosts("0.0.0.0").allows(socket.gethostname()) and not Hosts().allows("nope.invalid")


def test_the_key_in_any_case_of_its_scheme():
    for header in ("Bearer k1", "bearer k1", "BEARER  k1", " Bearer k1 "):
        assert key_matches({"authorization": header}, "k1"), header
    for header in ("Basic k1", "Bearer k2", "Bearer", "k1", "Bearerk1"):
        assert not key_matches({"authorization": header}, "k1"), header
    assert key_matches({"x-api-key": "k1"}, "k1") and not key_matches({"x-api-key": "k"}, "k1")


def test_a_forced_call_no_reply_can_follow_is_refused(tmp_path):
    """`tool_choice: "required"` with a tool whose schema is a $ref loop: 400 naming tools
    (a template that shows tools: Qwen3's release template, tests/chat_families.py)."""
    from chat_families import write_family_model

    from llama_tp.engine.grammar import GrammarError, compile_grammar
    from llama_tp.server.prompts import grammar_for

    tok = load_tokenizer(open_checkpoint(write_family_model("qwen3", tmp_path / "qwen3")))
    loop = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    fn = {"name": "f", "parameters": loop}
    body = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": fn}]}  # fmt: skip
    req = parse_chat(body, Defaults(), Limits(2048, 32000))
    grammar, field = grammar_for(req, tok)
    assert field == "tools"
    with pytest.raises(GrammarError) as first:
        compile_grammar(grammar, tok, 32000, frozenset(tok.eos_token_ids))
    with pytest.raises(GrammarError) as again:  # the refusal is kept, not compiled again
        compile_grammar(grammar, tok, 32000, frozenset(tok.eos_token_ids))
    assert str(again.value) == str(first.value)


def test_one_rows_failure_ends_that_row_alone(tiny_dir):
    """The step loop's guard: a logits processor that raises mid-reply ends its row with
    finish_reason "error" naming its setting; the other row's text is its text alone."""
    from llama_tp import load

    model, tok = load(tiny_dir)
    prompt = tok.encode("The quick brown fox")
    alone = BatchEngine(model, tok)
    alone.apply(Decision(joins=[Join(2, prompt, SamplingParams(max_tokens=12))]))
    expected = []
    while len(alone):
        expected += [e.token for e in alone.step() if not e.eos]
    engine = BatchEngine(model, tok)
    failing = SamplingParams(max_tokens=12, presence_penalty=0.5)
    engine.apply(
        Decision(joins=[Join(1, prompt, failing), Join(2, prompt, SamplingParams(max_tokens=12))])
    )
    calls = []
    penalty = engine.rows[0].processors[0]

    def breaks(tokens, logits, shard):
        calls.append(1)
        if len(calls) == 3:
            raise IndexError("index 99999 is out of bounds")
        return penalty(tokens, logits, shard)

    breaks.setting = "presence_penalty"
    engine.rows[0].processors = [breaks]
    got, ends = [], {}
    while len(engine):
        for e in engine.step():
            if e.uid == 2 and not e.eos:
                got.append(e.token)
            if e.finish_reason:
                ends[e.uid] = e
    assert got == expected
    failed = ends[1]
    assert failed.finish_reason == "error" and failed.error_setting == "presence_penalty"
    assert failed.error == "index 99999 is out of bounds" and failed.completion_tokens < 12
    assert ends[2].finish_reason == "length"


def test_grammar_requests_join_once_every_rank_has_compiled_them():
    import asyncio

    loop = asyncio.new_event_loop()
    s = Scheduler(max_batch=4, ranks=2)
    s.ready = True
    plain = s.submit([1, 2], SamplingParams(), 0, loop)
    ruled = s.submit([1, 2], SamplingParams(grammar='{"x": 1}'), 0, loop)
    later = s.submit([3], SamplingParams(grammar="g2"), 0, loop)
    assert s.queued() == 3
    (d,) = s.next_decisions([0])
    assert [j.uid for j in d.joins] == [plain.uid]
    s.announce(d)
    assert d.prepare == {ruled.uid: '{"x": 1}', later.uid: "g2"}
    assert d.awaited == [ruled.uid, later.uid]
    s.prepared([[later.uid, ruled.uid, 999]])  # ranks report what they have compiled
    s.cancel(later.uid)
    s.prepared([[ruled.uid]])
    (d,) = s.next_decisions([1])
    assert [j.uid for j in d.joins] == [ruled.uid]
    s.announce(d)
    assert d.prepare == {} and d.awaited == [] and s.queued() == 0
    loop.close()


def test_a_models_over_deep_tool_call_stays_text():
    from llama_tp.conversation.tool_calls import FORMATS, ToolStream

    stream = ToolStream(FORMATS["llama3_json"], None)
    text = '{"name": "f", "parameters": ' + "[" * 5000
    shown = stream.feed(text)  # not arguments (an object): text as soon as that is clear
    rest, calls = stream.finish()
    assert shown + rest == text and calls == []
