"""Kimi-Linear in one process (issue 43): mlx-lm's own kimi_linear on the same folders is
the oracle (`flagship_fixtures.py`: float32 and mlx-lm's 4-bit convert, its router at 8
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
from mlx_lm.models.cache import ArraysCache

ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return flagship_models(tmp_path_factory.mktemp("kimi"), ("kimi_linear",))


def _held(cache: list) -> int:
    """Bytes the caches hold: the latent's tokens, the KDA layers' four state arrays."""
    total = 0
    for c in cache:
        if isinstance(c, ArraysCache):
            total += sum(a.nbytes for a in c.cache if a is not None)
        else:
            total += c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes
    return total


def test_one_process_equals_mlx_lm(models):
    """Logits within 1e-4 of mlx-lm's model on the same folder (float32 and 4-bit), whole
    and as a cached prefill then single steps, the same 32 greedy tokens, the caches (the
    latent per token, the KDA states per sequence) holding what `plan` says."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    from test_sparse_attention import _greedy, _greedy_mlx_lm

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.slices import model_shape
    from llama_tp.parallel.placement import kv_cache_bytes, place

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    assert set(models) == {"kimi_linear", "kimi_linear-q4", "kimi_linear-gguf"}
    for name in ("kimi_linear", "kimi_linear-q4"):
        path = models[name]
        ckpt = open_checkpoint(path)
        ours, theirs = build_model(ckpt), load_model(path)[0]
        assert type(theirs).__module__.endswith("kimi_linear") and ckpt.args.kda_layers == [0]
        kinds = [type(layer.attention).__name__ for layer in ours.layers]
        assert kinds == ["KimiDeltaAttention", "NopeLatentAttention"]
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, name
        mine, ref = make_prompt_cache(ours), make_prompt_cache(theirs)
        for a, b in [(0, 8), (8, 9), (9, 12)]:
            got = ours(x[:, a:b], cache=mine) - theirs(x[:, a:b], cache=ref)
            assert mx.abs(got).max().item() <= ATOL, (name, a)
        prompt = x[0].tolist()
        assert _greedy(ours, prompt, 32) == _greedy_mlx_lm(theirs, prompt, 32), name
        shape = model_shape(ckpt)
        assert _held(mine) == kv_cache_bytes(shape, place(shape).ranks[0], tokens=12), name


def test_chat_second_turn_reuses_the_cache(models):
    """A chat's second turn prefills only what the first did not leave in the cache (the
    KDA states checkpointed, not rewound)."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.conversation.chat import Chat

    ckpt = open_checkpoint(models["kimi_linear"])
    chat = Chat(build_model(ckpt), load_tokenizer(ckpt), max_tokens=6)
    chat.send("hi there")
    chat.send("again")
    assert chat.last_stats.prompt_tokens > chat.last_stats.prefilled_tokens >= 1


def test_synthetic_kimi_is_mlx_lms(tmp_path):
    """`bench --synthetic kimi-*`: the tensors mlx-lm's own class holds, so that mlx-lm
    loads the same folder (float32 and 4-bit) and gives the same logits."""
    from mlx_lm.utils import load_model

    from llama_tp.benchmarks.synthetic import write_synthetic
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = mx.array(np.random.default_rng(0).integers(0, 512, (1, 12)), mx.int32)
    for spec in ("kimi-tiny-fp32", "kimi-tiny-q4"):
        path = write_synthetic(spec, tmp_path / spec)
        ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
        assert ours.args.model_type == "kimi_linear" and ours.args.kda_layers == [0, 1, 2]
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, spec


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
    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
    assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL


def test_convert_writes_what_mlx_lm_loads(models, tmp_path):
    """`convert` (float32, and 4-bit) writes a folder mlx-lm's own class loads (A_log as it
    holds it, its shared experts' names) with the logits llama_tp reads from it."""
    from mlx_lm.utils import load_model

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.convert import convert

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
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


def test_gguf_equals_the_folder(models, tmp_path):
    """llama.cpp's `kimi-linear` GGUF layout (`flagship_fixtures.gguf_kimi`: the convs
    (1, C, 1, K), ssm_a = -exp(A_log), k_b / v_b, a KV head count per layer): float32 gives
    the folder's logits and 32 greedy tokens; Q8_0 the next tokens of its own values
    dequantized, its logits within 0.05 (held as MLX 8-bit, its weights differ from the
    dequantized values by up to 2.4e-4, these logits by 0.011: measured)."""
    from flagship_gguf import gguf_kimi
    from test_sparse_attention import _greedy

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    src = models["kimi_linear"]
    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    folder = build_model(open_checkpoint(src))
    f32 = build_model(open_checkpoint(models["kimi_linear-gguf"]))
    assert mx.abs(f32(x) - folder(x)).max().item() <= ATOL
    assert _greedy(f32, x[0].tolist(), 32) == _greedy(folder, x[0].tolist(), 32)
    q8 = open_checkpoint(gguf_kimi(src, tmp_path / "q8.gguf", 8))
    assert q8.args.kda_layers == [0] and q8.args.kda_heads == 5
    values = gguf_kimi(src, tmp_path / "q8-values.gguf", 8, stored=False)
    got, want = build_model(q8)(x), build_model(open_checkpoint(values))(x)
    assert mx.abs(got - want).max().item() <= 0.05
    assert (got.argmax(-1) == want.argmax(-1)).all().item()
