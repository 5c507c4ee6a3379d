"""The server on a mesh: pipeline stages (`--pp`) and data-parallel replicas (`--dp`).

One 4-rank server (`--pp 2 --dp 2`: two replicas, each a 2-stage pipeline) against
a one-process server of the same tiny model; the scheduler's replica balancing
without ranks; the refusals of --dp outside the server.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import run_python
from serve_client import DRAFTS, REPEAT, Server, chat, complete, http
from test_server_status import wait_for_reports

from llama_tp.engine.batch import SamplingParams
from llama_tp.server.scheduler import Scheduler

PROMPTS = ["hello", "Tensor parallel", "abc abc", "The capital", "one two three", "x"]


@pytest.fixture(scope="module")
def pair(tiny_dir, tmp_path_factory):
    """{1: one process, "mesh": 4 ranks as --pp 2 --dp 2}."""
    tmp = tmp_path_factory.mktemp("serve-mesh")
    one = Server(1, tiny_dir, tmp, "--max-batch", "8")
    flags = ["--pp", "2", "--dp", "2", "--max-batch", "2"]
    mesh = Server(4, tiny_dir, tmp, *flags, launcher="llama_tp")
    try:
        one.wait_ready()
        mesh.wait_ready(180)
        yield {1: one, "mesh": mesh}
    finally:
        one.close()
        mesh.close()


@pytest.mark.ranks
def test_replicas_of_pipelines_answer_as_one_process(pair):
    one, mesh = pair[1].client(), pair["mesh"].client()
    # The start-up line names the replicas and their ranks.
    assert "4 ranks (2 replicas of --tp 1 x --pp 2: ranks 0, 1 | 2, 3)" in pair["mesh"].stderr()
    alone = {p: chat(one, p, max_tokens=16)[:2] for p in PROMPTS}
    # Six requests at once (batch 2 per replica): both replicas take some, and some wait.
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {p: pool.submit(chat, mesh, p, True, max_tokens=16) for p in PROMPTS}
        together = {p: f.result()[:2] for p, f in futures.items()}
    assert together == alone
    status, body = http(f"{pair['mesh'].base}/health")
    served = json.loads(body)["replicas"]
    assert status == 200 and len(served) == 2 and min(served) >= 1 and sum(served) == 6, body
    # The status route places each rank: (stage, tensor rank, replica), each with memory.
    ranks = wait_for_reports(pair["mesh"].base, 4)["ranks"]
    assert [(r["stage"], r["tensor"], r["replica"]) for r in ranks] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 0, 1),
        (1, 0, 1),
    ], ranks
    assert all(r["active_memory"] > 0 and r["step_seconds"] > 0 for r in ranks), ranks
    # A seeded sampled request samples the same tokens on either replica and alone.
    seeded = {"temperature": 0.9, "seed": 7, "max_tokens": 16}
    assert complete(mesh, "Tensor parallel", **seeded) == complete(one, "Tensor parallel", **seeded)
    # Prompt-lookup drafts on a pipeline: every drafted position's logits come back.
    plain = chat(one, REPEAT, max_tokens=32)
    drafted = chat(mesh, REPEAT, max_tokens=32, extra_body=DRAFTS)
    assert drafted[:2] == plain[:2]
    details = drafted[2].completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0, drafted[2]


def test_scheduler_sends_each_request_to_the_least_busy_replica():
    s = Scheduler(max_batch=2, max_queue=8, replicas=2)
    s.ready = True
    loop = asyncio.new_event_loop()
    try:
        jobs = [s.submit([1, 2, 3], SamplingParams(), None, loop) for _ in range(5)]
        first = s.next_decisions(s.rows())
        # Each to the replica with fewer rows, the lower-numbered of equals.
        assert [[j.uid for j in d.joins] for d in first] == [[1, 3], [2, 4]]
        assert s.rows() == [2, 2] and s.served == [2, 2]  # the fifth waits: both are full
        s.cancel(jobs[1].uid)
        second = s.next_decisions(s.rows())
        assert [d.cancels for d in second] == [[], [2]]
        assert [[j.uid for j in d.joins] for d in second] == [[], [5]]  # the freed place
        assert s.served == [2, 3]
        s.request_stop()
        assert all(d.stop for d in s.next_decisions(s.rows()))
    finally:
        loop.close()


def test_dp_is_for_the_server_only(tiny_dir):
    r = run_python(["-m", "llama_tp.generate", "--model", str(tiny_dir), "--dp", "2"], timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: --dp 2: data-parallel replicas serve separate requests at once, which only "
        "llama_tp.serve does; this command runs one copy of the model (drop --dp)"
    )
    r = run_python(["-m", "llama_tp.serve", "--model", str(tiny_dir), "--dp", "2", "--port", "0"])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: --dp 2 does not divide the 1 running rank"
