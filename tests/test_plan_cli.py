"""`python -m llama_tp.plan`: the per-rank table, read from a real checkpoint without loading it."""

from __future__ import annotations

from conftest import run_python


def test_plan_of_builtin_model_on_two_ranks():
    r = run_python(["-m", "llama_tp.plan", "-n", "2"])
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
