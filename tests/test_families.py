"""The family test kit (tests/family_kit.py) on every fixture of 2026's flagship families,
in one process, mlx-lm's own class on the same folder the oracle: Gemma 3 and 4,
DeepSeek-V3.2 and GLM-5, MiniMax-M2, Llama 4 (and llama4_text), Step-3.5, Kimi-Linear,
Nemotron-H (five Mamba groups and one), Kimi K3. Their ranks (2, 3, 4, --split 3:1,
tp2 x pp2, serve) are test_flagships.py's launches; what is a family's alone, its own
file's (test_gemma.py, test_sparse_attention.py, test_minimax.py, test_llama4.py,
test_step3p5.py, test_kimi.py, test_kimi_k3.py, test_nemotron_h.py)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from family_kit import (
    ATOL,
    FAMILIES,
    TOKENS,
    folders,
    greedy,
    greedy_mlx_lm,
    held_bytes,
    variants,
)

ROWS = list(FAMILIES.values())
IDS = list(FAMILIES)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return folders(tmp_path_factory)


@functools.cache
def _ours(path: Path) -> tuple[Any, Any, mx.array, list[int]]:
    """llama_tp's checkpoint and model of the folder at `path`, its logits of the prompt and
    its 32 greedy tokens after it: computed once for every test of the module."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    ckpt = open_checkpoint(path)
    model = build_model(ckpt)
    logits = model(TOKENS[:, :12])
    return ckpt, model, logits, greedy(model, TOKENS[0, :12].tolist(), 32)


