"""`python -m llama_tp.serve` on 1 and 2 ranks, driven by the real `openai` client.

One server per rank count serves every test of this module (module-scoped
fixtures); the last test kills rank 1 of the 2-rank server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from conftest import run_python  # noqa: E402
from serve_client import DRAFTS, KEY, REPEAT, Server, chat, complete, http  # noqa: E402

CONTEXT = 2048


@pytest.fixture(scope="module")
def model_dir(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model with a longer context, so that a reply can outlast a kill."""
    d = tmp_path_factory.mktemp("serve") / "model"
    shutil.copytree(tiny_dir, d)
    config = json.loads((d / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """{1: one process, no prompt cache, batch 4, queue 2, eager steps; 2: two ranks, batch
    8, compiled steps}."""
    tmp = tmp_path_factory.mktemp("serve-logs")
    one = Server(  # its decode steps eager: the others' compiled ones give the same text
        1, model_dir, tmp, "--prompt-cache-size", "0", "--max-batch", "4", "--max-queue", "2",
        "--no-compile",
    )  # fmt: skip
    two = Server(2, model_dir, tmp, "--max-batch", "8", "--max-queue", "64")
    try:
        one.wait_ready()
        two.wait_ready()
        yield {1: one, 2: two}
    finally:
        one.close()
        two.close()


def test_chat_and_completion_streaming_or_not_on_1_and_2_ranks(servers, model_dir):
    texts = {}
    for n, s in servers.items():
        c = s.client()
        plain, finish, usage = chat(c, "hello")
        streamed, sfinish, susage = chat(c, "hello", stream=True)
        assert (plain, finish) == (streamed, sfinish)
        assert finish == "length" and usage.completion_tokens == 12 == susage.completion_tokens
        assert usage.prompt_tokens == susage.prompt_tokens > 0
        ctext = complete(c, "The quick brown fox")
        assert complete(c, "The quick brown fox", stream=True) == ctext
        texts[n] = (plain, ctext)
        assert [m.id for m in c.models.list().data] == ["model"]
    assert texts[1] == texts[2]
    gen = run_python(
        ["-m", "llama_tp.generate", "--model", str(model_dir), "--prompt", "hello", "-m", "12"],
        timeout=120,
    )
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout[:-1] == texts[1][0]


def test_logprobs_and_stop(servers):
    c = servers[2].client()
    r = c.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 and t.logprob >= t.top_logprobs[-1].logprob - 1e-5 for t in content)
    full = complete(c, "Ranks share", max_tokens=20)
    stop = full[5:8]
    r = c.completions.create(
        model="m", prompt="Ranks share", max_tokens=20, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"


PROMPTS = [
    "hello",
    "The quick brown fox",
    "Tensor parallel",
    "abc",
    "Où est la gare?",
    "Hello world! Tensor",
    "Ranks share the heads",
    "xyz 0123456789",
]


def test_concurrent_requests_get_their_own_text(servers):
    c = servers[2].client()
    alone = [chat(c, p, max_tokens=24)[0] for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: chat(c, p, stream=True, max_tokens=24)[0], PROMPTS))
    assert together == alone


def test_seeded_request_same_alone_and_in_a_batch(servers):
    c = servers[1].client()
    kw = dict(max_tokens=24, temperature=1.0, seed=1234)
    alone = chat(c, "hello", **kw)[0]
    nucleus = chat(c, "hello", **kw, top_p=0.9)[0]
    assert chat(c, "hello", **kw)[0] == alone
    assert chat(c, "hello", **{**kw, "seed": 99})[0] != alone
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(chat, c, p, stream=True, max_tokens=200) for p in PROMPTS[1:3]]
        time.sleep(0.2)  # the others are running: the seeded requests join their batch
        batched = pool.submit(chat, c, "hello", **kw)
        batched_nucleus = pool.submit(chat, c, "hello", **kw, top_p=0.9)
        assert batched.result()[0] == alone
        assert batched_nucleus.result()[0] == nucleus
        for f in others:
            f.result()


def test_disconnect_mid_stream_leaves_others_alone(servers):
    c = servers[2].client()
    expected = chat(c, "Tensor parallel", max_tokens=40)[0]
    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(chat, c, "Tensor parallel", stream=True, max_tokens=40)
        stream = c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "abc"}], max_tokens=1500, stream=True
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # the client goes away
        assert other.result()[0] == expected
    assert chat(c, "hello")[0]  # still serving


