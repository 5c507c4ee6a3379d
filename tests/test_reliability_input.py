"""Reliability (issue #8), the checks that need no short watchdog: ranks agree on the
tokens and the model, and bad input gets one line with the same exit code on every rank.

Ranks run as plain processes (tests/mp_ranks.py), not under mlx.launch, which
stops the other ranks as soon as one fails: here every rank's own exit code and
stderr are checked. Nothing here times a rank or stops one, so these run with the rest
of the suite (their ranks forked from the warm interpreter); the faults, stalls and
watchdogs are tests/test_reliability.py's, which runs alone.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import run_python
from fixtures import write_hf_model
from mp_ranks import Ranks

from llama_tp.loading.agreement import disagreement


def gen_args(model, *extra: str, prompt: str = "hi") -> list[str]:
    return [
        "-m",
        "llama_tp.generate",
        "--model",
        str(model),
        "--prompt",
        prompt,
        "--ignore-chat-template",
        *extra,
    ]


# -- the ranks must agree -----------------------------------------------------------


def test_token_divergence_stops_every_rank(long_tiny, tmp_path):
    env = {1: {"LLAMA_TP_FAULT": "diverge:rank1"}}  # rank 1 sees other tokens from the 20th
    r0, r1 = Ranks(2, gen_args(long_tiny, "--max-tokens", "100"), tmp_path, env=env).wait(120)
    assert r0.error_lines() == [
        "error: ranks produced different tokens by token 32 (compared every 16): "
        "rank 1 differs from rank 0"
    ], r0.err
    assert r1.err == "" and r1.out == ""
    assert r0.code == r1.code == 1
    # Up to the check rank 0 printed its tokens, the single process's.
    single = run_python(gen_args(long_tiny, "--max-tokens", "40"), timeout=120)
    assert r0.out and single.stdout.startswith(r0.out), (r0.out, single.stdout)


def test_mismatched_model_on_one_rank(tiny_dir, tmp_path):
    other = write_hf_model(tmp_path / "other", seed=1)  # same config and tokenizer
    models = [tiny_dir, other]
    r0, r1 = Ranks(2, lambda r: gen_args(models[r], "--max-tokens", "4"), tmp_path).wait(120)
    [line] = r0.error_lines()
    assert re.fullmatch(
        rf"error: ranks disagree on the model weights: rank 0 has [0-9a-f]{{12}}, rank 1 "
        rf"has [0-9a-f]{{12}} \(rank 0: {re.escape(str(tiny_dir))}, rank 1: "
        rf"{re.escape(str(other))}\)",
        line,
    ), line
    assert r0.out == "" and r1.out == "" and r1.err == ""
    assert r0.code == r1.code == 1


def facts(**changes):
    base = {
        "versions": "llama_tp 0.1.0, mlx 0.32.0, mlx-lm 0.32.0",
        "world": 3,
        "config": {"dim": 64, "n_layers": 2, "vocab_size": 389},
        "plan": "p1",
        "weights": "w1",
        "tokenizer": "t1",
        "path": "/m",
    }
    return {**base, **changes}


def test_disagreement_messages():
    assert disagreement([facts(), facts(), facts()]) is None
    config = {"dim": 64, "n_layers": 3, "vocab_size": 389}
    assert disagreement([facts(), facts(config=config), facts()]) == (
        "ranks disagree on the model config (n_layers: ranks 0, 2 have 2, rank 1 has 3)"
    )
    other = "llama_tp 0.1.0, mlx 0.31.0, mlx-lm 0.32.0"
    assert disagreement([facts(), facts(), facts(versions=other, weights="w2")]) == (
        "ranks disagree on the llama_tp / mlx / mlx-lm versions: ranks 0, 1 have "
        f"{facts()['versions']}, rank 2 has {other}"
    )
    assert disagreement([facts(), facts(tokenizer="t2"), facts(tokenizer="t3")]) == (
        "ranks disagree on the tokenizer: rank 0 has t1, rank 1 has t2, rank 2 has t3 (/m)"
    )


# -- bad input: one line from rank 0, the same exit code on every rank ---------------


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory, tiny_dir):
    """Every bad-input case on 2 ranks, started together (they are independent)."""
    root = tmp_path_factory.mktemp("bad_input")
    bad_json = root / "bad_json"
    shutil.copytree(tiny_dir, bad_json)
    (bad_json / "config.json").write_text("{not json")
    no_layers = root / "no_layers"
    shutil.copytree(tiny_dir, no_layers)
    config = json.loads((no_layers / "config.json").read_text())
    del config["num_hidden_layers"]
    (no_layers / "config.json").write_text(json.dumps(config))
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 60)
    cases = {
        "temp": (gen_args(tiny_dir, "--temp", "-1"), None),
        "top_p_zero": (gen_args(tiny_dir, "--top-p", "0"), None),
        "top_p_above_one": (gen_args(tiny_dir, "--top-p", "1.5"), None),
        "max_tokens": (gen_args(tiny_dir, "--max-tokens", "0"), None),
        "timeout": (gen_args(tiny_dir, "--timeout", "-1"), None),
        "empty_prompt": (gen_args(tiny_dir, prompt=""), None),
        "long_prompt": (gen_args(tiny_dir, prompt=long_prompt), None),
        "utf8": (gen_args(tiny_dir, prompt="-"), b"\xff\xfehi"),
        "bad_json": (gen_args(bad_json), None),
        "missing_field": (gen_args(no_layers), None),
    }
    runs = {}
    for batch in (list(cases)[:5], list(cases)[5:]):  # 10 processes at a time
        started = {k: Ranks(2, cases[k][0], root, stdin=cases[k][1]) for k in batch}
        runs.update({k: ranks.wait(120) for k, ranks in started.items()})
    return runs


@pytest.mark.parametrize(
    "case, code, expected",
    [
        ("temp", 2, "--temp must be >= 0, got -1.0"),
        ("top_p_zero", 2, "--top-p must be in (0, 1], got 0.0"),
        ("top_p_above_one", 2, "--top-p must be in (0, 1], got 1.5"),
        ("max_tokens", 2, "--max-tokens must be positive, got 0"),
        ("timeout", 2, "--timeout must be >= 0 seconds, got -1.0"),
        ("empty_prompt", 2, "the prompt is empty"),
        ("long_prompt", 2, "tokens, but the model's context is 512 tokens"),
        ("utf8", 2, "stdin is not valid UTF-8 (byte 0xff at 0)"),
        ("bad_json", 1, "bad_json/config.json: not valid JSON"),
        ("missing_field", 1, "num_hidden_layers"),
    ],
)
def test_bad_input_on_two_ranks(bad_input_runs, case, code, expected):
    r0, r1 = bad_input_runs[case]
    [line] = r0.error_lines()
    assert line.startswith("error: ") and expected in line, line
    assert r1.err == "" and r0.out == r1.out == ""  # no noise from rank 1
    assert r0.code == r1.code == code


def test_long_prompt_names_its_length(bad_input_runs):
    [line] = bad_input_runs["long_prompt"][0].error_lines()
    n = int(re.search(r"the prompt is (\d+) tokens", line).group(1))
    assert n > 512, line


def test_max_tokens_lowered_to_fit_the_context(tiny_dir):
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 15)  # ~480 tokens
    args = gen_args(tiny_dir, "--max-tokens", "400", "--verbose", prompt=prompt)
    r = run_python(args, timeout=120)
    n = int(re.search(r"Prompt: (\d+) tokens", r.stderr).group(1))
    assert 0 < 512 - n < 400, r.stderr
    assert f"warning: --max-tokens lowered from 400 to {512 - n}" in r.stderr
    generated = int(re.search(r"Generation: (\d+) tokens", r.stderr).group(1))
    assert generated <= 512 - n and r.returncode == 0
