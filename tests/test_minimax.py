"""MiniMax-M2's own checks (issue 43): what the family test kit does not check of every
family (tests/test_families.py: one process against mlx-lm's own minimax, a chat's
second turn, `bench --synthetic`, llama.cpp's `minimax-m2` GGUF, the optional fields;
tests/test_flagships.py: the ranks): its q/k norms over all heads, and `plan` of its
release's config."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import ROOT, run_python
from family_kit import folders


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return folders(tmp_path_factory, ("minimax",))


def test_qk_norms_span_all_heads(models):
    """The q/k norms really span all heads: per-head norms of the same weights give other
    values."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    ours = build_model(open_checkpoint(models["minimax-q4"]))
    attention = ours.layers[0].attention
    q = mx.random.normal((1, 3, attention.q_norm.weight.size))
    per_head = mx.fast.rms_norm(q.reshape(1, 3, 10, 32), None, 1e-6).reshape(q.shape)
    assert (
        mx.abs(attention.norms(q, q[..., :64])[0] - per_head * attention.q_norm.weight).max() > 1e-3
    )


def test_plan_of_minimax_m2_config():
    """`plan` of MiniMax-M2 (230B, 4-bit as mlx-lm's convert writes it) on 3 Macs, the
    third smaller (--split 2:2:1): 48 heads as 18/18/12 over 8 KV heads as 3/3/2, 256
    experts by expert as 103/102/51, and the q/k norms' collective."""
    config = ROOT / "docs" / "configs" / "MiniMax-M2-4bit" / "config.json"
    out = run_python(
        ["-m", "llama_tp.plan", "-n", "3", "--split", "2:2:1", "--moe-split", "expert"]
        + ["--model", str(config)]
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"^[0-2] ", line)]
    assert [r[1:5] for r in rows] == [
        ["0-17", "[18]", "0-2", "[3]"],
        ["18-35", "[18]", "3-5", "[3]"],
        ["36-47", "[12]", "6-7", "[2]"],
    ]
    assert [r[6:8] for r in rows] == [["0-102", "[103]"], ["103-204", "[102]"], ["205-255", "[51]"]]
    assert [r[-2:] for r in rows] == [["48.18", "GiB"], ["47.72", "GiB"], ["23.96", "GiB"]]
    assert "q/k norms over all heads (6144 query, 1024 key values)" in out.stdout
    assert "model_type 'minimax' is implemented natively" in out.stdout
