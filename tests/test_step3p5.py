"""Step-3.5's own checks (issue 43): what the family test kit does not check of every
family (tests/test_families.py: one process against mlx-lm's own step3p5, a chat's second
turn, `bench --synthetic`, llama.cpp's `step35` GGUF, the optional fields;
tests/test_flagships.py: the ranks): its head-wise gates and clamps, and `plan` of its
release's config."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import ROOT, run_python
from family_kit import TOKENS, folders


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return folders(tmp_path_factory, ("step3p5",))


def test_gates_and_clamps_matter(models):
    """The head-wise gates and the experts' clamps (at 0.5) change the logits."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = TOKENS[:, :12]
    ours = build_model(open_checkpoint(models["step3p5-q4"]))
    whole = ours(x)
    gate, clamp = ours.layers[1].attention.g_proj, ours.layers[1].feed_forward.switch_mlp
    del ours.layers[1].attention.g_proj
    assert mx.abs(ours(x) - whole).max().item() > 1e-3  # the gate matters
    ours.layers[1].attention.g_proj = gate
    clamp.activation.limit = 100.0
    assert mx.abs(ours(x) - whole).max().item() > 1e-3  # the experts' clamp at 0.5 too


def test_plan_of_step3p5_flash_config():
    """`plan` of Step-3.5-Flash (196B, 4-bit as mlx-lm's convert writes it) on 3 Macs, the
    third smaller (--split 2:2:1): the global layers' 64 heads as 24/24/16 over 8 KV heads
    as 3/3/2, the sliding layers' 96 as 39/38/19 over 4/4/2 (two KV heads held twice),
    288 experts by expert as 115/115/58, and the sliding layers' line."""
    config = ROOT / "docs" / "configs" / "Step-3.5-Flash-4bit" / "config.json"
    out = run_python(
        ["-m", "llama_tp.plan", "-n", "3", "--split", "2:2:1", "--moe-split", "expert"]
        + ["--model", str(config)]
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"^[0-2] ", line)]
    assert [r[1:5] for r in rows] == [
        ["0-23", "[24]", "0-2", "[3]"],
        ["24-47", "[24]", "3-5", "[3]"],
        ["48-63", "[16]", "6-7", "[2]"],
    ]
    assert [r[7:9] for r in rows] == [["0-114", "[115]"], ["115-229", "[115]"], ["230-287", "[58]"]]
    assert [r[13:17] for r in rows] == [
        ["0-38", "[39]", "0-3", "[4]"],
        ["39-76", "[38]", "3-6", "[4]"],
        ["77-95", "[19]", "6-7", "[2]"],
    ]
    assert [r[-2:] for r in rows] == [["41.23", "GiB"], ["41.21", "GiB"], ["20.82", "GiB"]]
    assert "33 of 45 layers slide over 96 query / 8 KV heads of their own" in out.stdout
    assert "model_type 'step3p5' is implemented natively" in out.stdout
