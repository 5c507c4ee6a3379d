"""Kimi-Linear's own checks (issue 43): what the family test kit does not check of every
family (tests/test_families.py: one process against mlx-lm's own kimi_linear, a chat's
second turn, `bench --synthetic`, llama.cpp's `kimi-linear` GGUF, the optional fields;
tests/test_flagships.py: the ranks): `plan` of its release's config, the release's
layout, and `convert`'s folder as mlx-lm loads it."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import ROOT, run_python
from family_kit import ATOL, TOKENS, folders


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return folders(tmp_path_factory, ("kimi_linear",))


def test_plan_of_kimi_linear_config():
    """`plan` of Kimi-Linear-48B-A3B (4-bit as mlx-lm's convert writes it) on 3 Macs, the
    third smaller (--split 2:2:1): 32 latent heads and 32 KDA heads as 13/13/6, 256
    experts by expert as 103/102/51, each rank's KDA states for its heads only."""
    config = ROOT / "docs" / "configs" / "Kimi-Linear-48B-A3B-4bit" / "config.json"
    out = run_python(
        ["-m", "llama_tp.plan", "-n", "3", "--split", "2:2:1", "--moe-split", "expert"]
        + ["--model", str(config)]
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"^[0-2] ", line)]
    assert [r[1:3] + r[5:7] + r[11:13] for r in rows] == [
        ["0-12", "[13]", "0-102", "[103]", "0-12", "[13]"],
        ["13-25", "[13]", "103-204", "[102]", "13-25", "[13]"],
        ["26-31", "[6]", "205-255", "[51]", "26-31", "[6]"],
    ]
    assert [r[-2:] for r in rows] == [["10.37", "GiB"], ["10.27", "GiB"], ["5.14", "GiB"]]
    assert "Recurrent state per sequence: rank 0 16.82 MiB, rank 1 16.82 MiB, rank 2 7.76 MiB" in (
        out.stdout
    )
    assert "model_type 'kimi_linear' is implemented natively" in out.stdout


def _release(src: Path, out: Path) -> Path:
    """The Hugging Face release's layout of mlx-lm's float32 folder `src` (what mlx-lm's
    sanitize undoes): per-expert w1/w2/w3 under `block_sparse_moe`, the routing bias in
    its gate, convs `q_conv1d` (C, 1, K), the latent's `kv_b_proj`."""
    import shutil

    weights = mx.load(str(src / "model.safetensors"))
    names = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    rel = {}
    for k, v in weights.items():
        k2 = k.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        if ".mlp.switch_mlp." in k:
            proj = k.split(".")[-2]
            for e in range(v.shape[0]):
                rel[k.replace("mlp.switch_mlp", f"block_sparse_moe.experts.{e}").replace(
                    proj, names[proj])] = v[e]  # fmt: skip
            continue
        if ".layers.1.mlp." in k2:
            k2 = k2.replace(".mlp.", ".block_sparse_moe.")
        if "_conv.conv.weight" in k2:
            k2, v = k2.replace("_conv.conv.", "_conv1d."), v.swapaxes(1, 2)
        if k2.endswith("embed_q.weight") and "unembed" not in k2:
            up = weights[k.replace("embed_q", "unembed_out")]  # (H, v, rank)
            v = mx.concatenate([v.swapaxes(1, 2), up], axis=1).reshape(-1, v.shape[1])
            k2 = k2.replace("embed_q", "kv_b_proj")
        elif k2.endswith("unembed_out.weight"):
            continue
        rel[k2] = v
    shutil.copytree(src, out)
    mx.save_safetensors(str(out / "model.safetensors"), rel)
    return out


def test_release_layout_equals_mlx_lm(models, tmp_path):
    """A folder in the release's layout reads as the model holds it (experts stacked, the
    convs turned, kv_b_proj split into the latent's embed_q / unembed_out, A_log flat) and
    gives mlx-lm's logits (its sanitize undoing the same)."""
    from mlx_lm.utils import load_model

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    path = _release(models["kimi_linear"], tmp_path / "release")
    x = TOKENS[:, :12]
    ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
    assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL


def test_convert_writes_what_mlx_lm_loads(models, tmp_path):
    """`convert` (float32, and 4-bit) writes a folder mlx-lm's own class loads (A_log as it
    holds it, its shared experts' names) with the logits llama_tp reads from it."""
    from mlx_lm.utils import load_model

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.convert import convert

    x = TOKENS[:, :12]
    for bits in (None, 4):
        out = convert(
            models["kimi_linear"],
            tmp_path / f"q{bits}",
            quantize=bits,
            group_size=32,
            progress=False,
        )
        ours, theirs = build_model(open_checkpoint(out)), load_model(out)[0]
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, bits
