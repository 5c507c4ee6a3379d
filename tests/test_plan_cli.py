"""`python -m llama_tp.plan`: the per-rank table, read from a real checkpoint without loading it."""

from __future__ import annotations

from conftest import run_python


def test_plan_of_builtin_model_on_two_ranks():
    r = run_python(["-m", "llama_tp.plan", "-n", "2", "--tp", "2", "--pp", "1"])  # no mesh
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "9 query / 3 KV heads" in r.stdout
    # SmolLM2 on 2 ranks: whole KV groups, 2 for rank 0 and 1 for rank 1.
    rank0 = next(line for line in lines if line.startswith("0 "))
    rank1 = next(line for line in lines if line.startswith("1 "))
    assert "0-5 [6]" in rank0 and "0-1 [2]" in rank0
    assert "6-8 [3]" in rank1 and "2 [1]" in rank1
    assert any(x.startswith("imbalance: ") and x.endswith("% of weight bytes") for x in lines)


def test_plan_marks_replicated_kv_heads():
    r = run_python(["-m", "llama_tp.plan", "-n", "4"])
    assert r.returncode == 0, r.stderr
    assert "1*,2* [2]" in r.stdout  # rank 2's query heads 5-6 need KV heads 1 and 2


def test_plan_refuses_more_ranks_than_heads():
    r = run_python(["-m", "llama_tp.plan", "-n", "10"])
    assert r.returncode == 1
    assert r.stderr.strip() == "error: cannot split 9 query heads over 10 ranks: at most 9 ranks"


def test_plan_of_a_tp2_x_pp2_mesh():
    r = run_python(["-m", "llama_tp.plan", "-n", "4", "--tp", "2", "--pp", "2"])
    assert r.returncode == 0, r.stderr
    lines = [" ".join(line.split()) for line in r.stdout.splitlines()]
    assert lines[0] == (
        "SmolLM2-135M-Instruct.Q4_1.gguf: the mesh --tp 2 x --pp 2 on 4 ranks "
        "(in rank order, as on one host)"
    )
    # 30 layers balanced by bytes: the tied table weighs the same on the first stage (the
    # embedding) and the last (the head), so 15 + 15; inside a stage the 2-rank plan.
    assert lines[1].split()[:3] == ["rank", "stage", "layers"]
    rows = lines[2:6]
    assert rows[0].startswith(
        "0 0 0-14 [15] 0 of 2 0-5 [6] 0-1 [2] 0-767 [768] embedding: rows 0-24575 "
    )
    assert rows[1].startswith(
        "1 0 0-14 [15] 1 of 2 6-8 [3] 2 [1] 768-1535 [768] embedding: rows 24576-"
    )
    assert rows[2].startswith(
        "2 1 15-29 [15] 0 of 2 0-5 [6] 0-1 [2] 0-767 [768] head (tied): rows 0-"
    )
    assert rows[3].startswith(
        "3 1 15-29 [15] 1 of 2 6-8 [3] 2 [1] 768-1535 [768] head (tied): rows "
    )
    # Same layer slices on both stages, and the tied table is stage 0's embedding, stage 1's head.
    assert (
        rows[0].split()[-2:] == rows[2].split()[-2:]
        and rows[1].split()[-2:] == rows[3].split()[-2:]
    )
    assert lines[6].startswith("imbalance: ")
    stage0, stage1 = (
        lines.index("stage 0: ranks 0, 1: layers 0-14 + embedding"),
        lines.index("stage 1: ranks 2, 3: layers 15-29 + norm, head"),
    )
    assert lines[stage0 + 1] == "path style rank 0 rank 1"
    assert lines[stage1 + 1] == "path style rank 2 rank 3"
    first, last = lines[stage0:stage1], lines[stage1:]
    assert "tok_embeddings VocabParallel() rows 0-24575 [24576] rows 24576-49151 [24576]" in first
    assert "tok_embeddings LossParallel() rows 0-24575 [24576] rows 24576-49151 [24576]" in last
    assert "norm Replicate() whole whole" in last and "norm Replicate() whole whole" not in first


def test_plan_refuses_a_mesh_the_loader_refuses():
    r = run_python(["-m", "llama_tp.plan", "-n", "4", "--tp", "2", "--pp", "3"])
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --tp 2 x --pp 3 = 6 ranks, but 4 are running"
    r = run_python(["-m", "llama_tp.plan", "-n", "2", "--pp", "2", "--pp-split", "10,10"])
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --pp-split 10,10 sums to 20 layers, but the model has 30"


def test_plan_of_the_servers_replicas():
    r = run_python(["-m", "llama_tp.plan", "-n", "4", "--pp", "2", "--dp", "2"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == (
        "2 replicas (serve --dp 2) of 2 ranks each: ranks 0-1 | 2-3 (in rank order, as on "
        "one host); the plan of each, its ranks numbered from 0:"
    )
    # Then each replica's plan: what `plan -n 2 --pp 2` prints.
    alone = run_python(["-m", "llama_tp.plan", "-n", "2", "--pp", "2"])
    assert lines[1:] == alone.stdout.splitlines()
    r = run_python(["-m", "llama_tp.plan", "-n", "4", "--dp", "3"])
    assert (
        r.returncode == 2
        and r.stderr.strip() == "error: --dp 3 does not divide the 4 running ranks"
    )
