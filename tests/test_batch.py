"""The batched engine without HTTP (llama_tp.engine.batch), on one process."""

from __future__ import annotations

import pytest

from llama_tp import load
from llama_tp.checkpoints.tokenizer import encode_prompt
from llama_tp.engine.batch import (
    BatchEngine,
    Decision,
    Join,
    SamplingParams,
    batch_generate,
)
from llama_tp.engine.generation import stream_generate
from llama_tp.engine.stops import partial_stop

PROMPTS = ["hello", "The quick brown fox", "Tensor parallel", "abc", "Où est la gare?"]


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load(tiny_dir)


def test_batch_equals_one_at_a_time(loaded):
    model, tok = loaded
    alone = [
        "".join(r.text for r in stream_generate(model, tok, encode_prompt(tok, p), max_tokens=20))
        for p in PROMPTS
    ]
    # max_batch 3: rows leave and later prompts join mid-way.
    res = batch_generate(model, tok, PROMPTS, max_tokens=20, max_batch=3)
    assert [r.text for r in res] == alone
    assert all(r.finish_reason == "length" and len(r.tokens) == 20 for r in res)


def test_seeded_rows_do_not_depend_on_the_batch(loaded):
    model, tok = loaded
    for top_p in (1.0, 0.9):
        one = batch_generate(model, tok, PROMPTS[:1], temp=1.0, top_p=top_p, seeds=[5])[0]
        many = batch_generate(model, tok, PROMPTS, temp=1.0, top_p=top_p, seeds=[5, 1, 2, 3, 4])
        assert many[0].tokens == one.tokens


def test_prompt_cache_prefills_only_the_new_tokens(loaded):
    model, tok = loaded
    engine = BatchEngine(model, tok, prompt_cache_size=4)
    p1 = encode_prompt(tok, "hello")
    engine.apply(Decision(joins=[Join(1, p1, SamplingParams(max_tokens=8))]))
    reply = []
    while len(engine):
        reply += [e.token for e in engine.step()]
    before = engine.prefilled_tokens
    p2 = p1 + reply + tok.encode("abc", add_special_tokens=False)
    engine.apply(Decision(joins=[Join(2, p2, SamplingParams(max_tokens=8))]))
    events = []
    while len(engine):
        events += engine.step()
    # The cache holds the prompt and every reply token but the last (never fed back).
    assert events[0].cached_tokens == len(p1) + len(reply) - 1
    assert engine.prefilled_tokens - before == len(p2) - events[0].cached_tokens
    fresh = batch_generate(model, tok, [p2], max_tokens=8)[0]
    assert [e.token for e in events] == fresh.tokens


def test_stop_strings_end_and_are_cut(loaded):
    model, tok = loaded
    full = batch_generate(model, tok, ["Ranks share"], max_tokens=20)[0].text
    stop = full[6:9]
    r = batch_generate(model, tok, ["Ranks share"], max_tokens=20, stop=(stop,))[0]
    assert r.text == full[: full.index(stop)] and r.finish_reason == "stop"
    assert partial_stop("abc", ("cde",)) == 1 and partial_stop("abc", ("x",)) == 0
    assert partial_stop("abcd", ("bcdz", "dz")) == 3


def test_cancel_leaves_the_other_rows(loaded):
    model, tok = loaded
    engine = BatchEngine(model, tok)
    ids = [encode_prompt(tok, p) for p in PROMPTS[:2]]
    joins = [Join(i, p, SamplingParams(max_tokens=10)) for i, p in enumerate(ids)]
    engine.apply(Decision(joins=joins))
    out = {0: [], 1: []}
    for e in engine.step():
        out[e.uid].append(e.token)
    assert [e.finish_reason for e in engine.apply(Decision(cancels=[0]))] == ["cancelled"]
    while len(engine):
        for e in engine.step():
            out[e.uid].append(e.token)
    assert out[1] == batch_generate(model, tok, [ids[1]], max_tokens=10)[0].tokens


def test_serve_without_fastapi_says_how_to_install_it():
    from conftest import run_python

    code = (
        "import sys, runpy; sys.modules['fastapi'] = None; sys.argv = ['serve']; "
        "runpy.run_module('llama_tp.serve', run_name='__main__')"
    )
    r = run_python(["-c", code], timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "error: the server needs FastAPI, uvicorn and prometheus_client: "
        'pip install "llama_tp[serve]"'
    ]


def _run(engine: BatchEngine, prompt: list[int], params: SamplingParams):
    engine.apply(Decision(joins=[Join(1, prompt, params)]))
    events = []
    while len(engine):
        events += engine.step()
    return events


