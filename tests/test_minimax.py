"""MiniMax-M2 in one process (issue 43): mlx-lm's own minimax on the same folders is the
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
    return flagship_models(tmp_path_factory.mktemp("minimax"), ("minimax",))


def test_one_process_equals_mlx_lm(models):
    """Logits within 1e-4 of mlx-lm's model on the same folder (float32 and 4-bit), whole
    and as a cached prefill then single steps, the same 32 greedy tokens, the caches
    holding what `plan` says; the q/k norms really span all heads (per-head norms of the
    same weights give other logits)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    from test_sparse_attention import _greedy, _greedy_mlx_lm

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.slices import model_shape
    from llama_tp.parallel.placement import kv_cache_bytes, place

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    assert set(models) == {"minimax", "minimax-q4", "minimax-gguf"}
    for name in ("minimax", "minimax-q4"):
        path = models[name]
        ckpt = open_checkpoint(path)
        ours, theirs = build_model(ckpt), load_model(path)[0]
        assert type(theirs).__module__.endswith("minimax") and ckpt.args.rope_dims == 16
        logits = ours(x)
        assert mx.abs(logits - theirs(x)).max().item() <= ATOL, name
        mine, ref = make_prompt_cache(ours), make_prompt_cache(theirs)
        for a, b in [(0, 8), (8, 9), (9, 12)]:
            got = ours(x[:, a:b], cache=mine) - theirs(x[:, a:b], cache=ref)
            assert mx.abs(got).max().item() <= ATOL, (name, a)
        prompt = x[0].tolist()
        assert _greedy(ours, prompt, 32) == _greedy_mlx_lm(theirs, prompt, 32), name
        held = sum(
            c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes for c in mine
        )
        shape = model_shape(ckpt)
        assert held == kv_cache_bytes(shape, place(shape).ranks[0], tokens=12), name
    attention = ours.layers[0].attention
    q = mx.random.normal((1, 3, attention.q_norm.weight.size))
    per_head = mx.fast.rms_norm(q.reshape(1, 3, 10, 32), None, 1e-6).reshape(q.shape)
    assert (
        mx.abs(attention.norms(q, q[..., :64])[0] - per_head * attention.q_norm.weight).max() > 1e-3
    )


def test_chat_second_turn_reuses_the_cache(models):
    """A chat's second turn prefills only what the first did not leave in the cache."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.conversation.chat import Chat

    ckpt = open_checkpoint(models["minimax"])
    chat = Chat(build_model(ckpt), load_tokenizer(ckpt), max_tokens=6)
    chat.send("hi there")
    chat.send("again")
    assert chat.last_stats.prompt_tokens > chat.last_stats.prefilled_tokens >= 1


def test_synthetic_minimax_is_mlx_lms(tmp_path):
    """`bench --synthetic minimax-*`: the tensors mlx-lm's own class holds, so that mlx-lm
    loads the same folder (float32 and 4-bit) and gives the same logits."""
    from mlx_lm.utils import load_model

    from llama_tp.benchmarks.synthetic import write_synthetic
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = mx.array(np.random.default_rng(0).integers(0, 512, (1, 12)), mx.int32)
    for spec in ("minimax-tiny-fp32", "minimax-tiny-q4"):
        path = write_synthetic(spec, tmp_path / spec)
        ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
        assert ours.args.model_type == "minimax" and ours.args.rope_dims == 8
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, spec


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


def test_gguf_equals_the_folder(models, tmp_path):
    """llama.cpp's `minimax-m2` GGUF layout (`flagship_fixtures.gguf_minimax`: q/k norms
    over all heads as attn_q_norm / attn_k_norm, exp_probs_b, rope.dimension_count):
    float32 gives the folder's logits and 32 greedy tokens; Q8_0 the next tokens of its own
    values dequantized, its logits within 0.05 (held as MLX 8-bit: 0.0054, measured)."""
    from flagship_gguf import gguf_minimax
    from test_sparse_attention import _greedy

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    src = models["minimax"]
    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    folder = build_model(open_checkpoint(src))
    ckpt = open_checkpoint(models["minimax-gguf"])
    assert (
        ckpt.args.rope_dims == 16 and not ckpt.args.qk_norm and ckpt.args.router == "sigmoid_bias"
    )
    f32 = build_model(ckpt)
    assert mx.abs(f32(x) - folder(x)).max().item() <= ATOL
    assert _greedy(f32, x[0].tolist(), 32) == _greedy(folder, x[0].tolist(), 32)
    q8 = open_checkpoint(gguf_minimax(src, tmp_path / "q8.gguf", 8))
    values = gguf_minimax(src, tmp_path / "q8-values.gguf", 8, stored=False)
    got, want = build_model(q8)(x), build_model(open_checkpoint(values))(x)
    assert mx.abs(got - want).max().item() <= 0.05
    assert (got.argmax(-1) == want.argmax(-1)).all().item()
