"""Speculative decoding (issue 21): prompt lookup and draft models under tensor parallelism.

The multi-rank checks of one rank count run in one launch (tests/mp_speculative.py):
greedy speculative output equals plain greedy output for both drafters (draft model
whole on every rank and sharded), across chat turns too; sampled speculative output
equals plain sampled output; clear errors for a bad K and a mismatched tokenizer.
The 2-rank launch also checks the built-in model with prompt lookup.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import launch, run_python
from fixtures import write_hf_model

from llama_tp.engine.drafters import lookup


@pytest.fixture(scope="module")
def spec_models(tiny_dir, tmp_path_factory):
    """(target, draft: 1 layer and other weights with the target's tokenizer, another vocab)."""
    root = tmp_path_factory.mktemp("spec")
    draft = write_hf_model(root / "draft", seed=3, n_layers=1, tokenizer=False)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, draft / name)
    bad = write_hf_model(root / "bad", seed=4, vocab_size=420)
    return [str(tiny_dir), str(draft), str(bad)]


def results(r) -> dict:
    line = next((x for x in r.stdout.splitlines() if x.startswith("{")), None)
    assert line, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(line)


EXPECTED = {
    *(f"greedy_{d}_{i}" for d in ("ngram", "replicated", "sharded", "self") for i in (0, 1)),
    "self_draft_accepts_all",
    "chat_ngram",
    "chat_replicated",
    "bad_k",
    "mismatched_tokenizer",
    *(f"sampled_{d}_{i}" for d in ("ngram", "replicated", "sharded", "self") for i in (0, 1)),
}


@pytest.mark.parametrize("n", [1, 2, 3])
def test_speculative_on_ranks(spec_models, default_gguf, n):
    args = ["tests/mp_speculative.py", *spec_models]
    expected = set(EXPECTED)
    if n == 2:
        args += ["--gguf", str(default_gguf)]
        expected.add("gguf_ngram")
    if n == 3:  # uneven shards draft greedily; sampling across ranks is 2 ranks' check
        args += ["--skip", "sampled"]
        expected = {k for k in expected if not k.startswith("sampled_")}
    r = run_python(args, timeout=300) if n == 1 else launch(n, args, timeout=600)
    got = results(r)
    assert expected <= set(got), sorted(expected - set(got))
    failed = {k: v for k, v in got.items() if not v["ok"]}
    assert not failed, failed


def test_lookup():
    assert lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert lookup([1, 2, 3, 9, 2, 3, 5, 2, 3], 2) == [5, 2]  # the latest match of "2 3"
    assert lookup([5, 6, 7], 4) == []
    assert lookup([7, 7], 4) == [7]
    assert lookup([1, 2, 1], 0) == []


def test_generate_flags(spec_models):
    target, draft, bad = spec_models
    base = ["-m", "llama_tp.generate", "--model", target, "--prompt", "The quick brown fox"]
    r = run_python([*base, "-m", "24", "--draft-model", draft, "--verbose"], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tokens per target forward" in r.stderr and "collective rounds per token" in r.stderr
    r = run_python([*base, "--draft-model", bad], timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("error: the draft model's vocabulary")
    r = run_python([*base, "--draft", "ngram", "--num-draft-tokens", "0"], timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --num-draft-tokens must be from 1 to 64, got 0"
