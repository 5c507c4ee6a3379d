"""Pre-split folders for a tp x pp mesh (`convert --shards N --tp T --pp P`,
loading/mesh_split.py): folder r holds only rank r's stage, sliced; loaded on that mesh
it computes what the unsplit checkpoint computes on it (and in one process); a folder
made for another mesh, split or placement is refused on every rank.

Launches: one per mesh (tests/mp_mesh.py, several models each), one for the loader's
refusals (tests/mp_load_errors.py, several in one launch), and `generate` twice.
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest
from conftest import launch, run_python
from fixtures import write_hf_model

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.base import CheckpointError
from llama_tp.checkpoints.convert import convert
from llama_tp.checkpoints.split import check_mesh
from llama_tp.loading.mesh_plan import mesh_plan
from llama_tp.loading.mesh_split import convert_mesh
from llama_tp.parallel.mesh import MeshError

# head_dim 32 and hidden 96 = 3 groups of 32: the 8-bit splits over 2 ranks stay on groups
TINY = dict(n_heads=8, n_kv_heads=2, head_dim=32, hidden_dim=96, n_layers=5)
MESHES = {  # folder -> (unsplit source, shards, tp, pp, pp_split)
    "m5-2x2": ("m5", 4, 2, 2, None),
    "m5-2x2-1,4": ("m5", 4, 2, 2, "1,4"),
    "tied-2x2": ("tied", 4, 2, 2, None),
    "q8-2x2": ("q8", 4, 2, 2, None),
    "tied-2x2-whole": ("tied", 4, 2, 2, None),  # --no-vocab-parallel
    "m5-pp2": ("m5", 2, None, 2, None),
    "m5-pp2-1,4": ("m5", 2, None, 2, "1,4"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh-split")
    out = {
        "m5": write_hf_model(root / "m5", seed=5, **TINY),
        "tied": write_hf_model(root / "tied", seed=6, tie=True, **TINY),
    }
    out["q8"] = convert(out["m5"], root / "q8", quantize=8, group_size=32, progress=False)
    out["m5-tp4"] = convert(out["m5"], root / "m5-tp4", shards=4, progress=False)
    for name, (src, n, tp, pp, split) in MESHES.items():
        q = dict(quantize=8, group_size=32) if src == "q8" else {}
        source = out["m5"] if src == "q8" else out[src]
        vp = not name.endswith("-whole")
        out[name] = convert_mesh(
            source,
            root / name,
            shards=n,
            tp=tp,
            pp=pp,
            pp_split=split,
            progress=False,
            vocab_parallel=vp,
            **q,
        )
    return out


# --- one process: what each folder holds, the checks ---


def _held(folder) -> dict[str, tuple]:
    return {k: v.shape for k, v in mx.load(str(folder / "model.safetensors")).items()}


@pytest.mark.parametrize("name", list(MESHES))
def test_each_folder_holds_only_its_stage(models, name):
    """Folder r: the layers of rank r's stage (the loader's stage split, the plan's
    bytes), the embedding on the first stage, the norm and head on the last."""
    src, n, tp, pp, split = MESHES[name]
    vp = not name.endswith("-whole")
    plan = mesh_plan(open_checkpoint(models[src]), n, tp, pp, split, vocab_parallel=vp)
    manifest = json.loads((models[name] / "manifest.json").read_text())
    assert manifest["mesh"] == {
        "tp": plan.tp,
        "pp": plan.pp,
        "stages": plan.mesh.stages,
        "split": [len(r) for r in plan.mesh.layers],
        "pp_split": split,
    }
    tied = src == "tied"
    assert manifest["vocab_parallel"] == (vp and tp == 2)
    for r in plan.ranks:
        folder = models[name] / f"rank-{r.rank}"
        shard = json.loads((folder / "shard.json").read_text())
        assert shard["rank"] == r.rank and shard["mesh"]["stage"] == r.stage
        assert shard["mesh"]["layers"] == [r.layers.start, r.layers.stop]
        held = _held(folder)
        layers = {int(k.split(".")[1]) for k in held if k.startswith("layers.")}
        assert layers == set(r.layers), (r.rank, sorted(layers))
        first, last = r.stage == 0, r.stage == pp - 1
        assert ("tok_embeddings.weight" in held) == (first or (last and tied))
        assert ("norm.weight" in held) == last
        assert ("output.weight" in held) == (last and not tied)
        assert manifest["ranks"][r.rank]["bytes"] == r.nbytes, r
        if first or last:  # vocabulary-parallel in the stage's group (unless whole)
            table = held.get("output.weight") or held["tok_embeddings.weight"]
            assert table[0] == (len(r.vocab) if r.vocab else 389), r


def test_folders_of_k_quant_blocks_load_with_the_split_they_were_written_with(tmp_path):
    """A GGUF K-quant ffn_down (blocks of 256) splits its 768 columns 512 | 256 over 2
    ranks, not 384 | 384: the folder records the block, so that loading plans the same."""
    from gguf_writer import Q4_K, llama_vocabulary, tiny_llama_gguf

    from llama_tp.checkpoints.build import empty_split_model
    from llama_tp.parallel.shard import plan_for

    kw = dict(hidden=768, layers=2, vocab=320, metadata=llama_vocabulary(320))
    gguf = tiny_llama_gguf(tmp_path / "k.gguf", {"blk.*.ffn_down.weight": Q4_K}, **kw)
    out = convert_mesh(gguf, tmp_path / "k-2x2", shards=4, tp=2, pp=2, progress=False)
    for rank in range(4):
        folder = open_checkpoint(out, rank, 4)
        stage = json.loads((out / f"rank-{rank}" / "shard.json").read_text())["mesh"]
        plan = plan_for(empty_split_model(folder), 2)  # what loading the folder plans
        columns = len(plan.parts[stage["tp_rank"]].ffn)
        assert columns == (512, 256)[stage["tp_rank"]]
        layer = stage["layers"][0]
        scales = folder.weights[f"layers.{layer}.feed_forward.w2.scales"]
        assert scales.shape == (64, columns // 32)  # MLX groups of 32 values


def test_check_mesh(models):
    """The refusals, one line each: what the folder is for, what runs, how to fix it."""
    mesh = models["m5-2x2"]
    ckpt = open_checkpoint(mesh, 0, 4)
    assert check_mesh(ckpt, 2, 2) == [range(0, 3), range(3, 5)]
    assert check_mesh(ckpt, 2, 2, "3,2", [[0, 1], [2, 3]]) == [range(0, 3), range(3, 5)]
    with pytest.raises(CheckpointError) as e:
        check_mesh(ckpt, 2, 2, None, [[0, 2], [1, 3]])  # two hosts, ranks interleaved
    assert str(e.value) == (
        f"{mesh} is split for the stages 0,1 | 2,3 (world ranks in rank order) but this "
        "mesh places them on 0,2 | 1,3 (ranks grouped by host): launch with "
        "LLAMA_TP_MESH_ORDER=rank, or list each host's ranks together in the hostfile"
    )
    with pytest.raises(MeshError, match="--pp-split 2,2 sums to 4 layers"):
        check_mesh(ckpt, 2, 2, "2,2")  # as the unsplit checkpoint says it
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(mesh, 0, 2)
    assert str(e.value) == (
        f"{mesh} is split for 4 ranks (--tp 2 x --pp 2) but 2 ranks are running: "
        "launch 4 ranks with --tp 2 --pp 2, or convert again with --shards 2"
    )
    plain = open_checkpoint(models["m5-tp4"], 3, 4)
    assert check_mesh(plain, 4, 1) is None


def test_convert_usage_errors(models, tmp_path):
    def convert_cli(*flags: str):
        args = ["-m", "llama_tp.convert", "--model", str(models["m5"]), "--quiet"]
        r = run_python([*args, "--out", str(tmp_path / "x"), *flags], timeout=120)
        assert r.returncode == 2, r.stderr
        return r.stderr.strip()

    assert convert_cli("--pp", "2") == "error: --pp only applies with --shards"
    assert convert_cli("--shards", "4", "--pp", "3") == "error: --pp 3 does not divide --shards 4"
    assert convert_cli("--shards", "4", "--tp", "2", "--pp", "3") == (
        "error: --tp 2 x --pp 3 = 6 ranks, but --shards is 4"
    )
    assert convert_cli("--shards", "2", "--pp", "2", "--pp-split", "2,2") == (
        "error: --pp-split 2,2 sums to 4 layers, but the model has 5"
    )
    assert convert_cli("--shards", "6", "--pp", "6") == (
        "error: --pp 6 stages, but the model has only 5 layers"
    )
    assert not (tmp_path / "x").exists()  # refused before anything is written


# --- several ranks: the folders on their mesh ---


def run_mesh(n: int, tp: int, pp: int, specs: list[str]) -> list[dict]:
    args = ["tests/mp_mesh.py", "--tp", str(tp), "--pp", str(pp), *specs]
    r = launch(n, args, timeout=300)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(specs), f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    return lines


def check(models, line: dict, name: str) -> None:
    """Logits equal one process's and the unsplit checkpoint's on the same mesh; each
    rank holds its folder's bytes, in the folder's stages."""
    assert line["diff"] <= line["atol"] and line["mesh_diff"] <= line["atol"], line
    assert line["same_tokens"], line
    manifest = json.loads((models[name] / "manifest.json").read_text())
    # per rank: stage, tensor rank, first layer, end, bytes without norms, layers, all bytes
    for rank, (stage, _, a, b, _, built, held) in enumerate(line["stages"]):
        entry = manifest["ranks"][rank]
        assert (stage, [a, b], held) == (entry["stage"], entry["layers"], entry["bytes"]), rank
        assert built == b - a


def test_presplit_tp2_x_pp2_on_4_ranks(models):
    # (tied-2x2-whole, --no-vocab-parallel: only its folders are checked, above, to keep
    # this launch short; loading it is the tied path with the plain embedding and head)
    names = ["m5-2x2", "tied-2x2", "q8-2x2"]
    lines = run_mesh(4, 2, 2, [f"{models[k]}={models[MESHES[k][0]]}" for k in names])
    for name, line in zip(names, lines, strict=True):
        check(models, line, name)


def test_presplit_pp2_on_2_ranks(models):
    names = ["m5-pp2", "m5-pp2-1,4", "m5-pp2-1,4"]
    specs = [f"{models[k]}={models['m5']}" for k in names]
    specs[1] += "@1,4"  # the folder's split, given again
    # specs[2]: no --pp-split, so the folder's split holds (the unsplit one is balanced)
    lines = run_mesh(2, 1, 2, specs)
    for name, line in zip(names, lines, strict=True):
        check(models, line, name)
    assert [s[2:4] for s in lines[2]["stages"]] == [[0, 1], [1, 5]]


def test_folders_for_another_mesh_are_refused_on_every_rank(models):
    mesh, plain = str(models["m5-2x2"]), str(models["m5-tp4"])
    loads = [
        {"model": mesh, "pp": 4},
        {"model": mesh},
        {"model": plain, "tp": 2, "pp": 2},
        {"model": mesh, "tp": 2, "pp": 2, "pp_split": "2,3"},
    ]
    r = launch(4, ["tests/mp_load_errors.py", *map(json.dumps, loads)], timeout=300)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("[")]
    assert len(lines) == len(loads), f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    expected = [
        f"{mesh} is split for --tp 2 x --pp 2 but --tp 1 x --pp 4 is running: run it with "
        "--tp 2 --pp 2, or convert again with --shards 4 --tp 1 --pp 4",
        f"{mesh} is split for --tp 2 x --pp 2 but --tp 4 x --pp 1 is running: run it with "
        "--tp 2 --pp 2, or convert again with --shards 4",
        f"{plain} is split for --tp 4 x --pp 1 but --tp 2 x --pp 2 is running: run it "
        "without --pp, or convert again with --shards 4 --tp 2 --pp 2",
        f"{mesh} is split into stages of 3,2 layers but --pp-split 2,3 is given: run it "
        "without --pp-split (or with --pp-split 3,2), or convert again with --shards 4 "
        "--tp 2 --pp 2 --pp-split 2,3",
    ]
    for ranks, message in zip(lines, expected, strict=True):
        assert ranks == [["CheckpointError", message]] * 4


GEN = ["-m", "llama_tp.generate", "--prompt", "hi", "--temp", "0", "--max-tokens", "12"]


def test_generate_on_a_presplit_mesh_prints_what_one_process_prints(tiny_dir, tmp_path):
    """`convert` writes the tokenizer as tokenizer.json: the one process reads that too."""
    out, whole = tmp_path / "tiny-2x2", convert(tiny_dir, tmp_path / "tiny", progress=False)
    flags = ["--shards", "4", "--tp", "2", "--pp", "2", "--quiet"]
    r = run_python(["-m", "llama_tp.convert", "--model", str(tiny_dir), "--out", str(out), *flags])
    assert r.returncode == 0, r.stderr
    one = run_python([*GEN, "--model", str(whole)], timeout=120)
    assert one.returncode == 0, one.stderr
    four = launch(4, [*GEN, "--model", str(out), "--tp", "2", "--pp", "2", "--verbose"])
    assert four.returncode == 0 and four.stdout == one.stdout, four.stderr[-3000:]
    assert "stage 1: ranks 2, 3: layers 1-1 + norm, head" in four.stderr


def test_generate_refuses_a_mesh_folder_run_without_its_mesh(models):
    r = launch(2, [*GEN, "--model", str(models["m5-pp2"])], timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {models['m5-pp2']} is split for --tp 1 x --pp 2 but --tp 2 x --pp 1 is "
        "running: run it with --tp 1 --pp 2, or convert again with --shards 2"
    ], r.stderr
    assert "Traceback" not in r.stderr and r.returncode != 0
    codes = dict(re.findall(r"Node with rank (\d+) exited with code (-?\d+)", r.stderr))
    assert [int(codes.get(str(i), 0)) in (1, -15) for i in range(2)] == [True, True], r.stderr
