"""Step-3.5 in one process (issue 43): mlx-lm's own step3p5 on the same folders is the
oracle (`flagship_fixtures.py`: float32 and mlx-lm's 4-bit convert, its router at 8
bits as mlx-lm quantizes it). The ranks (2, 3, 4, --split 3:1, tp2 x pp2, serve) are
`test_flagships.py`'s launches, which check every family at once."""

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
    return flagship_models(tmp_path_factory.mktemp("step3p5"), ("step3p5",))


def test_one_process_equals_mlx_lm(models):
    """Logits within 1e-4 of mlx-lm's model on the same folder (float32 and 4-bit), whole
    and as a cached prefill then single steps past the sliding window (4), the same 32
    greedy tokens, the caches holding what `plan` says (the sliding layers' 2 KV heads
    beside the global layer's 5); the head-wise gates and the clamps matter."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    from test_sparse_attention import _greedy, _greedy_mlx_lm

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.slices import model_shape
    from llama_tp.parallel.placement import kv_cache_bytes, place

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    assert set(models) == {"step3p5", "step3p5-q4", "step3p5-gguf"}
    for name, path in [(k, v) for k, v in models.items() if k != "step3p5-gguf"]:
        ckpt = open_checkpoint(path)
        ours, theirs = build_model(ckpt), load_model(path)[0]
        assert type(theirs).__module__.endswith("step3p5")
        assert [layer.attention.n_heads for layer in ours.layers] == [10, 8, 8]
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, name
        mine, ref = make_prompt_cache(ours), make_prompt_cache(theirs)
        for a, b in [(0, 8), (8, 9), (9, 10), (10, 11), (11, 12)]:
            got = ours(x[:, a:b], cache=mine) - theirs(x[:, a:b], cache=ref)
            assert mx.abs(got).max().item() <= ATOL, (name, a)
        prompt = x[0].tolist()
        assert _greedy(ours, prompt, 32) == _greedy_mlx_lm(theirs, prompt, 32), name
        held = 0  # (a sliding layer's keeps its window of 4 between single steps)
        for c in mine:
            n = min(c.offset, getattr(c, "max_size", None) or c.offset)
            held += c.keys[..., :n, :].nbytes + c.values[..., :n, :].nbytes
        shape = model_shape(ckpt)
        assert held == kv_cache_bytes(shape, place(shape).ranks[0], tokens=12), name
    whole = ours(x)
    gate, clamp = ours.layers[1].attention.g_proj, ours.layers[1].feed_forward.switch_mlp
    del ours.layers[1].attention.g_proj
    assert mx.abs(ours(x) - whole).max().item() > 1e-3  # the gate matters
    ours.layers[1].attention.g_proj = gate
    clamp.activation.limit = 100.0
    assert mx.abs(ours(x) - whole).max().item() > 1e-3  # the experts' clamp at 0.5 too


def test_chat_second_turn_reuses_the_cache(models):
    """A chat's second turn prefills only what the first did not leave in the cache."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.conversation.chat import Chat

    ckpt = open_checkpoint(models["step3p5"])
    chat = Chat(build_model(ckpt), load_tokenizer(ckpt), max_tokens=2)
    chat.send("hi")
    chat.send("ok")
    assert chat.last_stats.prompt_tokens > chat.last_stats.prefilled_tokens >= 1


def test_synthetic_step3p5_is_mlx_lms(tmp_path):
    """`bench --synthetic step3p5-*`: the tensors mlx-lm's own class holds, so that mlx-lm
    loads the same folder (float32 and 4-bit) and gives the same logits (past the window)."""
    from mlx_lm.utils import load_model

    from llama_tp.benchmarks.synthetic import write_synthetic
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = mx.array(np.random.default_rng(0).integers(0, 512, (1, 12)), mx.int32)
    for spec in ("step3p5-tiny-fp32", "step3p5-tiny-q4"):
        path = write_synthetic(spec, tmp_path / spec)
        ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
        assert ours.args.model_type == "step3p5" and ours.layers[1].attention.n_heads == 12
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, spec


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


def test_gguf_equals_the_folder(models, tmp_path):
    """llama.cpp's `step35` GGUF layout (`flagship_gguf.gguf_step`: per-layer head counts,
    the sliding-window pattern, freq_base / freq_base_swa, the global layers' half RoPE,
    attn_gate, exp_probs_b, the per-layer clamps): float32 gives the folder's fields,
    logits and 32 greedy tokens; Q8_0 the next tokens of its own values dequantized, its
    logits within 0.05."""
    from flagship_gguf import gguf_step
    from test_sparse_attention import _greedy

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    src = models["step3p5"]
    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    want = open_checkpoint(src)
    folder = build_model(want)
    ckpt = open_checkpoint(models["step3p5-gguf"])
    assert ckpt.args.extra == want.args.extra
    assert (ckpt.args.n_heads, ckpt.args.n_kv_heads, ckpt.args.layer_types) == (
        10,
        5,
        want.args.layer_types,
    )
    f32 = build_model(ckpt)
    assert mx.abs(f32(x) - folder(x)).max().item() <= ATOL
    assert _greedy(f32, x[0].tolist(), 32) == _greedy(folder, x[0].tolist(), 32)
    q8 = open_checkpoint(gguf_step(src, tmp_path / "q8.gguf", 8))
    values = gguf_step(src, tmp_path / "q8-values.gguf", 8, stored=False)
    got, want = build_model(q8)(x), build_model(open_checkpoint(values))(x)
    print("Q8_0 logits", mx.abs(got - want).max().item())
    assert mx.abs(got - want).max().item() <= 0.05
    assert (got.argmax(-1) == want.argmax(-1)).all().item()
