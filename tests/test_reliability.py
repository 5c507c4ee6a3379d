"""Reliability (issue #8): ranks agree at start-up, nothing hangs, bad input gets one line.

Ranks run as plain processes (tests/mp_ranks.py), not under mlx.launch, which
stops the other ranks as soon as one fails: here every rank's own exit code,
stderr and exit time are checked.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_python
from fixtures import write_hf_model
from mp_ranks import Ranks

from llama_tp.loading.agreement import disagreement

# Short watchdog timeouts: alone, so that a slow step on a busy machine is not a stall.
pytestmark = pytest.mark.exclusive

PEER_LOST = "lost the connection to a peer rank (it crashed or was stopped)"
NO_PROGRESS = (
    r"error: rank {rank}: no progress for 5 s in generation step \d+ "
    r"\(waiting on {others}\); a peer may be stopped or unreachable"
)


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


@pytest.fixture(scope="module")
def long_model(long_tiny):
    """The tiny model with a context long enough to keep generating until stopped."""
    return long_tiny


def endless(ranks_n: int, model, tmp_path, *extra: str, **kwargs) -> Ranks:
    """`ranks_n` ranks generating (far more tokens than a test waits for)."""
    ranks = Ranks(ranks_n, gen_args(model, "--max-tokens", "500000", *extra), tmp_path, **kwargs)
    ranks.wait_for_output(100)  # rank 0 is printing tokens: generation is under way
    return ranks


# -- a peer dies or stops ---------------------------------------------------------


@pytest.mark.parametrize("n, victim", [(2, 1), (3, 0)])
def test_sigkill_one_rank_ends_the_others(long_model, tmp_path, n, victim):
    ranks = endless(n, long_model, tmp_path)
    ranks.signal(victim, signal.SIGKILL)
    survivors = ranks.wait(10, [r for r in range(n) if r != victim])
    for r in survivors:
        # Every survivor speaks for itself: rank 0 may be the one that died.
        assert r.error_lines() == [f"error: rank {r.rank}: {PEER_LOST}"], (r.code, r.seconds, r.err)
        assert r.code == 3 and r.seconds <= 10, (r.code, r.seconds)


def test_sigstop_one_rank_times_out(long_model, tmp_path):
    ranks = endless(3, long_model, tmp_path, "--timeout", "5")
    ranks.signal(2, signal.SIGSTOP)
    survivors = ranks.wait(5 + 10, [0, 1])
    timed_out = 0
    for r in survivors:
        [line] = r.error_lines()
        # Both watchdogs expire at about 5 s; the rank whose expires a moment later may
        # first see the other's exit as a lost connection: either line, at the timeout.
        no_progress = NO_PROGRESS.format(rank=r.rank, others="2 other ranks")
        timed_out += bool(re.fullmatch(no_progress, line))
        assert re.fullmatch(no_progress, line) or line == f"error: rank {r.rank}: {PEER_LOST}"
        assert r.code == 3, r.code
        assert 4 <= r.seconds <= 15, r.seconds  # the timeout, not earlier and not much later
    assert timed_out >= 1, [r.err for r in survivors]  # the stopped rank's silence was seen


def test_chat_peer_killed_during_a_reply(long_model, tmp_path):
    args = ["-m", "llama_tp.chat", "--model", str(long_model), "--max-tokens", "500000"]
    ranks = Ranks(2, args, tmp_path, stdin=b"hi\n")
    ranks.wait_for_output(100)
    ranks.signal(1, signal.SIGKILL)
    [r] = ranks.wait(10, [0])
    lines = [line for line in r.error_lines() if not line.startswith("Chat on 2 ranks")]
    assert lines == [f"error: rank 0: {PEER_LOST}"], r.err
    assert r.code == 3


# -- the ranks must agree -----------------------------------------------------------


def test_token_divergence_stops_every_rank(long_model, tmp_path):
    env = {1: {"LLAMA_TP_FAULT": "diverge:rank1"}}  # rank 1 sees other tokens from the 20th
    r0, r1 = Ranks(2, gen_args(long_model, "--max-tokens", "100"), tmp_path, env=env).wait(120)
    assert r0.error_lines() == [
        "error: ranks produced different tokens by token 32 (compared every 16): "
        "rank 1 differs from rank 0"
    ], r0.err
    assert r1.err == "" and r1.out == ""
    assert r0.code == r1.code == 1
    # Up to the check rank 0 printed its tokens, the single process's.
    single = run_python(gen_args(long_model, "--max-tokens", "40"), timeout=120)
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


# -- the watchdog and the stderr filter on their own -------------------------------

WATCHDOG_SCRIPT = """
import os, sys, time
from llama_tp import watchdog
watchdog.filter_ring_noise()
watchdog.install(step_timeout=0.5, load_timeout=None)
watchdog.set_group_size(4)
for piece in [b"[ring] Socket 5 ", b"was closed by the peer\\n", b"kept: one\\n[ri", b"ng] x\\n"]:
    os.write(2, piece)
print("kept: two", file=sys.stderr, flush=True)
with watchdog.stage("loading", "load"):  # no timeout for loading: never fires
    time.sleep(1)
with watchdog.stage("generation step 1"):
    for n in range(2, 5):
        time.sleep(0.2)
        watchdog.progress(f"generation step {n}")
    time.sleep(30)  # as if stuck in a collective
"""


def test_watchdog_fires_with_one_line_after_the_rest():
    r = subprocess.run(
        [sys.executable, "-c", WATCHDOG_SCRIPT],
        cwd=ROOT,
        env={"MLX_RANK": "2", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 3
    assert r.stderr.splitlines() == [
        "kept: one",
        "kept: two",
        "error: rank 2: no progress for 0.5 s in generation step 4 (waiting on 3 other "
        "ranks); a peer may be stopped or unreachable",
    ]


def test_ring_sockets_found_and_hang_up_seen(tmp_path, monkeypatch):
    """The watchdog finds the connection to the hostfile's address and sees the peer close it."""
    from llama_tp.cluster.watchdog import _hung_up, ring_sockets

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], ["127.0.0.1:1"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    peer = subprocess.Popen(  # another process, as a peer rank is
        [sys.executable, "-c", CONNECT.format(port=port)], stdin=subprocess.PIPE
    )
    accepted, _ = server.accept()
    unrelated = socket.create_server(("127.0.0.1", 0))  # not in the hostfile
    found = ring_sockets()
    try:
        assert [s.getsockname() for s in found] == [accepted.getsockname()]
        assert not _hung_up(found[0])
        peer.stdin.write(b"x")  # the peer sends a byte: data waiting is no hang-up
        peer.stdin.flush()
        time.sleep(0.2)
        assert not _hung_up(found[0])
        assert accepted.recv(1) == b"x"  # peeking left it there
        peer.kill()
        peer.wait()
        time.sleep(0.2)
        assert _hung_up(found[0])
    finally:
        peer.kill()
        for s in [*found, accepted, server, unrelated]:
            s.close()


CONNECT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", {port}))
s.sendall(sys.stdin.buffer.read(1))
time.sleep(60)
"""
