"""Weighted splits (`--split 3:1`, `--split memory`): the shares (pure Python), the flag's
refusals, and on 2 and 3 ranks the one-process logits, the tokens and the bytes each rank
reads and holds against the placement `plan` prints (tests/mp_weighted.py)."""

from __future__ import annotations

import json

import pytest
from conftest import launch, run_python
from fixtures import moe_config, write_hf_model

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.convert import convert
from llama_tp.checkpoints.slices import model_shape
from llama_tp.cluster.memory import darwin_available, fake_figures, linux_figures
from llama_tp.parallel.mesh import balanced_split
from llama_tp.parallel.partition import make_plan, vocab_ranges
from llama_tp.parallel.placement import place
from llama_tp.parallel.shares import (
    SplitError,
    memory_split,
    parse_split,
    predicted_slowdown,
    same_split,
    weights_text,
)

# --- pure Python: the shares ---

WEIGHTS = [(2, 1), (3, 1), (1, 3), (3, 1, 1), (1, 2, 5), (5, 3, 2, 1), (1.5, 1)]
HEADS = [(8, 2), (8, 8), (9, 3), (32, 8), (64, 8), (14, 2), (16, 4)]


def _plans():
    for nh, nkv in HEADS:
        for w in WEIGHTS:
            for hidden, gs in ((96, None), (1408, 32), (14336, 64)):
                try:
                    yield make_plan(nh, nkv, 16, 64, hidden, len(w), group_size=gs, weights=w)
                except SplitError:
                    continue


PLANS = list(_plans())


def test_weighted_plans_follow_the_weights_within_one_unit():
    """Every query head and column on exactly one rank, in rank order, and each rank's
    count within one unit of its share: a KV group (whole groups while every rank's share
    is at least one), else a query head; a quantization group of columns."""
    assert len(PLANS) > 100
    kv_groups = replicated = 0
    for p in PLANS:
        w = [x / sum(p.weights) for x in p.weights]
        g = p.n_heads // p.n_kv_heads
        assert [h for part in p.parts for h in part.q_heads] == list(range(p.n_heads))
        whole_groups = all(len(part.q_heads) % g == 0 for part in p.parts) and not (
            p.replicated_kv_heads()
        )
        if min(w) * p.n_kv_heads >= 1 and p.n <= p.n_kv_heads:
            kv_groups += 1
            assert whole_groups, p
            for part, share in zip(p.parts, w, strict=True):
                assert abs(len(part.kv_heads) - share * p.n_kv_heads) < 1, p
        else:
            replicated += 1
            for part, share in zip(p.parts, w, strict=True):
                assert abs(len(part.q_heads) - share * p.n_heads) < 1, p
        unit = p.group_size or 1
        assert [c for part in p.parts for c in part.ffn] == list(range(p.hidden_dim))
        for part, share in zip(p.parts, w, strict=True):
            assert len(part.ffn) % unit == 0
            assert abs(len(part.ffn) - share * p.hidden_dim) < unit, p
    assert kv_groups > 20 and replicated > 20  # both roundings are exercised


def test_equal_weights_are_the_balanced_plan_and_scaled_weights_the_same_split():
    for nh, nkv in HEADS:
        for n in (2, 3):
            assert make_plan(nh, nkv, 16, 64, 96, n, weights=[1] * n) == make_plan(
                nh, nkv, 16, 64, 96, n
            )
    a = make_plan(32, 8, 16, 64, 1408, 2, group_size=32, weights=(3, 1))
    b = make_plan(32, 8, 16, 64, 1408, 2, group_size=32, weights=(6, 2))
    assert a.parts == b.parts and not a.even_attention and not a.even_ffn
    # 70B's heads at 3:1: whole KV groups, 6 and 2
    p = make_plan(64, 8, 128, 8192, 28672, 2, group_size=64, weights=(3, 1))
    assert [len(x.kv_heads) for x in p.parts] == [6, 2] and p.replicated_kv_heads() == {}
    assert [len(x.ffn) for x in p.parts] == [21504, 7168]
    assert vocab_ranges(128256, 2, (3, 1)) == [range(0, 96192), range(96192, 128256)]


def test_experts_split_by_weights():
    from llama_tp.parallel.partition import Experts

    e = Experts(8, 32, "expert", shared_dim=64)
    p = make_plan(8, 2, 16, 64, 96, 3, experts=e, weights=(1, 2, 5))
    assert [len(x.experts) for x in p.parts] == [1, 2, 5]
    assert [len(x.shared_ffn) for x in p.parts] == [8, 16, 40]
    e = Experts(8, 384, "tensor", unit=64)
    p = make_plan(8, 2, 16, 64, 96, 2, experts=e, weights=(2, 1))
    assert [len(x.expert_ffn) for x in p.parts] == [256, 128]
    assert all(x.experts == range(8) for x in p.parts)


