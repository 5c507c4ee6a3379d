"""Llama 4 in one process (issue 43): mlx-lm's own llama4 (the wrapper's text model) and
llama4_text on the same folders are the oracle (`flagship_fixtures.py`: float32 and
mlx-lm's 4-bit convert). The ranks (2, 3, 4, --split 3:1, tp2 x pp2, serve) are
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
    return flagship_models(tmp_path_factory.mktemp("llama4"), ("llama4", "llama4_text"))


def _held(cache) -> int:
    """Bytes of keys and values the caches hold (a chunked one from its chunk's start)."""
    total = 0
    for c in cache:
        n = c.offset - getattr(c, "start_position", 0)
        total += c.keys[..., :n, :].nbytes + c.values[..., :n, :].nbytes
    return total


def test_one_process_equals_mlx_lm(models):
    """Logits within 1e-4 of mlx-lm's model on the same folder (llama4 float32 and 4-bit,
    llama4_text), whole and as a cached prefill then single steps across chunk
    boundaries (chunks of 4), the same 32 greedy tokens, the chunked layers' caches
    holding the current chunk only, as `plan` says; the chunks matter (global attention
    in those layers gives other logits)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    from test_sparse_attention import _greedy, _greedy_mlx_lm

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.slices import model_shape
    from llama_tp.models.caches import ChunkedCache
    from llama_tp.parallel.placement import kv_cache_bytes, place

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    assert set(models) == {"llama4", "llama4-q4", "llama4_text", "llama4-gguf"}
    for name, path in [(k, v) for k, v in models.items() if k != "llama4-gguf"]:
        ckpt = open_checkpoint(path)
        ours, theirs = build_model(ckpt), load_model(path)[0]
        assert type(theirs).__module__.split(".")[-1] == ckpt.args.model_type
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, name
        mine, ref = make_prompt_cache(ours), make_prompt_cache(theirs)
        for a, b in [(0, 6), (6, 7), (7, 8), (8, 9), (9, 12)]:
            got = ours(x[:, a:b], cache=mine) - theirs(x[:, a:b], cache=ref)
            assert mx.abs(got).max().item() <= ATOL, (name, a)
        prompt = x[0].tolist()
        assert _greedy(ours, prompt, 32) == _greedy_mlx_lm(theirs, prompt, 32), name
        chunked = [c for c in mine if isinstance(c, ChunkedCache)]
        assert len(chunked) == (3 if name.startswith("llama4-") or name == "llama4" else 0)
        assert all(c.offset - c.start_position == 4 for c in chunked)  # positions 8-11
        shape = model_shape(ckpt)
        assert _held(mine) == kv_cache_bytes(shape, place(shape).ranks[0], tokens=12), name
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


def test_chat_second_turn_reuses_the_cache(models):
    """A chat's second turn prefills only what the first did not leave in the cache (the
    chunked layers' checkpoint at the first turn's end)."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.conversation.chat import Chat

    ckpt = open_checkpoint(models["llama4"])
    chat = Chat(build_model(ckpt), load_tokenizer(ckpt), max_tokens=6)
    chat.send("hi there")
    chat.send("again")
    assert chat.last_stats.prompt_tokens > chat.last_stats.prefilled_tokens >= 1


def test_synthetic_llama4_is_mlx_lms(tmp_path):
    """`bench --synthetic llama4-*`: the tensors mlx-lm's own class holds, so that mlx-lm
    loads the same folder (float32 and 4-bit) and gives the same logits (past a chunk)."""
    from mlx_lm.utils import load_model

    from llama_tp.benchmarks.synthetic import write_synthetic
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = mx.array(np.random.default_rng(0).integers(0, 512, (1, 12)), mx.int32)
    for spec in ("llama4-tiny-fp32", "llama4-tiny-q4"):
        path = write_synthetic(spec, tmp_path / spec)
        ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
        assert ours.args.model_type == "llama4" and ours.args.attention_chunk_size == 8
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, spec


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


def test_gguf_equals_the_folder(models, tmp_path):
    """llama.cpp's `llama4` GGUF layout (`flagship_gguf.gguf_llama4`: q/k as stored, the
    experts stacked beside the shared expert, the llama3 scaling as rope_freqs, the chunked
    layers by the sliding-window pattern): float32 gives the folder's logits and 32 greedy
    tokens; Q8_0 the next tokens of its own values dequantized, its logits within 0.05."""
    from flagship_gguf import gguf_llama4
    from test_sparse_attention import _greedy

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    src = models["llama4"]
    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    folder = build_model(open_checkpoint(src))
    ckpt = open_checkpoint(models["llama4-gguf"])
    assert ckpt.args.rope_scaling == open_checkpoint(src).args.rope_scaling  # from rope_freqs
    assert ckpt.args.extra == open_checkpoint(src).args.extra
    f32 = build_model(ckpt)
    assert mx.abs(f32(x) - folder(x)).max().item() <= ATOL
    assert _greedy(f32, x[0].tolist(), 32) == _greedy(folder, x[0].tolist(), 32)
    q8 = open_checkpoint(gguf_llama4(src, tmp_path / "q8.gguf", 8))
    values = gguf_llama4(src, tmp_path / "q8-values.gguf", 8, stored=False)
    got, want = build_model(q8)(x), build_model(open_checkpoint(values))(x)
    print("Q8_0 logits", mx.abs(got - want).max().item())
    assert mx.abs(got - want).max().item() <= 0.05
    assert (got.argmax(-1) == want.argmax(-1)).all().item()
