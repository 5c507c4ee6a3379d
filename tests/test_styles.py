"""Parallel styles, the plan, sequence parallelism and einshard on real ranks.

Bad plans are checked in this process (validation needs only N); each launch runs
tests/mp_styles.py, which batches every multi-rank check of one rank count.
"""

from __future__ import annotations

import json

import pytest
from conftest import launch, run_python
from fixtures import write_hf_model

from llama_tp.cluster.distributed import world
from llama_tp.model import Transformer
from llama_tp.model_args import ModelArgs
from llama_tp.parallel.llama_plan import llama_plan
from llama_tp.parallel.parallelize import format_plan_table, plan_splits
from llama_tp.parallel.shard import parallelize_model
from llama_tp.parallel.styles import (
    ColwiseParallel,
    LossParallel,
    PlanError,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("styles")
    small = dict(tokenizer=False, head_dim=8, dim=64, n_layers=2)
    return {
        # even attention on 2, whole KV groups on 3 (uneven), replicated KV heads on 4;
        # 97 feed-forward columns split unevenly on every N
        "h8kv2": write_hf_model(root / "h8kv2", n_heads=8, n_kv_heads=2, hidden_dim=97, **small),
        "h9kv3": write_hf_model(root / "h9kv3", n_heads=9, n_kv_heads=3, hidden_dim=100, **small),
        "h12kv4": write_hf_model(root / "h12kv4", n_heads=12, n_kv_heads=4, hidden_dim=96, **small),
        "tied": write_hf_model(root / "tied", tokenizer=False, n_heads=4, n_kv_heads=4, tie=True),
        "q4": write_hf_model(
            root / "q4",
            tokenizer=False,
            n_heads=8,
            n_kv_heads=2,
            head_dim=32,
            hidden_dim=288,
            quantize=(4, 32),
        ),
    }


def run_styles(n: int, models: dict, builtin=(), custom=(), sp=(), einshard=False) -> dict:
    args = ["tests/mp_styles.py"]
    for flag, names in (("--builtin", builtin), ("--custom", custom), ("--sp", sp)):
        if names:
            args += [flag, *(str(models[m]) for m in names)]
    if einshard:
        args.append("--einshard")
    r = launch(n, args, timeout=300)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, f"n={n}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    return json.loads(lines[-1])


def check(out: dict) -> None:
    for path, (vs_default, vs_whole, atol, by_kinds) in out["builtin"].items():
        assert vs_default == 0.0 and vs_whole <= atol, (path, vs_default, vs_whole)
        # the loader's layers are the ones Attention.shard and FeedForward.shard made
        assert by_kinds, path
    for path, (vs_whole, whole_ffn) in out["custom"].items():
        assert vs_whole <= ATOL and whole_ffn, (path, vs_whole, whole_ffn)
    for path, res in out["sp"].items():
        assert res.pop("greedy") and res.pop("chunk"), (path, res)
        # [what ran, what should]: SP's attention in query chunks, the plain one whole
        for got, want in res.pop("query_blocks"):
            assert got == want, (path, got, want)
        assert all(v <= ATOL for v in res.values()), (path, res)
    if "einshard" in out:
        e = out["einshard"]
        assert e["layouts"] >= 4 and e["parts"] and e["replicas"], e
        assert e["mlp"] < 1e-3, e  # fp32 sums of 128 and 256 products
        assert e["ffn_vs_shard"] <= 1e-5 and e["ffn_vs_whole"] <= 1e-5, e
        assert any("not naturally sharded" in m for m in e["refused"]), e


def test_two_ranks(models):
    out = run_styles(
        2, models, builtin=["h9kv3", "q4"], custom=["h8kv2"], sp=["h9kv3", "tied"], einshard=True
    )
    check(out)
    assert len(out["einshard"]["refused"]) == 1


def test_three_ranks(models):
    check(run_styles(3, models, builtin=["h8kv2"], sp=["h9kv3"]))


def test_four_ranks(models):
    out = run_styles(4, models, builtin=["h9kv3"], custom=["h12kv4"], einshard=True)
    check(out)
    assert len(out["einshard"]["refused"]) == 2


def test_einshard_eight_ranks():
    r = launch(8, ["tests/mp_einshard.py"], timeout=300)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines, r.stderr[-3000:]
    e = json.loads(lines[-1])
    assert e["n"] == 8 and e["parts"] and e["replicas"] and e["mlp"] < 1e-3, e
    assert e["ffn_vs_shard"] <= 1e-5, e


# Bad plans: one PlanError naming the path, before anything changes.


def tiny(**kw) -> Transformer:
    args = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, hidden_dim=97, vocab_size=50)
    return Transformer(ModelArgs(**(args | kw)))


@pytest.mark.parametrize(
    "plan, message",
    [
        ({"layers.*.attn.wq": ColwiseParallel()}, "plan path 'layers.*.attn.wq' matches no module"),
        (
            {"layers.*.attention_norm": ColwiseParallel()},
            "layers.0.attention_norm: ColwiseParallel applies to nn.Linear or "
            "nn.QuantizedLinear, not RMSNorm",
        ),
        (
            {"layers.*.attention.wq": SequenceParallel()},
            "layers.0.attention.wq: SequenceParallel applies to nn.RMSNorm",
        ),
        (
            {"layers.*.feed_forward.w1": ColwiseParallel()},
            "layers.0.feed_forward.w1: cannot split 97 output rows evenly over 2 ranks",
        ),
        (
            {"layers.*.attention.wq": ColwiseParallel(), "layers.1.attention.w[qk]": Replicate()},
            "layers.1.attention.wq: matched by both",
        ),
        ({"layers.0.attention.wo": RowwiseParallel(ranges=[(0, 64)])}, "1 ranges for 2 ranks"),
        (
            {"layers.0.attention.wo": RowwiseParallel(ranges=[(0, 40), (40, 70)])},
            r"rank 1's range \[40, 70\) of 64 input columns",
        ),
        ({"norm": Replicate(output_layout="rows")}, "layout must be"),
        ({"layers.*.attention.wq": "colwise"}, "is not a parallel style"),
    ],
)
def test_bad_plans(plan, message):
    with pytest.raises(PlanError, match=message):
        plan_splits(tiny(), plan, 2)


def test_head_without_embedding_is_refused():
    group = world()  # one process: the checks do not need peers
    with pytest.raises(PlanError, match="output: a vocabulary-parallel head needs tok_embeddings"):
        parallelize_model(tiny(), group, {"output": LossParallel()})


def test_builtin_plan_table():
    model = tiny()
    table = format_plan_table(model, llama_plan(model, 3, sequence_parallel=True), 3)
    assert "layers.*.attention.wq     ColwiseParallel(ranges)" in table
    assert "q 3-5 kv 0-1" in table  # 8 query / 2 KV heads on 3 ranks: KV heads shared
    assert "RowwiseParallel(ranges, output_layout='sequence')" in table
    assert "tok_embeddings            VocabParallel(output_layout='sequence')" in table
    assert "output                    LossParallel(input_layout='sequence')" in table


def test_plan_command_prints_the_table():
    r = run_python(["-m", "llama_tp.plan", "-n", "2"])
    assert r.returncode == 0, r.stderr
    assert "path -> style -> each rank's slice" in r.stdout
    assert "layers.*.feed_forward.w2  RowwiseParallel()" in r.stdout
    assert any(line.startswith("imbalance: ") for line in r.stdout.splitlines())
