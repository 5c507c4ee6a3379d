"""Gemma 3 and Gemma 4's own checks (issue 43): what the family test kit does not check
of every family (tests/test_families.py: one process against mlx-lm's own gemma3_text
and gemma4_text past the window, their caches, a chat's second turn, `bench
--synthetic`, llama.cpp's `gemma4` GGUF, the optional fields; tests/test_flagships.py:
the ranks): the scaled embedding on the folded path, the KV-shared layers' caches, the
refusals, `plan` of Gemma 4 31B, a release's multimodal folder, the fused expert rows of
the GGUF, Gemma 3's GGUF and Gemma 4's GGUF tokenizer."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import ROOT, run_python
from family_kit import ATOL, TOKENS, folders, greedy

NAMES = ("gemma4", "gemma3")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return folders(tmp_path_factory, NAMES)


def test_folded_embeddings_and_kv_shared_caches(models):
    """The scaled embedding also on the folded path (the embedding rows handed in, as the
    sampler's exchange hands them: the same logits, float32 and 4-bit, both families);
    Gemma 4's two KV-shared layers make no cache (4 caches for 6 layers)."""
    from mlx_lm.models.cache import make_prompt_cache

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = TOKENS[:, :12]
    for name in ("gemma4", "gemma4-q4", "gemma3"):
        ours = build_model(open_checkpoint(models[name]))
        folded = ours(x, input_embeddings=ours.tok_embeddings(x))
        assert mx.abs(folded - ours(x)).max().item() == 0.0, name
    assert len(make_prompt_cache(build_model(open_checkpoint(models["gemma4"])))) == 4


def _one_error(r, expected: str) -> None:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert errors[0] == f"error: {expected}", errors[0]
    assert r.returncode in (1, 2), r.stderr


def test_refusals_are_one_line(models, tmp_path):
    """A pipeline split that parts a KV-shared layer from its source, sequence parallelism
    over sliding windows, per-layer inputs of another vocabulary: one line each."""
    g4 = str(models["gemma4"])
    plan = ["-m", "llama_tp.plan", "-n", "2", "--pp", "2", "--pp-split", "4,2", "--model", g4]
    r = run_python(plan)
    _one_error(
        r,
        "--pp-split 4,2: a stage starting at layer 4 would part layer 4 from layer 3, whose "
        "keys and values it attends over",
    )
    args = ["--model", g4, "--prompt", "hi", "-m", "2", "--sequence-parallel"]
    _one_error(
        run_python(["-m", "llama_tp.generate", *args]),
        "--sequence-parallel does not take sliding-window layers (gpt-oss, Gemma)",
    )
    bad = tmp_path / "ple"
    shutil.copytree(models["gemma4"], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "vocab_size_per_layer_input": 300}))
    _one_error(
        run_python(["-m", "llama_tp.generate", "--model", str(bad), "--prompt", "hi"]),
        f"{bad / 'config.json'}: vocab_size_per_layer_input 300 differs from vocab_size 389: "
        "not supported",
    )


def test_plan_of_gemma_4_31b_config():
    """`plan` of Gemma 4 31B's config (mlx-community's 4-bit) on 3 Macs, the third
    smaller (--split 2:2:1): 32 query heads in 16 KV groups as 14/12/6, the global layers'
    4 KV heads the groups those need (shared where one straddles two ranks), 10 of 60
    layers caching every token."""
    config = ROOT / "docs" / "configs" / "gemma-4-31b-4bit" / "config.json"
    out = run_python(["-m", "llama_tp.plan", "-n", "3", "--split", "2:2:1", "--model", str(config)])
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"^[0-2] ", line)]
    assert [r[1:5] for r in rows] == [
        ["0-13", "[14]", "0-6", "[7]"],
        ["14-25", "[12]", "7-12", "[6]"],
        ["26-31", "[6]", "13-15", "[3]"],
    ]
    assert "50 of 60 layers slide over a window of 1024 tokens" in out.stdout