@pytest.mark.parametrize(
    "args,message",
    [
        (("3:1:1", 2), "--split 3:1:1 has 3 weights, but there are 2 tensor ranks"),
        (("3", 2), "--split 3 has 1 weight, but there are 2 tensor ranks"),
        (("3:0", 2), "--split 3:0: every weight must be positive, rank 1 has 0"),
        (("2:-1", 2), "--split 2:-1: every weight must be positive, rank 1 has -1"),
        (("a:b", 2), "--split a:b: expected one weight per tensor rank like 3:1, or 'memory'"),
        (((1, 0, 2), 3), "--split 1:0:2: every weight must be positive, rank 1 has 0"),
    ],
)
def test_bad_weight_lists(args, message):
    with pytest.raises(SplitError) as e:
        parse_split(*args)
    assert str(e.value) == message


def test_weights_that_leave_a_rank_nothing_are_refused_with_the_numbers():
    with pytest.raises(SplitError) as e:
        make_plan(8, 2, 16, 64, 96, 2, weights=(20, 1))
    assert str(e.value) == (
        "--split 20:1 leaves rank 1 no query heads: its share of the 8 is 0.38, under half "
        "of one; give it a larger weight"
    )
    with pytest.raises(SplitError, match="leaves rank 0 no feed-forward column groups of 32"):
        make_plan(8, 8, 16, 64, 96, 3, group_size=32, weights=(1, 2, 5))
    # 1:7 on 8 query / 2 KV heads: under one KV group, so query heads, the KV head shared
    p = make_plan(8, 2, 16, 64, 96, 2, weights=(1, 7))
    assert [len(x.q_heads) for x in p.parts] == [1, 7] and p.replicated_kv_heads() == {0: [0, 1]}


def test_parse_and_text():
    assert parse_split(None, 2) is None and parse_split("balanced", 3) is None
    assert parse_split("2:2", 2) is None  # equal weights: balanced
    assert parse_split("memory", 4) == "memory"
    assert parse_split("3:1", 2) == (3.0, 1.0) and parse_split((1, 2, 5), 3) == (1.0, 2.0, 5.0)
    assert weights_text((12 << 30, 4 << 30)) == "3:1" and weights_text((2.5, 1)) == "2.5:1"
    assert weights_text(None) == "balanced"
    assert same_split((6, 2), (3, 1)) and same_split(None, (1, 1)) and not same_split(None, (2, 1))
    assert predicted_slowdown((3, 1), [1, 1]) == pytest.approx(1.5)
    # rank 0 three times as fast: 3:1 takes 0.25 of a step where the balanced split takes 0.5
    assert predicted_slowdown((3, 1), [3, 1]) == pytest.approx(0.5)


def test_memory_figures_and_weights():
    assert fake_figures("24G:12G,8G:6G", 1) == (8 << 30, 6 << 30)
    with pytest.raises(RuntimeError, match="has 2 entries, none for rank 2"):
        fake_figures("24G:12G,8G:6G", 2)
    assert linux_figures("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable: 60 kB\n") == (
        102400,
        61440,
    )
    vm = "Mach Virtual Memory Statistics: (page size of 16384 bytes)\nPages free: 10.\n"
    vm += "Pages active: 99.\nPages inactive: 20.\nPages speculative: 3.\nPages purgeable: 1.\n"
    assert darwin_available(vm) == 34 * 16384
    # tensor ranks: 2 x 2 mesh, the least of each tensor rank's two stages
    assert memory_split([8, 4, 6, 9], {0: 0, 1: 1, 2: 0, 3: 1}, 2) == (6.0, 4.0)
    assert memory_split([5, 5], {0: 0, 1: 1}, 2) is None


def test_pp_split_weights_balance_the_stages_bytes():
    assert balanced_split([1] * 8, 0, 0, 2, (3, 1)) == [range(0, 6), range(6, 8)]
    assert balanced_split([1] * 8, 0, 0, 2, (1, 1)) == balanced_split([1] * 8, 0, 0, 2)


def test_shapes_only_synthetic_has_the_real_ones_shapes(tmp_path):
    """`--shapes-only` (what `plan --synthetic 70b-q4` reads): the same tensors, shapes and
    bytes as the real synthetic checkpoint, its data a hole."""
    from llama_tp.benchmarks.synthetic import write_synthetic

    for spec in ("tiny-fp16", "tiny-q4"):
        shapes = write_synthetic(spec, tmp_path / f"{spec}-shapes", shapes_only=True)
        real = model_shape(open_checkpoint(write_synthetic(spec, tmp_path / spec))).tensors
        assert model_shape(open_checkpoint(shapes)).tensors == real
        size = (shapes / "model.safetensors").stat()
        assert size.st_blocks * 512 < size.st_size / 4  # sparse: no room for the data


