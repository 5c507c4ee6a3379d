"""DeepSeek-V3.2 and GLM-5's own checks (issue 43): what the family test kit does not
check of every family (tests/test_families.py: one process against mlx-lm's own
deepseek_v32 and glm_moe_dsa, their CacheList caches, a chat's second turn, `bench
--synthetic`, llama.cpp's `glm-dsa` GGUF, the optional fields; tests/test_flagships.py:
the ranks): the indexer's choice, `plan` of DeepSeek-V3.2's release config,
DeepSeek-V3.2's own `deepseek32` GGUF layout and the GGUF refusals. Each query attends to
the indexer's top 4 keys, so the kit's prompts (12 tokens, then 32 generated) are past
it and the attention really is sparse."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import ROOT, run_python
from family_kit import ATOL, TOKENS, folders, greedy

NAMES = ("deepseek_v32", "glm5")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return folders(tmp_path_factory, NAMES)


def test_the_indexers_choice_matters(models):
    """With a top-k past the prompt every key is attended: other logits (float32, 4-bit,
    GLM-5)."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = TOKENS[:, :12]
    for name in ("deepseek_v32", "deepseek_v32-q4", "glm5"):
        ours = build_model(open_checkpoint(models[name]))
        logits = ours(x)
        for layer in ours.layers:
            layer.attention.indexer.index_topk = 12
        assert mx.abs(ours(x) - logits).max().item() > 1e-2, name


def test_plan_of_deepseek_v32_config():
    """`plan` of DeepSeek-V3.2 (671B, 4-bit as mlx-lm's convert writes it) on 3 Macs, the
    third smaller (--split 2:2:1): 128 heads as 51/51/26, 256 experts by expert as
    103/102/51, the latent and the replicated indexer's keys cached whole on every rank."""
    config = ROOT / "docs" / "configs" / "DeepSeek-V3.2-4bit" / "config.json"
    out = run_python(
        ["-m", "llama_tp.plan", "-n", "3", "--split", "2:2:1", "--moe-split", "expert"]
        + ["--model", str(config)]
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"^[0-2] ", line)]
    assert [r[1:5] for r in rows] == [
        ["0-50", "[51]", "0-7359", "[7360]"],
        ["51-101", "[51]", "7360-14719", "[7360]"],
        ["102-127", "[26]", "14720-18431", "[3712]"],
    ]
    assert [r[5:7] for r in rows] == [["0-102", "[103]"], ["103-204", "[102]"], ["205-255", "[51]"]]
    assert "rank 2 81.91 MiB" in out.stdout  # 61 layers of (512 + 64 + 128) bfloat16 values
    assert "every rank holds its 456.81 MiB of weights" in out.stdout
    assert "model_type 'deepseek_v32' is implemented natively" in out.stdout


def test_deepseek_v32_gguf_equals_the_folder(models, tmp_path):
    """llama.cpp's `deepseek32` layout (`flagship_gguf.gguf_sparse`: deepseek2's latent
    attention and experts plus blk.N.indexer.{attn_q_b,attn_k,k_norm,proj} and
    attention.indexer.*; DeepSeek-V3.2's YaRN as rope.scaling.*): float32 gives the
    folder's logits and 32 greedy tokens (the indexer's keys rotated on halves, as
    llama.cpp rotates them; GLM-5's `glm-dsa` on pairs is the kit's)."""
    from flagship_gguf import gguf_sparse

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = TOKENS[:, :12]
    folder = build_model(open_checkpoint(models["deepseek_v32"]))
    ckpt = open_checkpoint(gguf_sparse(models["deepseek_v32"], tmp_path / "dsv32.gguf"))
    assert ckpt.args.extra["indexer_rope_interleave"] is False
    assert ckpt.args.index_topk == 4 and ckpt.args.index_n_heads == 5
    f32 = build_model(ckpt)
    assert mx.abs(f32(x) - folder(x)).max().item() <= ATOL
    assert greedy(f32, x[0].tolist(), 32) == greedy(folder, x[0].tolist(), 32)


def test_gguf_refusals():
    """A glm-dsa / deepseek32 file without the indexer's sizes, or whose layers reuse an
    earlier layer's top-k (GLM-5.2's attention.indexer.types; llama.cpp's default pattern
    for a 1M-token glm-dsa file that does not say), is refused in one line."""
    from llama_tp.checkpoints.base import CheckpointError
    from llama_tp.checkpoints.gguf_routed import indexer_fields

    sizes = {f"attention.indexer.{k}": 4 for k in ("head_count", "key_length", "top_k")}
    for arch, meta, message in (
        ("deepseek32", {}, "needs attention.indexer.head_count"),
        ("glm-dsa", sizes | {"attention.indexer.types": [True, False]}, "GLM-5.2's"),
        ("glm-dsa", sizes | {"context_length": 1 << 20}, "GLM-5.2's"),
    ):
        with pytest.raises(CheckpointError, match=message):
            indexer_fields(arch, lambda k, d=None, m=meta: m.get(k, d), Path("x.gguf"))
    ok = indexer_fields(
        "glm-dsa",
        lambda k, d=None: (
            (sizes | {"context_length": 1 << 20}).get(k, d)
            if k != "attention.indexer.types"
            else [True, True]
        ),
        Path("x.gguf"),
    )
    assert ok["extra"]["index_topk"] == 4
