"""Kimi K3 in one process (issue 43): mlx-lm's own kimi_k3 on the same folders is the
oracle (`flagship_fixtures.py`: float32 and mlx-lm's 4-bit convert: fused KDA with a
lower-bounded decay and a full-rank gate, gated latent attention through q_lora_rank,
SiTU, latent experts normed after their sum, attention residuals over blocks of 2). The
ranks (2, 3, 4, --split 3:1, tp2 x pp2, serve) are `test_flagships.py`'s launches."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from flagship_fixtures import flagship_models
from test_kimi import _held

ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return flagship_models(tmp_path_factory.mktemp("kimi_k3"), ("kimi_k3",))


def test_one_process_equals_mlx_lm(models):
    """Logits within 1e-4 of mlx-lm's model on the same folder (float32 and 4-bit), whole
    and as a cached prefill then single steps, the same 32 greedy tokens, the caches (the
    latent per token, the fused KDA's two state arrays per sequence) holding what `plan`
    says."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    from test_sparse_attention import _greedy, _greedy_mlx_lm

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.slices import model_shape
    from llama_tp.parallel.placement import kv_cache_bytes, place

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    assert set(models) == {"kimi_k3", "kimi_k3-q4", "kimi_k3-release", "kimi_k3-gguf"}
    for name in ("kimi_k3", "kimi_k3-q4"):
        path = models[name]
        ckpt = open_checkpoint(path)
        ours, theirs = build_model(ckpt), load_model(path)[0]
        assert type(theirs).__module__.endswith("kimi_k3") and ckpt.args.kda_layers == [0, 2]
        kinds = [(type(x.attention).__name__, type(x.feed_forward).__name__) for x in ours.layers]
        assert kinds == [
            ("FusedKimiDeltaAttention", "SituFeedForward"),
            ("GatedLatentAttention", "LatentExperts"),
            ("FusedKimiDeltaAttention", "LatentExperts"),
        ]
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

    ckpt = open_checkpoint(models["kimi_k3"])
    chat = Chat(build_model(ckpt), load_tokenizer(ckpt), max_tokens=6)
    chat.send("hi there")
    chat.send("again")
    assert chat.last_stats.prompt_tokens > chat.last_stats.prefilled_tokens >= 1


def test_synthetic_kimi_k3_is_mlx_lms(tmp_path):
    """`bench --synthetic kimi-k3-*`: the tensors mlx-lm's own class holds (its residual
    queries kept float in the 4-bit copy, as mlx-lm's convert keeps them), so that mlx-lm
    loads the same folder and gives the same logits."""
    from mlx_lm.utils import load_model

    from llama_tp.benchmarks.synthetic import write_synthetic
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = mx.array(np.random.default_rng(0).integers(0, 512, (1, 12)), mx.int32)
    for spec in ("kimi-k3-tiny-fp32", "kimi-k3-tiny-q4"):
        path = write_synthetic(spec, tmp_path / spec)
        ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
        assert ours.args.model_type == "kimi_k3" and ours.args.kda_layers == [0, 1, 2]
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, spec


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
    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
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
    from flagship_fixtures import packed_k3
    from mlx_lm.utils import load_model
    from test_sparse_attention import _greedy

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
    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    assert mx.abs(ours(x) - values(x)).max().item() <= ATOL
    assert mx.abs(ours(x) - load_model(packed)[0](x)).max().item() <= ATOL
    assert _greedy(ours, x[0].tolist(), 32) == _greedy(values, x[0].tolist(), 32)
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


def test_gguf_equals_the_folder(models, tmp_path):
    """llama.cpp's `kimi-k3` layout (`flagship_gguf.gguf_k3`: Kimi-Linear's convs and
    ssm_a, q/k/v apart, ssm_g and attn_gate, the residual queries' norm * proj fused,
    ffn_routed_*): float32 gives the folder's logits and 32 greedy tokens; Q8_0 the next
    tokens of its own values dequantized, its logits within 0.05; MXFP4 experts (what the
    converter writes from the release's packed ones), held as stored, its own values'
    logits (6.4e-6 apart, measured)."""
    from flagship_gguf import gguf_k3
    from test_sparse_attention import _greedy

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    src = models["kimi_k3"]
    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    folder = build_model(open_checkpoint(src))
    ckpt = open_checkpoint(models["kimi_k3-gguf"])
    a = ckpt.args
    assert (a.kda_layers, a.kda_heads, a.routed_expert_hidden_size) == ([0, 2], 5, 32)
    assert a.mla_output_gate and a.latent_moe_norm and a.attn_res_block_size == 2
    f32 = build_model(ckpt)
    assert mx.abs(f32(x) - folder(x)).max().item() <= ATOL
    assert _greedy(f32, x[0].tolist(), 32) == _greedy(folder, x[0].tolist(), 32)
    q8 = open_checkpoint(gguf_k3(src, tmp_path / "q8.gguf", 8))
    values = gguf_k3(src, tmp_path / "q8-values.gguf", 8, stored=False)
    got, want = build_model(q8)(x), build_model(open_checkpoint(values))(x)
    assert mx.abs(got - want).max().item() <= 0.05
    assert (got[0, -1].argmax() == want[0, -1].argmax()).item()
    mxfp4 = open_checkpoint(gguf_k3(src, tmp_path / "mxfp4.gguf", 39, experts=True))
    assert any(n.startswith("MXFP4 ") for n in mxfp4.notes)
    values = gguf_k3(src, tmp_path / "mxfp4-values.gguf", 39, stored=False, experts=True)
    got, want = build_model(mxfp4)(x), build_model(open_checkpoint(values))(x)
    assert mx.abs(got - want).max().item() <= ATOL