def test_drafted_steps_give_plain_greedy_tokens_and_leave_the_cache_as_plain(loaded):
    model, tok = loaded
    prompt = tok.encode("abc abc abc abc abc abc abc abc")

    def run(draft: int, **kw):
        """The events of one request, and of a next turn served from its prompt cache."""
        engine = BatchEngine(model, tok, prompt_cache_size=2)
        events = _run(engine, prompt, SamplingParams(**kw, num_draft_tokens=draft))
        reply = [e.token for e in events]
        nxt = prompt + reply + tok.encode(" abc", add_special_tokens=False)
        return events, _run(engine, nxt, SamplingParams(max_tokens=8))

    def seen(events):
        return [(e.text, e.token, e.finish_reason, e.cached_tokens) for e in events]

    (plain, plain2), (drafted, drafted2) = (
        run(0, max_tokens=40, logprobs=2),
        run(4, max_tokens=40, logprobs=2),
    )
    assert seen(drafted) == seen(plain)
    assert [e.top_logprobs[0][0] for e in drafted] == [e.top_logprobs[0][0] for e in plain]
    assert drafted[-1].accepted > 0 and drafted[-1].completion_tokens == 40
    # The finished row's cache holds what plain decoding's holds (no rejected drafts).
    assert seen(drafted2) == seen(plain2) and drafted2[0].cached_tokens > len(prompt)
    # Sequences that end inside a step of accepted drafts: the rest of the step is dropped.
    text = "".join(e.text for e in plain)
    stops = [{"max_tokens": 40, "stop": (text[j : j + 3],)} for j in range(0, len(text) - 3, 5)]
    for kw in ({"max_tokens": 3}, *stops):
        (a, a2), (b, b2) = run(0, **kw), run(4, **kw)
        assert seen(b) == seen(a) and seen(b2) == seen(a2)
        assert b[-1].finish_reason == ("length" if "stop" not in kw else "stop")


def test_a_long_prompt_joins_chunk_by_chunk_while_the_rows_decode(loaded):
    """With rows decoding, a prompt longer than a chunk is prefilled one chunk per step
    (the rows get a token after each); it then decodes as it would alone."""
    model, tok = loaded
    short = encode_prompt(tok, "hello")
    long = encode_prompt(tok, " ".join(["tensor parallel"] * 12))
    params = SamplingParams(max_tokens=6)
    alone = [e.token for e in _run(BatchEngine(model, tok, prefill_step_size=8), long, params)]
    engine = BatchEngine(model, tok, prefill_step_size=8)
    engine.apply(Decision(joins=[Join(1, short, SamplingParams(max_tokens=40))]))
    engine.apply(Decision(joins=[Join(2, long, params)]))
    chunks = -(-(len(long) - 1) // 8)
    assert len(engine.rows) == 1 and len(engine) == 2  # one chunk in, the others to come
    got, first = [], []
    for step in range(chunks + 8):
        events = engine.step()
        first += [e.uid for e in events if e.uid == 1]
        got += [e.token for e in events if e.uid == 2]
        if step < chunks - 2:  # the last chunk's step feeds the last token too: it joins
            assert [r.uid for r in engine.rows] == [1], step  # still filling
    assert len(first) == chunks + 8  # row 1 had a token at every step
    assert got == alone
    assert engine.prefilled_tokens == len(short) + len(long)
    # A prompt cancelled while it fills ends alone.
    engine.apply(Decision(joins=[Join(3, long, params)]))
    events = engine.apply(Decision(cancels=[3]))
    assert [(e.uid, e.finish_reason) for e in events] == [(3, "cancelled")]
    assert [r.uid for r in engine.rows] == [1] and len(engine) == 1


def test_the_drivers_take_the_settings_keywords():
    """stream_generate's, Chat's and batch_generate's sampling keywords are those of
    `KEYWORDS` (engine/settings.py), with its defaults: None (the description's) in the two
    that also take `params`, SamplingParams' own in batch_generate; giving a keyword and
    `params` at once is refused by the keyword's name, a bad value named by its keyword."""
    import inspect

    from llama_tp import Chat
    from llama_tp.engine.settings import KEYWORDS, SettingsError, default, request_params

    names = {k.keyword: k.field for k in KEYWORDS}
    for driver in (stream_generate, Chat, batch_generate):
        taken = {n: p.default for n, p in inspect.signature(driver).parameters.items()}
        given = {n: d for n, d in taken.items() if n in names}
        assert {"max_tokens", "temp", "top_p", "min_p", "top_k", "stop"} <= set(given)
        if driver is batch_generate:
            assert given == {n: default(names[n]) for n in given} | {"logprobs": False}
        else:
            assert set(given.values()) == {None} and "params" in taken
    with pytest.raises(TypeError, match=r"not both \(temp\)"):
        request_params("Chat", SamplingParams(), False, {"temp": 0.5})
    with pytest.raises(SettingsError, match="^temp must be >= 0, got -1"):
        request_params("Chat", None, False, {"temp": -1})