def test_multimodal_folder_reads_its_language_model(models, tmp_path):
    """A `gemma4` folder as Google publishes it: the `text_config`, the language model's
    tensors under `model.language_model.`, a vision tower left unread, and keys of the
    KV-shared layers (which attend over their sources') dropped as mlx-lm drops them."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    src, dst = models["gemma4"], tmp_path / "gemma4-release"
    shutil.copytree(src, dst)
    w = {
        k.replace("model.", "model.language_model.", 1): v
        for k, v in mx.load(str(src / "model.safetensors")).items()
    }
    w["model.vision_tower.encoder.weight"] = mx.zeros((4, 4))
    w["model.language_model.layers.5.self_attn.k_proj.weight"] = mx.zeros((64, 128))
    mx.save_safetensors(str(dst / "model.safetensors"), w)
    text = json.loads((src / "config.json").read_text())
    config = {"model_type": "gemma4", "text_config": text, "torch_dtype": "float32"}
    (dst / "config.json").write_text(json.dumps(config))
    x = mx.array([[5, 6, 7, 8, 9]])
    ckpt = open_checkpoint(dst)
    assert ckpt.args.model_type == "gemma4_text"
    ours = build_model(ckpt)(x)
    assert mx.abs(ours - build_model(open_checkpoint(src))(x)).max().item() == 0.0


def test_gguf_reads_the_fused_expert_rows_in_slices(models):
    """llama.cpp's `gemma4` layout stacks the experts' gate and up rows in
    ffn_gate_up_exps: each half read whole and sliced along any axis is that slice of the
    whole (the kit's GGUF check gives its logits)."""
    from llama_tp.checkpoints import open_checkpoint

    ckpt = open_checkpoint(models["gemma4-gguf"])
    for proj in ("gate_proj", "up_proj"):  # the fused rows' halves, sliced any way
        src_, stored = ckpt.sources[f"layers.1.experts.switch_mlp.{proj}.weight"]
        whole = src_.read(stored)
        assert whole.shape == (5, 128, 128)
        for axis, cut in (
            (0, (slice(1, 3),)),
            (1, (slice(None), slice(1, 3))),
            (2, (..., slice(1, 3))),
        ):
            assert mx.array_equal(src_.read(stored, axis, 1, 3), whole[cut]), (proj, axis)


def test_gemma3_gguf_equals_the_folder(models, tmp_path):
    """llama.cpp's `gemma3` GGUF layout (`flagship_gguf.gguf_gemma3`: every norm + 1, the
    layer types as flags per layer, both RoPE bases) of the folder with its queries scaled
    as llama.cpp scales them (query_pre_attn_scalar = head_dim, 32: the fixture's 24 has no
    GGUF): float32 gives the folder's logits and 32 greedy tokens; Q8_0 the next tokens of
    its own values dequantized, its logits within 0.05 (0.033, measured)."""
    from flagship_gguf import gguf_gemma3

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    src = tmp_path / "gemma3"
    shutil.copytree(models["gemma3"], src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "query_pre_attn_scalar": 32}))
    x = TOKENS[:, :12]
    folder = build_model(open_checkpoint(src))
    ckpt = open_checkpoint(gguf_gemma3(src, tmp_path / "gemma3.gguf"))
    assert ckpt.args.layer_types == open_checkpoint(src).args.layer_types
    f32 = build_model(ckpt)
    assert mx.abs(f32(x) - folder(x)).max().item() <= ATOL
    assert greedy(f32, x[0].tolist(), 32) == greedy(folder, x[0].tolist(), 32)
    q8 = open_checkpoint(gguf_gemma3(src, tmp_path / "q8.gguf", 8))
    values = gguf_gemma3(src, tmp_path / "q8-values.gguf", 8, stored=False)
    got, want = build_model(q8)(x), build_model(open_checkpoint(values))(x)
    assert mx.abs(got - want).max().item() <= 0.05
    assert (got.argmax(-1) == want.argmax(-1)).all().item()


def test_gguf_with_gemma4_tokenizer_chats(models, tmp_path):
    """A Gemma 4 GGUF whose tokenizer is llama.cpp's `gemma4` model, as released GGUFs
    carry (`flagship_gguf.gemma4_vocabulary`): a chat turn prefills the chat template's
    ids and replies with the folder's greedy tokens, decoded."""
    from flagship_gguf import gemma4_vocabulary, gguf_gemma4

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.conversation.chat import Chat

    path = gguf_gemma4(models["gemma4"], tmp_path / "tok.gguf", vocab=gemma4_vocabulary(389))
    ckpt = open_checkpoint(path)
    tok = load_tokenizer(ckpt)
    text = "Hello  world\n\n\nCa va? Déjà vu €"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    assert tok.decode(prompt) == f"<bos><|turn>user\n{text}<turn|>\n<|turn>model\n"
    assert prompt[:2] == tok.convert_tokens_to_ids(["<bos>", "<|turn>"])
    want = greedy(build_model(open_checkpoint(models["gemma4"])), prompt, 8)
    chat = Chat(build_model(ckpt), tok, max_tokens=8, temp=0.0)
    reply = chat.send(text)
    assert chat.last_stats.prompt_tokens == len(prompt)
    cut = next((i for i, t in enumerate(want) if t in tok.eos_token_ids), len(want))
    assert reply == tok.decode(want[:cut], skip_special_tokens=True)
