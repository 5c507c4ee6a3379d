"""The tp x pp mesh: pipeline stages, tensor-parallel inside each (parallel/mesh.py,
loading/pipeline.py). One launch per mesh checks several models (tests/mp_mesh.py)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import launch, run_python
from fixtures import write_hf_model

from llama_tp.checkpoints import open_checkpoint
from llama_tp.loading.agreement import disagreement
from llama_tp.loading.mesh_plan import mesh_plan
from llama_tp.loading.pipeline import MIN_MICRO, micro_batches
from llama_tp.parallel.mesh import MeshError, balanced_split, layout, mesh_shape, parse_split
from llama_tp.parallel.plan_text import human_bytes

# --- pure Python: shapes, placement, splits ---


def test_mesh_shape():
    assert mesh_shape(4, None, None) == (4, 1)  # default: all tensor-parallel
    assert mesh_shape(4, None, 2) == (2, 2)
    assert mesh_shape(4, 2, 2) == (2, 2)
    assert mesh_shape(3, None, 3) == (1, 3)
    with pytest.raises(MeshError, match=r"^--tp 2 x --pp 3 = 6 ranks, but 4 are running$"):
        mesh_shape(4, 2, 3)
    with pytest.raises(MeshError, match="--pp 3 does not divide the 4 running ranks"):
        mesh_shape(4, None, 3)
    with pytest.raises(MeshError, match="--tp must be at least 1"):
        mesh_shape(4, 0, None)
    # --dp replicas (the server): T * P * D ranks
    assert mesh_shape(4, None, None, 2) == (2, 1)
    assert mesh_shape(8, None, 2, 2) == (2, 2)
    assert mesh_shape(4, 1, 2, 2) == (1, 2)
    with pytest.raises(MeshError, match=r"^--dp 3 does not divide the 4 running ranks$"):
        mesh_shape(4, None, None, 3)
    with pytest.raises(MeshError, match=r"^--tp 2 x --pp 2 x --dp 2 = 8 ranks, but 4 are"):
        mesh_shape(4, 2, 2, 2)
    with pytest.raises(MeshError, match="--dp must be at least 1, got 0"):
        mesh_shape(4, None, None, 0)


def test_layout_keeps_hosts_in_one_tensor_group():
    # Two Macs, ranks interleaved by the hostfile: a, b, a, b.
    hosts = ["a", "b", "a", "b"]
    assert layout(hosts, 2, 2) == [[0, 2], [1, 3]]
    assert layout(hosts, 2, 2, by_host=False) == [[0, 1], [2, 3]]
    assert layout(["h"] * 6, 2, 3) == [[0, 1], [2, 3], [4, 5]]


def test_balanced_split():
    # Equal layers; the embedding and the head weigh two layers each.
    assert balanced_split([1] * 6, 2, 2, 2) == [range(0, 3), range(3, 6)]
    assert balanced_split([1] * 6, 0, 3, 2) == [range(0, 4), range(4, 6)]
    assert balanced_split([1] * 5, 0, 0, 3) == [range(0, 1), range(1, 3), range(3, 5)]
    assert [len(r) for r in balanced_split([1] * 30, 1, 1, 4)] == [7, 8, 8, 7]
    with pytest.raises(MeshError, match="--pp 6 stages, but the model has only 5 layers"):
        balanced_split([1] * 5, 0, 0, 6)


def test_parse_split():
    assert parse_split("10,12", 22, 2) == [range(0, 10), range(10, 22)]
    with pytest.raises(MeshError, match="--pp-split 2,2 sums to 4 layers, but the model has 5"):
        parse_split("2,2", 5, 2)
    with pytest.raises(MeshError, match="has 3 stages, but --pp is 2"):
        parse_split("1,1,3", 5, 2)
    with pytest.raises(MeshError, match="at least one layer"):
        parse_split("0,5", 5, 2)
    with pytest.raises(MeshError, match="layer counts like 10,12"):
        parse_split("a,b", 5, 2)


def test_micro_batches():
    assert micro_batches(1, 2) == [(0, 1)]  # decoding: one pass
    assert micro_batches(63, 2) == [(0, 63)]  # short: not worth splitting
    assert micro_batches(137, 2) == [(0, 35), (35, 70), (70, 105), (105, 137)]
    assert micro_batches(100, 3) == [(0, 34), (34, 68), (68, 100)]
    for length in range(1, 600, 7):
        for stages in (2, 3, 4):
            parts = micro_batches(length, stages)
            assert parts[0][0] == 0 and parts[-1][1] == length
            assert all(a < b for a, b in parts)
            assert all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1))
            assert len(parts) <= 2 * stages
            assert len(parts) == 1 or min(b - a for a, b in parts) >= MIN_MICRO // 2


# --- multi-rank: logits, greedy tokens, what each rank holds ---


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh")
    return {
        "m5": write_hf_model(root / "m5", n_layers=5, tokenizer=False, seed=5),
        "tied": write_hf_model(
            root / "tied", n_layers=5, tie=True, n_heads=4, n_kv_heads=4, tokenizer=False, seed=6
        ),
        "q4": write_hf_model(
            root / "q4",
            n_layers=4,
            head_dim=32,
            hidden_dim=288,
            quantize=(4, 32),
            tokenizer=False,
            seed=7,
        ),
    }


def run_mesh(n: int, tp: int, pp: int, specs: list[str], tokens: int = 12) -> list[dict]:
    args = ["tests/mp_mesh.py", "--tp", str(tp), "--pp", str(pp), "--tokens", str(tokens)]
    args += specs
    r = launch(n, args, timeout=300)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(specs), f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    assert r.returncode == 0, r.stderr[-3000:]
    return lines


def check(line: dict, tp: int, pp: int, split: list[int] | None = None) -> None:
    assert line["diff"] <= line["atol"], line
    assert line["same_tokens"], line
    # per rank: stage, tensor rank, first layer, end, bytes without norms, layers, all bytes
    stages = line["stages"]
    assert sorted((s, t) for s, t, *_ in stages) == [(s, t) for s in range(pp) for t in range(tp)]
    ranges = {s: (a, b) for s, _, a, b, *_ in stages}
    bounds = [ranges[s] for s in range(pp)]
    assert bounds[0][0] == 0 and bounds[-1][1] == line["n_layers"], bounds
    assert all(bounds[s][1] == bounds[s + 1][0] for s in range(pp - 1)), bounds
    if split:
        assert [b - a for a, b in bounds] == split
    for _, _, a, b, _, held, _ in stages:
        assert held == b - a  # only its own layers are built
    # Every parameter but the (replicated) norms is held exactly once across the ranks;
    # a tied table twice (the first stage's embedding, the last stage's head).
    expected = line["full_bytes"] + (line["embedding_bytes"] if line["tied"] else 0)
    if "%" not in line["model"]:  # (a weighted split may replicate KV heads)
        assert sum(s[4] for s in stages) == expected, line
    # `python -m llama_tp.plan --tp --pp` (no launch) predicts what every rank loaded.
    spec, _, weights = line["model"].partition("%")
    path, _, text = spec.partition("@")
    split = tuple(float(w) for w in weights.split(":")) if weights else None
    planned = mesh_plan(open_checkpoint(path), tp * pp, tp, pp, text or None, split=split)
    assert [
        [r.stage, r.tp_rank, r.layers.start, r.layers.stop, r.nbytes] for r in planned.ranks
    ] == [[s, t, a, b, nbytes] for s, t, a, b, _, _, nbytes in stages]


def test_pp2_on_2_ranks(models):
    specs = [str(models["m5"]), str(models["tied"]), f"{models['m5']}@1,4"]
    specs.append(f"{models['m5']}@2:3")  # --pp-split weights of the stages' bytes
    # 140 tokens: the prefill (137) runs as 4 micro-batches of 35 (micro_batches)
    lines = run_mesh(2, 1, 2, specs, tokens=140)
    check(lines[0], 1, 2)
    check(lines[1], 1, 2)
    check(lines[2], 1, 2, [1, 4])
    check(lines[3], 1, 2, [2, 3])  # 5 layers, the embedding and the head weighed 2:3
    balanced = [b - a for _, _, a, b, *_ in sorted(lines[0]["stages"])]
    assert balanced == [3, 2]


def test_pp3_uneven_on_3_ranks(models):
    lines = run_mesh(3, 1, 3, [str(models["m5"]), f"{models['m5']}@1,3,1"])
    check(lines[0], 1, 3)
    check(lines[1], 1, 3, [1, 3, 1])


def test_tp2_x_pp2_on_4_ranks(models):
    specs = [str(models[k]) for k in ("m5", "tied", "q4")] + [f"{models['m5']}%2:1"]
    lines = run_mesh(4, 2, 2, specs, tokens=140)
    for line in lines:
        check(line, 2, 2)
    # --split 2:1 in each stage's tensor group: tensor rank 0 holds about twice rank 1's bytes
    weighted = {(s, t): nbytes for s, t, *_, nbytes in lines[3]["stages"]}
    assert all(1.5 < weighted[s, 0] / weighted[s, 1] < 2.5 for s in (0, 1)), weighted


def generate_args(model, *extra: str) -> list[str]:
    return ["-m", "llama_tp.generate", "--model", str(model), "--prompt", "hi", *extra]


def test_generate_tp2_x_pp2_prints_what_one_process_prints(tiny_dir):
    flags = ["--temp", "0", "--max-tokens", "12"]
    one = run_python(generate_args(tiny_dir, *flags), timeout=120)
    assert one.returncode == 0, one.stderr
    four = launch(4, generate_args(tiny_dir, "--tp", "2", "--pp", "2", "--verbose", *flags))
    assert four.stdout == one.stdout, four.stderr[-3000:]
    # and every rank ends cleanly: on Open MPI's backend (4 ranks on 2 cores), a split
    # group freed after the world aborted the rank at exit (parallel/mesh.py)
    assert four.returncode == 0, four.stderr[-3000:]
    # --verbose, rank 0 only: the stages and what each rank holds (gathered from the ranks),
    # which is what the plan predicts without launching anything.
    held = [human_bytes(r.nbytes) for r in mesh_plan(open_checkpoint(tiny_dir), 4, 2, 2).ranks]
    mesh = four.stderr[four.stderr.index("Mesh: ") :].splitlines()[:3]
    assert mesh == [
        "Mesh: --tp 2 x --pp 2",
        f"stage 0: ranks 0, 1: layers 0-0 + embedding (weights: rank 0 {held[0]}, "
        f"rank 1 {held[1]})",
        f"stage 1: ranks 2, 3: layers 1-1 + norm, head (weights: rank 2 {held[2]}, "
        f"rank 3 {held[3]})",
    ], four.stderr
    assert four.stderr.count("Mesh: ") == 1


def test_builtin_model_on_2_stages_prints_what_one_process_prints():
    """SmolLM2 (Q4_1) on --pp 2, with a prompt long enough for micro-batches (its 142
    tokens with the chat template go through in 4): the same text as one process."""
    prompt = "Summarize this in one sentence: " + " ".join(
        f"Tensor parallel inference step {i} splits each layer across the ranks." for i in range(8)
    )
    args = ["-m", "llama_tp.generate", "--prompt", prompt, "--max-tokens", "24", "--temp", "0"]
    one = run_python(args, timeout=180)
    assert one.returncode == 0 and one.stdout.strip(), one.stderr
    two = launch(2, [*args, "--pp", "2"], timeout=240)
    assert two.stdout == one.stdout, two.stderr[-3000:]


def test_chat_verbose_shows_the_mesh(tiny_dir):
    args = ["-m", "llama_tp.chat", "--model", str(tiny_dir), "--pp", "2", "--verbose"]
    r = launch(2, [*args, "--max-tokens", "4"], input="hi\n/quit\n", timeout=120)
    assert r.returncode == 0, r.stderr
    held = [human_bytes(x.nbytes) for x in mesh_plan(open_checkpoint(tiny_dir), 2, None, 2).ranks]
    assert f"stage 0: rank 0: layers 0-0 + embedding (weights: rank 0 {held[0]})" in r.stderr
    assert f"stage 1: rank 1: layers 1-1 + norm, head (weights: rank 1 {held[1]})" in r.stderr
    assert r.stderr.count("Mesh: --tp 1 x --pp 2") == 1


# --- bad input: one line, every rank exits, nothing hangs ---


def assert_usage_error(r, n: int, expected: str) -> None:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {expected}"], r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    for rank in range(n):
        assert re.search(rf"Node with rank {rank} exited with code (2|-15)\b", r.stderr), r.stderr


def test_mesh_not_the_world(tiny_dir):
    r = launch(2, generate_args(tiny_dir, "--tp", "2", "--pp", "3"), timeout=120)
    assert_usage_error(r, 2, "--tp 2 x --pp 3 = 6 ranks, but 2 are running")
    one = run_python(generate_args(tiny_dir, "--pp", "2"), timeout=120)
    assert one.returncode == 2 and "error: --pp 2 does not divide the 1 running rank" in one.stderr


def test_more_stages_than_layers(tiny_dir):
    r = launch(3, generate_args(tiny_dir, "--pp", "3"), timeout=120, ring=True)
    assert_usage_error(r, 3, "--pp 3 stages, but the model has only 2 layers")


def test_pp_split_not_the_layer_count(tiny_dir):
    r = launch(2, generate_args(tiny_dir, "--pp", "2", "--pp-split", "2,1"), timeout=120)
    assert_usage_error(r, 2, "--pp-split 2,1 sums to 3 layers, but the model has 2")
    one = run_python(generate_args(tiny_dir, "--pp-split", "1,1"), timeout=120)
    assert one.returncode == 2 and "error: --pp-split needs --pp" in one.stderr


def test_ranks_started_with_different_meshes(tiny_dir, tmp_path):
    """The start-up agreement compares the mesh before any mesh is made."""
    from mp_ranks import Ranks

    flags = [["--pp", "2"], ["--tp", "2"]]  # 1 x 2 against 2 x 1
    ranks = Ranks(2, lambda r: generate_args(tiny_dir, *flags[r]), tmp_path)
    r0, r1 = ranks.wait(60)
    assert r0.error_lines() == [
        "error: ranks disagree on the mesh (--tp: rank 0 has 1, rank 1 has 2)"
    ], r0.err
    assert r1.err == "" and r0.out == r1.out == ""
    assert r0.code == r1.code == 1


def test_mesh_disagreement_after_loading():
    def facts(split):
        return {"world": 4, "mesh": {"--tp": 2, "--pp": 2, "--pp-split": split}}

    assert disagreement([facts("1,1")] * 4) is None
    assert disagreement([facts("1,1"), facts("1,1"), facts("2,0"), facts("1,1")]) == (
        'ranks disagree on the mesh (--pp-split: ranks 0, 1, 3 have "1,1", rank 2 has "2,0")'
    )


# --- a stage dies: every rank ends (the watchdog's bound) ---


def test_killing_a_later_stage_ends_every_rank(tiny_dir, tmp_path):
    import shutil
    import signal

    from mp_ranks import Ranks

    path = tmp_path / "long"
    shutil.copytree(tiny_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1 << 20
    (path / "config.json").write_text(json.dumps(config))
    args = [*generate_args(path, "--tp", "2", "--pp", "2", "--max-tokens", "500000")]
    ranks = Ranks(4, [*args, "--ignore-chat-template", "--timeout", "10"], tmp_path)
    ranks.wait_for_output(100, timeout=180)
    ranks.signal(3, signal.SIGKILL)  # tensor rank 1 of the last stage
    for r in ranks.wait(10 + 15, [0, 1, 2]):
        assert r.code == 3, (r.rank, r.code, r.seconds, r.err[-2000:])
        assert r.seconds <= 25, (r.rank, r.seconds)
        lines = r.error_lines()
        assert len(lines) == 1, (r.rank, lines)
        assert lines[0].startswith(f"error: rank {r.rank}: "), lines