@pytest.mark.parametrize("family", ROWS, ids=IDS)
def test_one_process_equals_mlx_lm(models, family):
    """Logits within 1e-4 of mlx-lm's model on the same folder (float32, and 4-bit where
    the row has it), whole and as a cached forward of the row's `steps` (a prefill, then
    single steps: past the windows, chunks and top-k), the same 32 greedy tokens; the
    caches mlx-lm's model makes (its classes, or its recurrent ones where they are),
    holding what `plan` says after the steps, their recurrent states too."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache
    from mlx_lm.utils import load_model

    from llama_tp.checkpoints.slices import model_shape
    from llama_tp.parallel.placement import kv_cache_bytes, place, state_bytes

    x = TOKENS[:, :12]
    for name in family.folders:
        ckpt, ours, logits, tokens = _ours(models[name])
        theirs = load_model(models[name])[0]
        assert type(theirs).__module__.split(".")[-1] == ckpt.args.model_type, name
        assert family.args_check(ckpt.args) and family.model_check(ours), name
        assert mx.abs(logits - theirs(x)).max().item() <= ATOL, name
        mine, ref = make_prompt_cache(ours), make_prompt_cache(theirs)
        if family.same_cache_classes:
            assert [type(c).__name__ for c in mine] == [type(c).__name__ for c in ref], name
        recurrent = [isinstance(c, ArraysCache) for c in mine]
        assert recurrent == [isinstance(c, ArraysCache) for c in ref], name
        for a, b in family.steps:
            got = ours(TOKENS[:, a:b], cache=mine) - theirs(TOKENS[:, a:b], cache=ref)
            assert mx.abs(got).max().item() <= ATOL, (name, a)
        assert tokens == greedy_mlx_lm(theirs, x[0].tolist(), 32), name
        held, state = held_bytes(mine)
        shape = model_shape(ckpt)
        rank = place(shape).ranks[0]
        assert held == kv_cache_bytes(shape, rank, tokens=family.steps[-1][1]), name
        assert state == state_bytes(shape, rank) and (state > 0) == any(recurrent), name


@pytest.mark.parametrize("family", [r for r in ROWS if r.chat], ids=lambda r: r.name)
def test_chat_second_turn_reuses_the_cache(models, family):
    """A chat's second turn prefills only what the first did not leave in the caches
    (recurrent states checkpointed, windows wrapped, a CacheList's parts rewound alike to
    the first turn's end)."""
    from mlx_lm.models.cache import CacheList

    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.conversation.chat import Chat

    max_tokens, first, second = family.chat
    ckpt, model, _, _ = _ours(models[family.name])
    chat = Chat(model, load_tokenizer(ckpt), max_tokens=max_tokens)
    chat.send(first)
    chat.send(second)
    assert chat.last_stats.prompt_tokens > chat.last_stats.prefilled_tokens >= 1
    for c in chat._cache:
        if isinstance(c, CacheList):
            assert len({part.offset for part in c.caches}) == 1


@pytest.mark.parametrize("family", [r for r in ROWS if r.synthetic], ids=lambda r: r.name)
def test_synthetic_spec_is_mlx_lms(tmp_path, family):
    """`bench --synthetic <family>-tiny-*`: the tensors mlx-lm's own class holds (float32
    and 4-bit), so that mlx-lm loads the same folder and gives the same logits."""
    from mlx_lm.utils import load_model

    from llama_tp.benchmarks.synthetic import write_synthetic
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    specs, check = family.synthetic
    x = mx.array(TOKENS.tolist())  # ids below the fixtures' 389 (the specs have 512)
    for spec in specs:
        path = write_synthetic(spec, tmp_path / spec)
        ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
        assert check(ours), spec
        assert mx.abs(ours(x[:, :12]) - theirs(x[:, :12])).max().item() <= ATOL, spec


@pytest.mark.parametrize("family", [r for r in ROWS if r.gguf], ids=lambda r: r.name)
def test_gguf_equals_the_folder(models, tmp_path, family):
    """llama.cpp's GGUF layout of the family (flagship_gguf.py: what convert_hf_to_gguf.py
    writes): float32 reads as the row says and gives the folder's logits and 32 greedy
    tokens; Q8_0 the next tokens of its own values dequantized (every position's, or the
    last's), its logits within 0.05."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    name, x = family.name, TOKENS[:, :12]
    want, _, logits, tokens = _ours(models[name])
    ckpt = open_checkpoint(models[f"{name}-gguf"])
    assert family.gguf_check(ckpt, want)
    f32 = build_model(ckpt)
    assert mx.abs(f32(x) - logits).max().item() <= ATOL
    assert greedy(f32, x[0].tolist(), 32) == tokens
    q8 = open_checkpoint(family.gguf(models[name], tmp_path / "q8.gguf", 8), **family.q8_open)
    assert family.gguf_check(q8, want)
    values = family.gguf(models[name], tmp_path / "q8-values.gguf", 8, stored=False)
    got, want = build_model(q8)(x), build_model(open_checkpoint(values))(x)
    assert mx.abs(got - want).max().item() <= 0.05
    if family.q8_last:
        got, want = got[0, -1], want[0, -1]
    assert (got.argmax(-1) == want.argmax(-1)).all().item()


@pytest.mark.parametrize("family", ROWS, ids=IDS)
def test_optional_fields_read_as_mlx_lm_reads_them(tmp_path, family):
    """The fixture's config with its optional fields left out, as mlx-lm's class takes it
    (family_kit.variants: the fields with a default value together, then each one whose
    default leaves a part of the model out): every such folder gives mlx-lm's logits, or
    is refused in one line where the row says why (GLM-5's, MiniMax's and Llama 4's
    classes take none of their fixture's fields left out: `varies` False, checked). A
    Kimi K3 folder without rms_norm_eps read the common 1e-6, not mlx-lm's kimi_k3 1e-5:
    another first token; Step-3.5's the same; Nemotron-H's norm_topk_prob on, not off."""
    from flagship_writers import save_mlx_lm

    from llama_tp.checkpoints import CheckpointError, open_checkpoint
    from llama_tp.checkpoints.build import build_model

    tried = variants(family)
    assert bool(tried) == family.varies, family.name
    for i, (label, config, theirs, logits) in enumerate(tried):
        path = save_mlx_lm(tmp_path / str(i), theirs, config, tokenizer=False)
        refusal = next((m for k, m in family.refused.items() if label == f"no {k}"), None)
        if refusal is not None:
            with pytest.raises(CheckpointError, match=refusal):
                open_checkpoint(path)
            continue
        ours = build_model(open_checkpoint(path))
        assert mx.abs(ours(TOKENS[:, :12]) - logits).max().item() <= ATOL, label


def test_every_fixture_has_its_folders(models):
    """The folders the kit's rows and the launches read: each fixture's float32 folder,
    the 4-bit copies, the float32 GGUF files and Kimi K3's release layout."""
    q4 = {"gemma4", "deepseek_v32", "minimax", "llama4", "step3p5", "kimi_linear"}
    q4 |= {"nemotron_h", "kimi_k3"}
    gguf = {"gemma4", "glm5", "minimax", "llama4", "step3p5", "kimi_linear", "nemotron_h"}
    gguf |= {"nemotron_g1", "kimi_k3"}
    assert set(models) == (
        set(FAMILIES) | {f"{n}-q4" for n in q4} | {f"{n}-gguf" for n in gguf} | {"kimi_k3-release"}
    )
