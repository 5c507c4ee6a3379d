"""Nemotron-H in one process (issue 43): mlx-lm's own nemotron_h on the same folders is
the oracle (`flagship_fixtures.py`: float32 and mlx-lm's 4-bit convert; 10 Mamba heads
in 5 groups, and one group of 5). The ranks (2, 3, 4, --split 3:1, tp2 x pp2, serve)
are `test_flagships.py`'s launches, which check every family at once."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT, run_python
from flagship_fixtures import flagship_models

ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return flagship_models(tmp_path_factory.mktemp("nemotron"), ("nemotron_h", "nemotron_g1"))


def test_one_process_equals_mlx_lm(models):
    """Logits within 1e-4 of mlx-lm's model on the same folder (float32 and 4-bit, one
    group and five), whole and as a cached prefill then single steps, the same 32 greedy
    tokens; caches only for the Mamba and attention layers, holding what `plan` says
    (the attention's keys and values, the Mamba layer's conv and scan states)."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache
    from mlx_lm.utils import load_model
    from test_sparse_attention import _greedy, _greedy_mlx_lm

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.slices import model_shape
    from llama_tp.parallel.placement import kv_cache_bytes, place, state_bytes

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    folders = ("nemotron_h", "nemotron_h-q4", "nemotron_g1")
    assert set(models) == {*folders, "nemotron_h-gguf", "nemotron_g1-gguf"}
    for name in folders:
        path = models[name]
        ckpt = open_checkpoint(path)
        ours, theirs = build_model(ckpt), load_model(path)[0]
        assert type(theirs).__module__.endswith("nemotron_h")
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, name
        mine, ref = make_prompt_cache(ours), make_prompt_cache(theirs)
        # caches of the Mamba and attention layers only, as mlx-lm's make_cache
        assert [isinstance(c, ArraysCache) for c in mine] == [
            isinstance(c, ArraysCache) for c in ref
        ]
        for a, b in [(0, 8), (8, 9), (9, 12)]:
            got = ours(x[:, a:b], cache=mine) - theirs(x[:, a:b], cache=ref)
            assert mx.abs(got).max().item() <= ATOL, (name, a)
        prompt = x[0].tolist()
        assert _greedy(ours, prompt, 32) == _greedy_mlx_lm(theirs, prompt, 32), name
        state = sum(a.nbytes for c in mine if isinstance(c, ArraysCache) for a in c.cache)
        kv = sum(
            c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes
            for c in mine
            if not isinstance(c, ArraysCache)
        )
        shape = model_shape(ckpt)
        rank = place(shape).ranks[0]
        assert state == state_bytes(shape, rank) > 0, name
        assert state + kv == kv_cache_bytes(shape, rank, tokens=12), name


def test_chat_second_turn_reuses_the_cache(models):
    """A chat's second turn prefills only what the first did not leave in the cache (the
    Mamba state checkpointed at the user's turn end: it cannot step back)."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.conversation.chat import Chat

    ckpt = open_checkpoint(models["nemotron_h"])
    chat = Chat(build_model(ckpt), load_tokenizer(ckpt), max_tokens=6)
    chat.send("hi there")
    chat.send("again")
    assert chat.last_stats.prompt_tokens > chat.last_stats.prefilled_tokens >= 1


def test_synthetic_nemotron_is_mlx_lms(tmp_path):
    """`bench --synthetic nemotron-*`: the tensors mlx-lm's own class holds, so that
    mlx-lm loads the same folder (float32 and 4-bit) and gives the same logits."""
    from mlx_lm.utils import load_model

    from llama_tp.benchmarks.synthetic import write_synthetic
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = mx.array(np.random.default_rng(0).integers(0, 512, (1, 12)), mx.int32)
    for spec in ("nemotron-tiny-fp32", "nemotron-tiny-q4"):
        path = write_synthetic(spec, tmp_path / spec)
        ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
        assert ours.args.model_type == "nemotron_h" and ours.args.pattern == "ME*-"
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, spec


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


def test_gguf_equals_the_folder(models, tmp_path):
    """llama.cpp's `nemotron_h_moe` and `nemotron_h` GGUF layouts (`flagship_fixtures.
    gguf_nemotron`: the conv (C, K), ssm_a = -exp(A_log), D (nh, 1), the gated norm by
    groups, the experts stacked; the layers' kinds from per-layer arrays, a "-" layer beside
    experts from its tensors): float32 gives the folder's logits and 32 greedy tokens (five
    groups and one); Q8_0 (the dense file's blocks kept for the native kernels) the next
    tokens of its own values dequantized, its logits within 0.05 (0.0071 and 0.0025:
    measured)."""
    from flagship_gguf import gguf_nemotron
    from test_sparse_attention import _greedy

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    for name in ("nemotron_h", "nemotron_g1"):
        ckpt = open_checkpoint(models[f"{name}-gguf"])
        assert ckpt.args.pattern == ("ME*-" if name == "nemotron_h" else "M*"), name
        gguf, folder = build_model(ckpt), build_model(open_checkpoint(models[name]))
        assert mx.abs(gguf(x) - folder(x)).max().item() <= ATOL, name
        assert _greedy(gguf, x[0].tolist(), 32) == _greedy(folder, x[0].tolist(), 32), name
    for name in ("nemotron_h", "nemotron_g1"):  # blocks kept as stored where they can be
        src = models[name]
        q8 = open_checkpoint(gguf_nemotron(src, tmp_path / f"{name}-q8.gguf", 8), blocks=True)
        values = gguf_nemotron(src, tmp_path / f"{name}-values.gguf", 8, stored=False)
        got, want = build_model(q8)(x), build_model(open_checkpoint(values))(x)
        assert mx.abs(got - want).max().item() <= 0.05, name
        assert (got.argmax(-1) == want.argmax(-1)).all().item(), name