def test_plan_prints_each_ranks_share(tiny_dir):
    r = run_python(["-m", "llama_tp.plan", "--model", str(tiny_dir), "-n", "3", "--split", "1:2:5"])
    assert r.returncode == 0, r.stderr
    lines = [" ".join(x.split()) for x in r.stdout.splitlines()]
    rows = [x for x in lines if x[:2] in ("0 ", "1 ", "2 ")][-3:]
    # tiny: 8 query / 2 KV heads, hidden 96, vocabulary 389
    assert rows[0].startswith("0 0 [1] 0* [1] 0-11 [12] 0-48 [49] ")
    assert rows[1].startswith("1 1-2 [2] 0* [1] 12-35 [24] 49-145 [97] ")
    assert rows[2].startswith("2 3-7 (mapped) [5] 0*,1 [2] 36-95 [60] 146-388 [243] ")
    assert lines[-1] == "Runs native: model_type 'llama' is implemented natively"
    share, cache = lines[-3:-1]  # the shares, then each rank's KV cache
    assert share.startswith("split 1:2:5 (12.5% / 25.0% / 62.5%): weight bytes ")
    assert cache.startswith("KV cache per 1,000 tokens: ")
    placement = place(model_shape(open_checkpoint(tiny_dir)), 3, split=(1, 2, 5))
    shares = [float(x.rstrip("%")) for x in share.split("weight bytes ")[1].split(" / ")]
    total = sum(r.nbytes for r in placement.ranks)
    assert shares == [round(100 * r.nbytes / total, 1) for r in placement.ranks]
    bad = run_python(["-m", "llama_tp.plan", "-n", "2", "--split", "3:0"])
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: --split 3:0: every weight must be positive, rank 1 has 0"


# --- multi-rank: logits, tokens, bytes against the placement ---

FAKE = "24G:12G,8G:6G,8G:2G"  # LLAMA_TP_FAKE_MEMORY: ranks' available 12, 6, 2 GiB


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("weighted")
    out = {
        "dense": write_hf_model(root / "dense", seed=11),
        "q8": write_hf_model(
            root / "q8", tokenizer=False, seed=12, head_dim=32, hidden_dim=192, quantize=(8, 32)
        ),
        "moe": write_hf_model(
            root / "moe",
            tokenizer=False,
            seed=13,
            model_type="qwen3_moe",
            head_dim=16,
            **moe_config("qwen3_moe", 8, 2, 32, dense_layers=(0,)),
        ),
        "shared": write_hf_model(
            root / "shared",
            tokenizer=False,
            seed=14,
            model_type="qwen2_moe",
            **moe_config("qwen2_moe", 6, 2, 32, shared_dim=64),
        ),
    }
    out["d21"] = convert(out["dense"], root / "d21", shards=2, split="2:1", progress=False)
    out["dbal"] = convert(out["dense"], root / "dbal", shards=2, progress=False)
    return out


def run_weighted(n: int, specs: list[str], monkeypatch) -> dict[str, dict]:
    monkeypatch.setenv("LLAMA_TP_FAKE_MEMORY", FAKE)
    r = launch(n, ["tests/mp_weighted.py", *specs], timeout=300)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(specs), f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    return {line["spec"]: line for line in lines}


def check(line: dict, path, n: int, split, moe_split: str = "tensor") -> None:
    """One process's logits and tokens; every rank reads and holds what the placement
    (`plan`'s prediction) says, which divides the model by the weights."""
    assert line["diff"] <= line["atol"] and line["same_tokens"], line
    placement = place(model_shape(open_checkpoint(path)), n, moe_split=moe_split, split=split)
    assert line["weights"] == (None if split is None else list(split))
    for rank, (got, mine) in enumerate(zip(line["ranks"], placement.ranks, strict=True)):
        assert got["placement_bytes"] == got["bytes_held"] == mine.nbytes, (rank, line)
        assert got["parameter_bytes"] == mine.nbytes
        assert got["bytes_read"] == mine.nbytes  # sliced reads: exactly this rank's share
        part = mine.part
        for field in ("q_heads", "kv_heads", "ffn", "experts", "expert_ffn"):
            r = getattr(part, field)
            assert got[field] == (None if r is None else [r.start, r.stop]), field
        assert got["vocab"] == [mine.vocab.start, mine.vocab.stop]


