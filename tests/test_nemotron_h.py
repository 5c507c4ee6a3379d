"""Nemotron-H's own checks (issue 43): what the family test kit does not check of every
family (tests/test_families.py: one process against mlx-lm's own nemotron_h, 10 Mamba
heads in 5 groups and one group of 5, a chat's second turn, `bench --synthetic`,
llama.cpp's `nemotron_h_moe` and `nemotron_h` GGUF, the optional fields;
tests/test_flagships.py: the ranks): the config errors and `plan` of Nemotron 3 Nano."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, run_python


def test_config_errors_name_the_numbers(tmp_path):
    """A pattern character, latent experts or heads not in whole groups: one line each."""
    import json

    from flagship_fixtures import NEMOTRON_H

    from llama_tp.checkpoints import CheckpointError
    from llama_tp.checkpoints.hf import args_from_config

    cases = [
        (dict(moe_latent_size=32), "moe_latent_size"),
        (dict(mamba_num_heads=10, n_groups=4), "10 Mamba heads are not a multiple"),
    ]
    for change, message in cases:
        with pytest.raises(CheckpointError, match=message):
            args_from_config(json.loads(json.dumps({**NEMOTRON_H, **change})), tmp_path)
    with pytest.raises(CheckpointError, match="Unsupported layers_block_type"):
        bad = {k: v for k, v in NEMOTRON_H.items() if k != "hybrid_override_pattern"}
        args_from_config({**bad, "layers_block_type": ["mamba", "lstm"]}, tmp_path)


def test_plan_of_nemotron_3_nano_config():
    """`plan` of Nemotron 3 Nano 30B-A3B (4-bit as mlx-lm's convert writes it) on 3 Macs,
    the third smaller (--split 2:2:1): 64 Mamba heads in whole groups of 8 as 24/24/16,
    128 experts by expert as 51/51/26, each rank's Mamba state, and the Mamba line."""
    config = ROOT / "docs" / "configs" / "Nemotron-3-Nano-30B-A3B-4bit" / "config.json"
    out = run_python(
        ["-m", "llama_tp.plan", "-n", "3", "--split", "2:2:1", "--moe-split", "expert"]
        + ["--model", str(config)]
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"^[0-2] ", line)]
    assert [r[-8:-4] for r in rows] == [
        ["0-23", "[24]", "0-2", "[3]"],
        ["24-47", "[24]", "3-5", "[3]"],
        ["48-63", "[16]", "6-7", "[2]"],
    ]
    assert [r[-2:] for r in rows] == [["6.60", "GiB"], ["6.60", "GiB"], ["3.40", "GiB"]]
    assert "Recurrent state per sequence: rank 0 17.55 MiB, rank 1 17.55 MiB, rank 2 11.70 MiB" in (
        out.stdout
    )
    assert "Mamba-2 (23 of 52 layers): 64 heads of 64 in 8 groups" in out.stdout
    assert "model_type 'nemotron_h' is implemented natively" in out.stdout
