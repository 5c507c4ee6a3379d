"""The same request gives the same text through every driver (docs/determinism.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import launch, run_python

PROMPT = "Tell me a story about a cat."


@pytest.fixture(scope="module")
def built_in_server():
    """The built-in model served in this process by uvicorn on a free port: its base URL."""
    pytest.importorskip("fastapi")
    from llama_tp import load
    from llama_tp.server.runner import HTTPThread, bind, create_app

    model, tokenizer = load()
    sock = bind("127.0.0.1", 0)
    app = create_app(model, tokenizer)
    http = HTTPThread(app, sock)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        http.stop()
        app.state.scheduler.request_stop()
        app.state.steps.join(10)


def test_generate_and_the_server_sample_the_same_text(built_in_server):
    """The issue's symptom: `generate --temp 1 --seed 5` and the server asked the same chat
    message with seed 5 and temperature 1 answered different texts."""
    openai = pytest.importorskip("openai")
    args = ["-m", "llama_tp.generate", "--prompt", PROMPT, "--temp", "1", "--seed", "5"]
    gen = run_python([*args, "--max-tokens", "12"], timeout=120)
    assert gen.returncode == 0, gen.stderr
    client = openai.OpenAI(base_url=built_in_server, api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": PROMPT}],
        temperature=1,
        seed=5,
        max_tokens=12,
    )
    assert r.choices[0].message.content == gen.stdout[:-1]


# -- one grid of requests through every driver, on 1 and 2 ranks -------------------------

DRIVERS = ("chat", "batch", "spec", "server", "server_spec", "server_batch")
PLAIN_DRIVERS = ("plain_chat", "plain_batch", "plain_server", "plain_server_batch")


@pytest.fixture(scope="module")
def plain_dir(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model with a tokenizer that has no chat template."""
    d = tmp_path_factory.mktemp("plain") / "model"
    shutil.copytree(tiny_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def runs(tiny_dir, plain_dir) -> dict:
    """{ranks: {variant: {driver: {request: result}}}} from tests/mp_determinism.py."""
    pytest.importorskip("fastapi")
    args = ["tests/mp_determinism.py", str(tiny_dir), str(plain_dir)]
    out = {}
    for n, r in ((1, run_python(args, timeout=300)), (2, launch(2, args, timeout=600))):
        line = next((x for x in r.stdout.splitlines() if x.startswith("{")), None)
        assert line, r.stdout[-2000:] + r.stderr[-3000:]
        out[n] = json.loads(line)
    return out


def same(got: dict, ref: dict, where) -> None:
    assert got.keys() == ref.keys(), where
    for rid, r in got.items():
        assert r["text"] == ref[rid]["text"], (where, rid, r, ref[rid])
        if "tokens" in r:
            assert r["tokens"] == ref[rid]["tokens"], (where, rid)
        if "logprobs" in ref[rid] and "logprobs" in r:
            pairs = zip(r["logprobs"], ref[rid]["logprobs"], strict=True)
            assert all(abs(a - b) < 1e-5 for a, b in pairs), (where, rid)


def test_every_driver_gives_generates_tokens(runs):
    """generate, Chat, batch_generate, speculative decoding and the server (alone, with
    drafts, 8 at a time) on the same requests: the same text, tokens and log-probs."""
    for n, run in runs.items():
        for variant, drivers in run.items():
            ref = drivers["generate"]
            for driver in DRIVERS:
                same(drivers[driver], ref, (n, variant, driver))
            for driver in PLAIN_DRIVERS:
                same(drivers[driver], drivers["plain_generate"], (n, variant, driver))


def test_the_grid_exercises_what_it_names(runs):
    ref = runs[1]["whole"]["generate"]
    for i in (0, 1):
        greedy = ref[f"greedy/{i}"]
        for name in ("temperature", "top_p", "min_p", "top_k"):  # sampling did sample
            assert ref[f"{name}/{i}"]["tokens"] != greedy["tokens"], name
        stopped = ref[f"stop/{i}"]["text"]  # cut before its stop string (from the greedy text)
        assert greedy["text"].startswith(stopped) and 1 <= len(stopped) < len(greedy["text"])
        assert len(ref[f"logprobs/{i}"]["logprobs"]) == len(ref[f"logprobs/{i}"]["tokens"])
    plain = runs[1]["whole"]["plain_generate"]["greedy/0"]["tokens"]
    assert plain != ref["greedy/0"]["tokens"]  # another prompt: the plain template's
    banned = runs[1]["whole"]["processor"]["greedy/0"]
    assert banned["banned"] not in banned["tokens"] and banned["tokens"] != ref["greedy/0"]


def test_the_same_tokens_on_1_and_2_ranks_with_and_without_a_vocabulary_parallel_head(runs):
    one = runs[1]["whole"]
    for variant in ("vp", "whole"):
        two = runs[2][variant]
        for driver in ("generate", "plain_generate", "processor"):
            for rid, r in two[driver].items():
                assert r["tokens"] == one[driver][rid]["tokens"], (variant, driver, rid)
