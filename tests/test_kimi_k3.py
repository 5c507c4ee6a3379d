"""Kimi K3's own checks (issue 43): what the family test kit does not check of every
family (tests/test_families.py: one process against mlx-lm's own kimi_k3 (fused KDA with
a lower-bounded decay and a full-rank gate, gated latent attention through q_lora_rank,
SiTU, latent experts normed after their sum, attention residuals over blocks of 2), a
chat's second turn, `bench --synthetic`, llama.cpp's `kimi-k3` GGUF, the optional fields;
tests/test_flagships.py: the ranks): `plan`, the release's layout, its packed MXFP4
experts, and MXFP4 experts in a GGUF file."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from family_kit import ATOL, TOKENS, folders, greedy


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return folders(tmp_path_factory, ("kimi_k3",))


def test_plan_of_kimi_k3(models):
    """`plan` on 3 ranks (--split 2:2:1, by expert): 10 latent heads as 4/4/2, 5 KDA heads
    as 2/2/1 (each rank's states for its heads), 5 experts as 2/2/1, and K3's own line."""
    from conftest import run_python

    out = run_python(
        ["-m", "llama_tp.plan", "-n", "3", "--split", "2:2:1", "--moe-split", "expert"]
        + ["--model", str(models["kimi_k3"])]
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line[:2] in ("0 ", "1 ", "2 ")]
    assert [r[1:3] + r[5:7] + r[11:13] for r in rows[-3:]] == [
        ["0-3", "[4]", "0-1", "[2]", "0-1", "[2]"],
        ["4-7", "[4]", "2-3", "[2]", "2-3", "[2]"],
        ["8-9", "[2]", "4-4", "[1]", "4-4", "[1]"],
    ]
    assert "Recurrent state per sequence: rank 0 20.50 KiB, rank 1 20.50 KiB, rank 2 10.25 KiB" in (
        out.stdout
    )
    assert "Kimi K3: fused KDA" in out.stdout and "before the latent's norm" in out.stdout
    assert "model_type 'kimi_k3' is implemented natively" in out.stdout


def test_release_layout_equals_mlx_lm(models, tmp_path):
    """The release's layout (`flagship_fixtures.release_k3`: q/k/v projections and convs
    apart, per-expert w1/w2/w3, A_log longer than the heads, kv_b_proj, `*_res.proj_weight`)
    reads as the model holds it and gives mlx-lm's logits (its sanitize undoing the same;
    on 3 ranks, read in slices: test_flagships)."""
    from mlx_lm.utils import load_model

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    path = models["kimi_k3-release"]
    x = TOKENS[:, :12]
    ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
    assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL


def test_release_packed_experts_are_mxfp4(models, tmp_path):
    """The release's routed experts as it ships them (`flagship_fixtures.packed_k3`:
    compressed-tensors' mxfp4-pack-quantized, `weight_packed` / `weight_scale` per expert)
    are held as stored in MLX's `mxfp4` mode, never dequantized: mlx-lm's logits on the
    same folder (its sanitize views the bytes as uint32; 0.0 apart, measured), the logits
    (within 1e-4; 2.3e-6, measured) and 32 greedy tokens of the same folder with those
    experts' values in float32; a slice of the packed columns reads those bytes, and
    E8M0-typed scales as uint8; `plan` from its config.json alone holds the same bytes;
    packed tensors of another kind are refused in one line."""
    from flagship_release import packed_k3
    from mlx_lm.utils import load_model

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.base import CheckpointError
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.config_only import read_config_only

    release = models["kimi_k3-release"]
    packed = packed_k3(release, tmp_path / "packed")
    ckpt = open_checkpoint(packed)
    name = "layers.1.feed_forward.switch_mlp.down_proj"
    w, s = ckpt.weights[f"{name}.weight"], ckpt.weights[f"{name}.scales"]
    assert (w.dtype, w.shape, s.dtype, s.shape) == (mx.uint32, (5, 32, 16), mx.uint8, (5, 32, 4))
    source, stored = ckpt.sources[f"{name}.weight"]
    assert mx.array_equal(source.read(stored, 2, 4, 12), w[:, :, 4:12])
    assert mx.array_equal(source.read(stored, 0, 1, 3), w[1:3])
    ours = build_model(ckpt)
    assert ours.layers[1].feed_forward.switch_mlp.down_proj.mode == "mxfp4"
    values = build_model(open_checkpoint(packed_k3(release, tmp_path / "values", False)))
    x = TOKENS[:, :12]
    assert mx.abs(ours(x) - values(x)).max().item() <= ATOL
    assert mx.abs(ours(x) - load_model(packed)[0](x)).max().item() <= ATOL
    assert greedy(ours, x[0].tolist(), 32) == greedy(values, x[0].tolist(), 32)
    e8m0 = open_checkpoint(packed_k3(release, tmp_path / "e8m0", e8m0=True))
    source, stored = e8m0.sources[f"{name}.scales"]
    assert [f.tensors[x].dtype for f, x in source.parts] == ["F8_E8M0"] * 5
    assert mx.array_equal(source.read(stored, 0, 2, 5), s[2:5])
    plan = read_config_only(packed / "config.json").weights
    held = {k: (v.shape, v.dtype) for k, v in ckpt.weights.items() if ".switch_mlp." in k}
    assert held == {k: (plan[k].shape, plan[k].dtype) for k in held}
    weights = mx.load(str(packed / "model.safetensors"))
    stored = "model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    weights[stored] = weights[stored].view(mx.int32)
    mx.save_safetensors(str(packed / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match=f"{stored}: int32 .*mxfp4-pack-quantized"):
        open_checkpoint(packed)


def test_gguf_mxfp4_experts_are_held_as_stored(models, tmp_path):
    """llama.cpp's `kimi-k3` GGUF with MXFP4 experts (what the converter writes from the
    release's packed ones), held as stored: its own values' logits (6.4e-6 apart,
    measured); the float32 and Q8_0 files are the kit's."""
    from flagship_gguf import gguf_k3

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    src, x = models["kimi_k3"], TOKENS[:, :12]
    mxfp4 = open_checkpoint(gguf_k3(src, tmp_path / "mxfp4.gguf", 39, experts=True))
    assert any(n.startswith("MXFP4 ") for n in mxfp4.notes)
    values = gguf_k3(src, tmp_path / "mxfp4-values.gguf", 39, stored=False, experts=True)
    got, want = build_model(mxfp4)(x), build_model(open_checkpoint(values))(x)
    assert mx.abs(got - want).max().item() <= ATOL
