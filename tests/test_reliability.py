"""Reliability (issue #8): nothing hangs when a peer dies or stops, the watchdog speaks.

Ranks run as plain processes (tests/mp_ranks.py), not under mlx.launch, which
stops the other ranks as soon as one fails: here every rank's own exit code,
stderr and exit time are checked. The checks that time nothing (ranks agree on tokens
and the model, bad input gets one line) are tests/test_reliability_input.py's.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from mp_ranks import Ranks

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
