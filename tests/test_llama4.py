"""Llama 4's own checks (issue 43): what the family test kit does not check of every
family (tests/test_families.py: one process against mlx-lm's own llama4 and llama4_text
across chunk boundaries, a chat's second turn, `bench --synthetic`, llama.cpp's `llama4`
GGUF; tests/test_flagships.py: the ranks): the chunked layers' caches and what the chunks
change, the chunked cache's rewind, and `plan` of Maverick's config."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import ROOT, run_python
from family_kit import FAMILIES, TOKENS, folders


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return folders(tmp_path_factory, ("llama4", "llama4_text"))


def test_chunked_layers_hold_their_chunk(models):
    """After the kit's cached steps (12 tokens, chunks of 4) the chunked layers' caches
    hold the current chunk only (positions 8-11): 3 of llama4's layers (float32 and
    4-bit), none of llama4_text's; the chunks matter (global attention in those layers
    gives other logits)."""
    from mlx_lm.models.cache import make_prompt_cache

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.models.caches import ChunkedCache

    for name in ("llama4", "llama4-q4", "llama4_text"):
        ours = build_model(open_checkpoint(models[name]))
        cache = make_prompt_cache(ours)
        for a, b in FAMILIES[name.removesuffix("-q4")].steps:
            mx.eval(ours(TOKENS[:, a:b], cache=cache))
        chunked = [c for c in cache if isinstance(c, ChunkedCache)]
        assert len(chunked) == (0 if name == "llama4_text" else 3), name
        assert all(c.offset - c.start_position == 4 for c in chunked)  # positions 8-11
    x = TOKENS[:, :12]
    ours = build_model(open_checkpoint(models["llama4"]))
    whole = ours(x)
    for layer in ours.layers:
        object.__setattr__(layer, "spec", type(layer.spec)(layer.spec.tables, None))
    assert mx.abs(ours(x) - whole).max().item() > 1e-3


def test_chunked_cache_steps_back_within_its_chunk():
    """The chunked cache steps back while the chunk it returns to is held, not past it
    (the facade then says why: a chat restores a checkpoint instead)."""
    from llama_tp.engine import caches
    from llama_tp.models.caches import ChunkedCache

    c = ChunkedCache(4)
    for _ in range(10):  # positions 0-9: it holds 8-9 (the chunk of the last)
        c.update_and_fetch(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
    assert (c.start_position, c.offset) == (8, 10)
    assert caches.can_rewind([c], 2) and not caches.can_rewind([c], 3)
    assert "chunked-attention" in caches.why_not_rewind([c], 3)
    caches.rewind([c], 2)
    assert c.offset == 8 and caches.recurrent([c])


def test_plan_of_llama4_maverick_config():
    """`plan` of Llama 4 Maverick (400B, 4-bit as mlx-lm's convert writes it) on 3 Macs, the
    third smaller (--split 2:2:1): 40 heads as 15/15/10 over 8 KV heads as 3/3/2, 128
    experts by expert as 51/51/26, and the chunked layers' line."""
    config = ROOT / "docs" / "configs" / "Llama-4-Maverick-17B-128E-Instruct-4bit" / "config.json"
    out = run_python(
        ["-m", "llama_tp.plan", "-n", "3", "--split", "2:2:1", "--moe-split", "expert"]
        + ["--model", str(config)]
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"^[0-2] ", line)]
    assert [r[1:5] for r in rows] == [
        ["0-14", "[15]", "0-2", "[3]"],
        ["15-29", "[15]", "3-5", "[3]"],
        ["30-39", "[10]", "6-7", "[2]"],
    ]
    assert [r[7:9] for r in rows] == [["0-50", "[51]"], ["51-101", "[51]"], ["102-127", "[26]"]]
    assert [r[-2:] for r in rows] == [["83.62", "GiB"], ["83.61", "GiB"], ["42.71", "GiB"]]
    assert "36 of 48 layers attend within chunks of 8192 positions" in out.stdout
    assert "model_type 'llama4' is implemented natively" in out.stdout