def test_second_chat_turn_reuses_the_cache(servers):
    turn1 = [{"role": "user", "content": "Hello world!"}]
    c2 = servers[2].client()
    reply, _, usage1 = chat(c2, "", messages=turn1, max_tokens=16)
    turn2 = turn1 + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "The quick brown fox"},
    ]
    text2, _, usage2 = chat(c2, "", messages=turn2, max_tokens=16)
    cached = usage2.prompt_tokens_details.cached_tokens
    # At least the whole first prompt (the random model's reply need not survive
    # re-tokenization; tests/test_batch.py checks a reply that does).
    assert usage1.prompt_tokens <= cached < usage2.prompt_tokens
    # The 1-rank server has no prompt cache: it prefills everything, to the same text.
    text1, _, usage = chat(servers[1].client(), "", messages=turn2, max_tokens=16)
    assert usage.prompt_tokens_details.cached_tokens == 0 and text1 == text2


BAD = [
    ({"n": 2}, "n"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "x"}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"stop": 5}, "stop"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"seed": 1.5}, "seed"),
]


def test_bad_requests_are_answered_and_the_server_keeps_serving(servers):
    s = servers[1]
    url, auth = f"{s.base}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for change, param in BAD:
        code, text = http(url, {**ok, **change}, auth)
        assert code == 400, (change, text)
        err = json.loads(text)["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert http(url, b"{not json", auth)[0] == 400
    long = {"model": "m", "prompt": [5] * (CONTEXT + 10), "max_tokens": 2}
    code, text = http(f"{s.base}/v1/completions", long, auth)
    assert code == 400 and json.loads(text)["error"]["param"] == "prompt"
    assert f"{CONTEXT + 10} tokens" in text and f"{CONTEXT} tokens" in text
    assert http(url, {**ok, "unknown_field": 1}, auth)[0] == 200
    assert http(url, ok)[0] == 401
    assert http(url, ok, {"Authorization": "Bearer no"})[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{s.base}/v1", api_key="wrong", max_retries=0).models.list()
    # Batch 4 + queue 2: of 12 long requests at once some are refused, none dropped.
    long_ok = {**ok, "max_tokens": 300}
    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(lambda _: http(url, long_ok, auth, timeout=120)[0], range(12)))
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    assert chat(s.client(), "hello")[0]


def test_spec_drafts_give_the_same_greedy_text_on_1_and_2_ranks(servers):
    texts = {}
    for n, s in servers.items():
        c = s.client()
        plain, finish, usage = chat(c, REPEAT, max_tokens=48)
        assert usage.completion_tokens_details is None  # no drafts: no draft counts
        drafted = chat(c, REPEAT, max_tokens=48, extra_body=DRAFTS)
        streamed = chat(c, REPEAT, stream=True, max_tokens=48, extra_body=DRAFTS)
        for text, fin, u in (drafted, streamed):
            assert (text, fin, u.completion_tokens) == (plain, finish, usage.completion_tokens)
            # Drafting did happen: some tokens came without a forward of their own.
            details = u.completion_tokens_details
            assert details is not None and details.accepted_prediction_tokens > 0, (n, u)
        # A stop string, and max_tokens reached inside a step of accepted drafts.
        full = complete(c, REPEAT, max_tokens=40)
        assert complete(c, REPEAT, max_tokens=40, extra_body=DRAFTS) == full
        stop = full[12:15]
        r = c.completions.create(
            model="m", prompt=REPEAT, max_tokens=40, temperature=0, stop=[stop], extra_body=DRAFTS
        )
        assert r.choices[0].text == full[: full.index(stop)]
        assert r.choices[0].finish_reason == "stop"
        for m in (1, 2, 5):
            short = c.completions.create(
                model="m", prompt=REPEAT, max_tokens=m, temperature=0, extra_body=DRAFTS
            )
            assert short.usage.completion_tokens == m and short.choices[0].finish_reason == "length"
            assert short.choices[0].text == complete(c, REPEAT, max_tokens=m)
        texts[n] = (plain, full)
    assert texts[1] == texts[2]


def test_spec_bad_num_draft_tokens_gets_a_400(servers):
    s = servers[1]
    url, auth = f"{s.base}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for bad in ("4", 1.5, True, -1, 17, None):
        body = {**ok, "num_draft_tokens": bad}
        code, text = http(url, body, auth)
        if bad is None:  # null: the server's default
            assert code == 200, text
            continue
        assert code == 400, (bad, text)
        assert json.loads(text)["error"]["param"] == "num_draft_tokens", text
    # Sampled requests draft too, and answer the text they answer without drafts.
    sampled = {**ok, "temperature": 0.9, "seed": 3, "max_tokens": 24}
    code, text = http(url, {**sampled, "num_draft_tokens": 4}, auth)
    assert code == 200, text
    plain = http(url, {**sampled, "num_draft_tokens": 0}, auth)[1]
    message = json.loads(text)["choices"][0]["message"]["content"]
    assert message == json.loads(plain)["choices"][0]["message"]["content"]


def test_spec_server_default_applies_to_requests_that_do_not_say():
    from llama_tp.server.protocol import Defaults, parse_chat

    d = Defaults(num_draft_tokens=3)
    msg = {"messages": [{"role": "user", "content": "hi"}]}
    for extra, k in [({}, 3), ({"temperature": 0.5}, 3), ({"num_draft_tokens": 0}, 0)]:
        assert parse_chat({**msg, **extra}, d).params.num_draft_tokens == k, extra
    assert parse_chat({**msg, "num_draft_tokens": 16}, d).params.num_draft_tokens == 16


def test_spec_concurrent_request_gets_its_own_text(servers):
    c = servers[2].client()
    alone = {p: chat(c, p, max_tokens=64)[0] for p in (REPEAT, "Tensor parallel")}
    with ThreadPoolExecutor(2) as pool:
        # The drafting request runs alone first, then shares the batch (plain steps),
        # then may run alone again.
        drafting = pool.submit(chat, c, REPEAT, stream=True, max_tokens=64, extra_body=DRAFTS)
        time.sleep(0.3)
        other = pool.submit(chat, c, "Tensor parallel", stream=True, max_tokens=64)
        assert drafting.result()[0] == alone[REPEAT]
        assert other.result()[0] == alone["Tensor parallel"]


def _rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the ranks the launcher started (in its process group)."""
    ranks = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if os.getpgid(int(p.name)) != launcher.pid:
                continue
            env = dict(
                kv.split("=", 1) for kv in (p / "environ").read_text().split("\0") if "=" in kv
            )
        except (OSError, ValueError):
            continue
        if "MLX_RANK" in env and "llama_tp.serve" in (p / "cmdline").read_text():
            ranks[int(env["MLX_RANK"])] = int(p.name)
    return ranks


def test_killing_rank_1_mid_stream_ends_with_an_error(servers):
    s = servers[2]
    ranks = _rank_pids(s.proc)
    assert set(ranks) == {0, 1}, ranks
    c = s.client()
    errors = []

    def run():
        try:
            for i, _ in enumerate(
                c.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "abc"}],
                    max_tokens=1900,
                    stream=True,
                )
            ):
                if i == 5:
                    os.kill(ranks[1], signal.SIGKILL)
        except openai.APIError as e:
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the client hangs"
    assert errors, "the stream ended without an error"
    s.proc.wait(60)  # the launcher returns once every rank has exited
    assert "lost the connection to a peer" in s.stderr() or "peer" in s.stderr(), s.stderr()
    assert _rank_pids(s.proc) == {}


def test_sigterm_stops_the_server_cleanly(servers):
    s = servers[1]
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0
    assert "serve: stopped" in s.stderr()


def test_sigint_on_rank_0_stops_every_rank(model_dir, tmp_path):
    s = Server(2, model_dir, tmp_path, launcher="mlx")  # serve under mlx.launch itself
    try:
        s.wait_ready()
        c = s.client()
        assert chat(c, "hello")[0]
        stream = c.completions.create(model="m", prompt="abc", max_tokens=1900, stream=True)
        next(iter(stream))
        os.kill(_rank_pids(s.proc)[0], signal.SIGINT)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:
                pass
        s.proc.wait(30)
        assert "serve: stopped" in s.stderr() and "error" not in s.stderr(), s.stderr()
    finally:
        s.close()
