"""Each rank reads only its own bytes: pre-split checkpoints, sliced loading,
quantize on convert.

The unsplit reference is always the whole checkpoint read by MLX's own loader
(`build_model(open_checkpoint(...))`) in one process.
"""

from __future__ import annotations

import json
import re
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import launch, run_python
from fixtures import write_hf_model

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model
from llama_tp.checkpoints.convert import convert

# head_dim 32 and hidden 96 = 3 groups of 32: quantized splits stay on group bounds
# for 2 and 3 ranks (3 ranks: query heads 3/3/2, KV heads replicated; 2 ranks: the
# quantized feed-forward splits 2/1 groups).
TINY = dict(n_heads=8, n_kv_heads=2, head_dim=32, hidden_dim=96)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    out = {"fp32": write_hf_model(root / "fp32", **TINY)}
    out["fp16"] = write_hf_model(root / "fp16", dtype=mx.float16, tokenizer=False, **TINY)
    out["q8"] = convert(out["fp32"], root / "q8", quantize=8, group_size=32, progress=False)
    for n in (2, 3):
        out[f"fp32-tp{n}"] = convert(out["fp32"], root / f"fp32-tp{n}", shards=n, progress=False)
        out[f"q8-tp{n}"] = convert(
            out["fp32"], root / f"q8-tp{n}", quantize=8, group_size=32, shards=n, progress=False
        )
    return out


def logits(path, tokens) -> np.ndarray:
    model = build_model(open_checkpoint(path))
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


@pytest.mark.parametrize("n", [2, 3])
def test_presplit_equals_unsplit(models, n):
    """Each rank loads its folder only; logits equal the unsplit checkpoint's, float
    and quantized (the quantized split against the same quantization unsplit)."""
    specs = [f"{models[f'fp32-tp{n}']}={models['fp32']}", f"{models[f'q8-tp{n}']}={models['q8']}"]
    r = launch(n, ["tests/mp_check_logits.py", *specs], timeout=300)
    ok = [line for line in r.stdout.splitlines() if line.startswith("OK ")]
    assert len(ok) == 2, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"


def test_presplit_folders_hold_their_share(models):
    """Rank folders add up to about the whole: only norms (and biases) are repeated."""
    manifest = json.loads((models["fp32-tp2"] / "manifest.json").read_text())
    assert manifest["shards"] == 2 and manifest["fingerprint"]
    whole = (models["fp32"] / "model.safetensors").stat().st_size
    sizes = [
        (models["fp32-tp2"] / r["folder"] / "model.safetensors").stat().st_size
        for r in manifest["ranks"]
    ]
    assert [r["bytes"] for r in manifest["ranks"]] == pytest.approx(sizes, rel=0.01)
    assert whole * 0.99 < sum(sizes) < whole * 1.02
    assert max(sizes) < 0.6 * whole


def _ranks_failed(r, n: int) -> list[int]:
    """Exit codes mlx.launch reports ([WARN] lines) for ranks 0..n-1.

    Every rank exits 1 by itself; one that is still finishing when another has
    exited is terminated by mlx.launch (-15). Either way, none is left running.
    """
    codes = dict(re.findall(r"Node with rank (\d+) exited with code (-?\d+)", r.stderr))
    return [int(codes.get(str(i), 0)) for i in range(n)]


def _error_lines(r) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("error:")]


GEN = ["-m", "llama_tp.generate", "--prompt", "hi", "--max-tokens", "4", "--model"]


def test_wrong_rank_count(models):
    r = launch(3, [*GEN, str(models["fp32-tp2"])], timeout=120, ring=True)
    assert _error_lines(r) == [
        f"error: {models['fp32-tp2']} is split for 2 ranks but 3 ranks are running: "
        "launch 2 ranks, or convert again with --shards 3"
    ], r.stderr
    assert all(code in (1, -15) for code in _ranks_failed(r, 3)), r.stderr


def test_missing_rank_folder(models, tmp_path):
    split = shutil.copytree(models["fp32-tp2"], tmp_path / "tp2")
    shutil.rmtree(split / "rank-1")
    r = launch(2, [*GEN, str(split)], timeout=120)
    lines = _error_lines(r)
    assert len(lines) == 1 and lines[0].startswith(f"error: rank 1: {split}/rank-1: missing"), (
        r.stderr
    )
    assert "rsync -a SRC/rank-1" in lines[0]
    assert all(code in (1, -15) for code in _ranks_failed(r, 2)), r.stderr


def test_truncated_rank_file(models, tmp_path):
    split = shutil.copytree(models["fp32-tp2"], tmp_path / "tp2")
    f = split / "rank-1" / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 1000)
    r = launch(2, [*GEN, str(split)], timeout=120)
    lines = _error_lines(r)
    assert len(lines) == 1, r.stderr
    assert re.match(
        rf"error: rank 1: {f}: truncated: .* ends at byte \d+, the file has "
        rf"{size - 1000}$",
        lines[0],
    ), lines[0]
    assert all(code in (1, -15) for code in _ranks_failed(r, 2)), r.stderr


def test_sliced_loading_reads_only_its_share(models):
    """Two ranks loading an unsplit fp16 checkpoint: each reads (counted by the loader,
    and by the kernel's rchar) about half of the file, never the whole."""
    r = launch(2, ["tests/mp_load_stats.py", str(models["fp16"])], timeout=120)
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    size = (models["fp16"] / "model.safetensors").stat().st_size
    ckpt = open_checkpoint(models["fp16"])
    replicated = sum(v.nbytes for k, v in ckpt.weights.items() if "norm" in k)
    for s in stats:
        assert s["bytes_read"] < 0.6 * size
        # Every byte the loader counts went through a read system call (plus the
        # headers, config and tokenizer files the loader opens).
        assert s["bytes_read"] <= s["rchar"] < s["bytes_read"] + 0.2 * size
    assert sum(s["bytes_read"] for s in stats) == pytest.approx(size + replicated, rel=0.01)


def test_quantized_convert_close_to_float_and_mlx_lm_loads_it(models):
    """8-bit, group 32: the logits stay within 5% of the float model's logit range
    (random weights, so this is the quantization error alone), and mlx-lm loads
    the directory and computes the same logits as llama_tp."""
    from mlx_lm import load as mlx_lm_load

    tokens = [1, 5, 9, 42, 7, 300, 12, 8]
    a, b = logits(models["fp32"], tokens), logits(models["q8"], tokens)
    span = float(a.max() - a.min())
    assert float(np.abs(a - b).max()) < 0.05 * span
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75
    config = json.loads((models["q8"] / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    model, _ = mlx_lm_load(str(models["q8"]))
    c = np.array(model(mx.array([tokens]))[0].astype(mx.float32))
    assert float(np.abs(b - c).max()) < 1e-4


def test_convert_usage_errors(models, tmp_path):
    r = run_python(
        [
            "-m",
            "llama_tp.convert",
            "--model",
            str(models["fp32"]),
            "--out",
            str(tmp_path / "x"),
            "--no-vocab-parallel",
        ]
    )
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --no-vocab-parallel only applies with --shards"
    )
    r = run_python(
        [
            "-m",
            "llama_tp.convert",
            "--model",
            str(models["fp32"]),
            "--out",
            str(tmp_path / "y"),
            "--quantize",
            "3",
        ]
    )
    assert (
        r.returncode == 2
        and "argument --quantize/-q: invalid choice: 3 (choose from 4, 8)" in r.stderr
    )
