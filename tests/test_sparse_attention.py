"""DeepSeek-V3.2 and GLM-5 in one process (issue 43): mlx-lm's own deepseek_v32 and
glm_moe_dsa on the same folders are the oracle (`flagship_fixtures.py`: float32 and
mlx-lm's 4-bit convert). Each query attends to the indexer's top 4 keys, so the prompts
here (12 tokens, then 32 generated) are past it and the attention really is sparse. The
ranks (2, 3, 4, --split 3:1, tp2 x pp2, serve) are `test_flagships.py`'s launches, which
check every family at once."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT, run_python
from flagship_fixtures import flagship_models

ATOL = 1e-4
NAMES = ("deepseek_v32", "glm5")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return flagship_models(tmp_path_factory.mktemp("sparse"), NAMES)


def _greedy_mlx_lm(model, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda lp: lp.argmax(-1))
    return [int(t) for t, _ in steps]


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    from llama_tp.engine.generation import generate_step
    from llama_tp.engine.sampling import make_sampler

    return [int(t) for t, _ in generate_step(model, prompt, make_sampler(0.0), n)]


def test_one_process_equals_mlx_lm(models):
    """Logits within 1e-4 of mlx-lm's model on the same folder (float32 and 4-bit), whole
    and as a cached prefill then single steps (decoding gathers each query's top keys),
    the same 32 greedy tokens; the same caches as mlx-lm's (a CacheList of the latent and
    the indexer's keys), holding what `plan` says; and the indexer's choice matters (with
    a top-k past the prompt every key is attended: other logits)."""
    from mlx_lm.models.cache import CacheList, make_prompt_cache
    from mlx_lm.utils import load_model

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.slices import model_shape
    from llama_tp.parallel.placement import kv_cache_bytes, place

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    assert set(models) == {"deepseek_v32", "deepseek_v32-q4", "glm5", "glm5-gguf"}
    for name in ("deepseek_v32", "deepseek_v32-q4", "glm5"):
        path = models[name]
        ckpt = open_checkpoint(path)
        ours, theirs = build_model(ckpt), load_model(path)[0]
        assert type(theirs).__module__.endswith(ckpt.args.model_type)
        logits = ours(x)
        assert mx.abs(logits - theirs(x)).max().item() <= ATOL, name
        mine, ref = make_prompt_cache(ours), theirs.make_cache()
        assert [type(c).__name__ for c in mine] == [type(c).__name__ for c in ref], name
        for a, b in [(0, 8), (8, 9), (9, 10), (10, 12)]:
            got = ours(x[:, a:b], cache=mine) - theirs(x[:, a:b], cache=ref)
            assert mx.abs(got).max().item() <= ATOL, (name, a)
        prompt = x[0].tolist()
        assert _greedy(ours, prompt, 32) == _greedy_mlx_lm(theirs, prompt, 32), name
        layers = [p for c in mine for p in (c.caches if isinstance(c, CacheList) else [c])]
        held = sum(
            c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes for c in layers
        )
        shape = model_shape(ckpt)
        assert held == kv_cache_bytes(shape, place(shape).ranks[0], tokens=12), name
        for layer in ours.layers:
            layer.attention.indexer.index_topk = 12
        assert mx.abs(ours(x) - logits).max().item() > 1e-2, name


def test_chat_second_turn_reuses_the_cache(models):
    """A chat's second turn prefills only what the first did not leave in the caches (the
    latent's and the indexer's rewound alike to the first turn's end)."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.conversation.chat import Chat

    ckpt = open_checkpoint(models["deepseek_v32"])
    chat = Chat(build_model(ckpt), load_tokenizer(ckpt), max_tokens=6)
    chat.send("hi there")
    chat.send("again")
    assert chat.last_stats.prompt_tokens > chat.last_stats.prefilled_tokens >= 1
    offsets = {c.offset for layer in chat._cache for c in layer.caches}
    assert len(offsets) == 1


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


def test_synthetic_deepseek_v32_is_mlx_lms(tmp_path):
    """`bench --synthetic dsv32-*`: the tensors mlx-lm's own class holds, so that mlx-lm
    loads the same folder (float32 and 4-bit) and gives the same logits."""
    from mlx_lm.utils import load_model

    from llama_tp.benchmarks.synthetic import write_synthetic
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = mx.array(np.random.default_rng(0).integers(0, 512, (1, 12)), mx.int32)
    for spec in ("dsv32-tiny-fp32", "dsv32-tiny-q4"):
        path = write_synthetic(spec, tmp_path / spec)
        ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
        assert ours.args.model_type == "deepseek_v32" and ours.args.index_topk == 4
        assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, spec


def test_gguf_equals_the_folder(models, tmp_path):
    """llama.cpp's `glm-dsa` and `deepseek32` layouts (`flagship_gguf.gguf_sparse`:
    deepseek2's latent attention and experts plus blk.N.indexer.{attn_q_b,attn_k,k_norm,
    proj} and attention.indexer.*; DeepSeek-V3.2's YaRN as rope.scaling.*): float32 gives
    the folder's logits and 32 greedy tokens (the indexer's keys rotated on pairs in GLM-5,
    on halves in DeepSeek-V3.2, as llama.cpp rotates them); Q8_0 the next tokens of its own
    values dequantized, its logits within 0.05."""
    from flagship_gguf import gguf_sparse

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    dsv32 = gguf_sparse(models["deepseek_v32"], tmp_path / "dsv32.gguf")
    for name, path, interleave in (
        ("glm5", models["glm5-gguf"], True),
        ("deepseek_v32", dsv32, False),
    ):
        folder = build_model(open_checkpoint(models[name]))
        ckpt = open_checkpoint(path)
        assert ckpt.args.extra["indexer_rope_interleave"] is interleave, name
        assert ckpt.args.index_topk == 4 and ckpt.args.index_n_heads in (4, 5), name
        f32 = build_model(ckpt)
        assert mx.abs(f32(x) - folder(x)).max().item() <= ATOL, name
        assert _greedy(f32, x[0].tolist(), 32) == _greedy(folder, x[0].tolist(), 32), name
    src = models["glm5"]
    q8 = open_checkpoint(gguf_sparse(src, tmp_path / "q8.gguf", 8))
    values = gguf_sparse(src, tmp_path / "q8-values.gguf", 8, stored=False)
    got, want = build_model(q8)(x), build_model(open_checkpoint(values))(x)
    assert mx.abs(got - want).max().item() <= 0.05  # 0.0097 measured
    assert (got[0, -1].argmax() == want[0, -1].argmax()).item()


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
