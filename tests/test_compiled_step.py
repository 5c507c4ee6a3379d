"""The compiled decode step (engine/step.py) gives the eager step's tokens on every driver
and rank count, and keeps a bounded number of compiled graphs."""

from __future__ import annotations

import json

import pytest
from conftest import launch
from fixtures import write_hf_model
from moe_fixtures import FAMILIES

from llama_tp import load
from llama_tp.engine import step


def _lines(r) -> list[dict]:
    out = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert out and r.returncode == 0, (r.stdout, r.stderr[-3000:])
    return out


def _check(res: dict) -> None:
    assert all(res["same"].values()), res
    assert res["traces"] > 0, res  # the compiled runs did compile
    assert all(n > 0 for n in res["tokens"].values()), res


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("moe") / "m", **FAMILIES["qwen3_moe"])


def test_one_process_every_driver(tiny_dir, default_gguf):
    from mp_compiled import checks

    # the built-in model (native quantized products and primitives in the graph): a
    # batch of greedy and seeded rows, its costliest check, stands for the rest
    for path, extras, only in ((tiny_dir, True, ()), (default_gguf, False, ("batch",))):
        model, tok = load(path)
        res = checks(model, tok, extras, only)
        res["traces"] = step.decode_step_for(model).stats()["traces"]
        _check(res)


def test_two_ranks_every_driver_and_moe_both_splits(tiny_dir, moe_dir):
    specs = [str(tiny_dir), f"{moe_dir}@-@tensor", f"{moe_dir}@-@expert"]
    results = _lines(launch(2, ["tests/mp_compiled.py", *specs, "--extras"], timeout=600))
    assert [r["spec"] for r in results] == specs
    for r in results:
        _check(r)


def test_three_ranks_uneven_heads_weighted(tiny_dir):
    # 8 query / 2 KV heads over 3 ranks by weights 2:1:1: uneven, a KV head shared
    spec = f"{tiny_dir}@2:1:1"
    (res,) = _lines(launch(3, ["tests/mp_compiled.py", spec], timeout=600))
    assert res["spec"] == spec
    _check(res)


def test_the_compile_cache_stays_bounded_over_1000_steps(tiny_dir, monkeypatch):
    """Rows join and leave for 1,000 steps, so the batch size keeps changing: the step
    keeps at most MAX_ENTRIES graphs (4 here, evicting the least recently used), every
    step runs compiled, and a shape seen before is not compiled again while it is kept."""
    monkeypatch.setattr(step, "MAX_ENTRIES", 4)
    from llama_tp.checkpoints.tokenizer import encode_prompt
    from llama_tp.engine.batch import BatchEngine, Decision, Join, SamplingParams

    model, tok = load(tiny_dir)
    engine = BatchEngine(model, tok)
    s = step.decode_step_for(model)
    prompt = encode_prompt(tok, "hello")
    steps, uid, sizes = 0, 0, set()
    while steps < 1000:
        joins = []
        for _ in range(1 + uid % 3 if len(engine) < 6 else 0):  # 1-3 join when there is room
            n = 2 + (uid * 7) % 11  # rows of 2 to 12 tokens: they leave at different steps
            joins.append(Join(uid, prompt, SamplingParams(max_tokens=n, temperature=0.0)))
            uid += 1
        engine.apply(Decision(joins=joins))
        sizes.add(len(engine))
        engine.step()
        steps += 1
        assert s.stats()["entries"] <= step.MAX_ENTRIES
    stats = s.stats()
    assert len(sizes) > step.MAX_ENTRIES // 2, sizes  # the batch size did vary
    assert stats["evictions"] > 0, stats  # more shapes than the cache keeps
    assert stats["calls"] >= 900, stats  # (steps where every row ends now make none)
    assert stats["traces"] < stats["calls"] / 4, stats  # not compiled at every step