def test_two_ranks(models, monkeypatch):
    m = models
    specs = [
        f"{m['dense']}@2:1",
        f"{m['q8']}@2:1",
        f"{m['moe']}@2:1",
        f"{m['shared']}@2:1@expert",
        f"{m['dense']}@memory",
        f"{m['d21']}={m['dense']}@2:1!3:1",
        f"{m['d21']}={m['dense']}@!memory",
        f"{m['dbal']}={m['dense']}@!2:1",
    ]
    got = run_weighted(2, specs, monkeypatch)
    check(got[specs[0]], m["dense"], 2, (2, 1))
    check(got[specs[1]], m["q8"], 2, (2, 1))
    check(got[specs[2]], m["moe"], 2, (2, 1))
    check(got[specs[3]], m["shared"], 2, (2, 1), "expert")
    # --split memory: the ranks' available memory, 12 and 6 GiB
    check(got[specs[4]], m["dense"], 2, (12 << 30, 6 << 30))
    # pre-split folders: the weights they were cut with, whatever --split asks
    cases = zip(specs[5:], ["2:1", "2:1", "evenly"], ["3:1", "memory", "2:1"], strict=True)
    for spec, made, other in cases:
        line = got[spec.partition("!")[0]]
        assert line["diff"] <= line["atol"] and line["same_tokens"], line
        assert line["weights"] == ([2, 1] if made == "2:1" else None)
        if made == "2:1":  # what the unsplit checkpoint loads with --split 2:1
            held = [r["bytes_held"] for r in got[specs[0]]["ranks"]]
            assert [r["bytes_held"] for r in line["ranks"]] == held
        refused = set(line["refused"])
        assert len(refused) == 1, line["refused"]  # the same line on every rank
        assert refused.pop().startswith(f"{spec.split('=')[0]} is split {made} but --split {other}")


def test_three_ranks(models, monkeypatch):
    m = models
    specs = [
        f"{m['dense']}@3:1:1",
        f"{m['dense']}@1:2:5",
        f"{m['moe']}@3:1:1",
        f"{m['moe']}@1:2:5@expert",
        f"{m['q8']}@3:1:1",
        f"{m['dense']}@memory",
    ]
    got = run_weighted(3, specs, monkeypatch)
    check(got[specs[0]], m["dense"], 3, (3, 1, 1))
    check(got[specs[1]], m["dense"], 3, (1, 2, 5))
    check(got[specs[2]], m["moe"], 3, (3, 1, 1))
    check(got[specs[3]], m["moe"], 3, (1, 2, 5), "expert")
    check(got[specs[4]], m["q8"], 3, (3, 1, 1))
    check(got[specs[5]], m["dense"], 3, (12 << 30, 6 << 30, 2 << 30))
    # 1:2:5 by expert: 1, 2 and 5 of the 8 experts
    assert [r["experts"] for r in got[specs[3]]["ranks"]] == [[0, 1], [1, 3], [3, 8]]


def test_generate_split_memory_prints_what_one_process_prints(models, monkeypatch):
    """The flag end to end: `generate --split memory` under faked memory figures."""
    monkeypatch.setenv("LLAMA_TP_FAKE_MEMORY", FAKE)
    args = ["-m", "llama_tp.generate", "--model", str(models["dense"]), "--prompt", "Hello"]
    args += ["--max-tokens", "12", "--ignore-chat-template"]
    one = run_python(args)
    assert one.returncode == 0, one.stderr
    two = launch(2, [*args, "--split", "memory", "--verbose"], timeout=300)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout
    assert "Weighted split 2:1 (66.7% / 33.3%) of each tensor group" in two.stderr


def test_a_split_that_leaves_a_rank_no_heads_is_one_line_on_every_rank(models):
    r = launch(2, ["-m", "llama_tp.generate", "--model", str(models["dense"]), "--split", "20:1"])
    assert r.returncode == 2, r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert errors == [
        "error: --split 20:1 leaves rank 1 no query heads: its share of the 8 is 0.38, "
        "under half of one; give it a larger weight"
    ], r.stderr


def test_ranks_started_with_different_splits(models, tmp_path):
    """The start-up agreement compares --split before anything is loaded."""
    from mp_ranks import Ranks

    splits = ["2:1", "1:2"]
    args = ["-m", "llama_tp.generate", "--model", str(models["dense"]), "--prompt", "hi"]
    ranks = Ranks(2, lambda r: [*args, "--split", splits[r]], tmp_path)
    r0, r1 = ranks.wait(60)
    assert r0.error_lines() == [
        'error: ranks disagree on the mesh (--split: rank 0 has "2:1", rank 1 has "1:2")'
    ], r0.err
    assert r0.code == r1.code == 1
