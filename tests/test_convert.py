"""`python -m llama_tp.convert`: the built-in GGUF as a directory that mlx-lm and llama_tp load."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import run_python

from llama_tp.checkpoints.convert import convert_gguf
from llama_tp.checkpoints.hf_config import hf_name
from llama_tp.checkpoints.tokenizer import encode_prompt
from llama_tp.engine.generation import generate_step
from llama_tp.loading.loader import load

PROMPT = "What is the capital of France?"
N_TOKENS = 32  # exactly this many greedy steps in every implementation, EOS or not
TEXTS = ["Hello world", "héllo wörld, naïve café: 日本語 🙂", "  two spaces\n\ttab 12345", ""]


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@pytest.fixture(scope="module")
def converted(default_gguf, tmp_path_factory) -> Path:
    return convert_gguf(
        default_gguf, tmp_path_factory.mktemp("convert") / "smollm2", progress=False
    )


@pytest.fixture(scope="module")
def gguf_model(default_gguf):
    return load(default_gguf)


@pytest.fixture(scope="module")
def prompt_ids(gguf_model) -> list[int]:
    return encode_prompt(gguf_model[1], PROMPT)


@pytest.fixture(scope="module")
def mlx_lm_tokens(converted, prompt_ids) -> list[int]:
    """mlx-lm's own loader and generation loop on the converted directory."""
    import mlx_lm
    from mlx_lm.generate import generate_step as mlx_lm_generate_step

    model, _ = mlx_lm.load(str(converted))
    steps = mlx_lm_generate_step(mx.array(prompt_ids), model, max_tokens=N_TOKENS)
    return [int(token) for token, _ in steps]


def llama_tp_tokens(model, prompt_ids: list[int]) -> list[int]:
    return [token for token, _ in generate_step(model, prompt_ids, greedy, N_TOKENS)]


def test_mlx_lm_generates_paris(mlx_lm_tokens, gguf_model):
    assert len(mlx_lm_tokens) == N_TOKENS
    assert "Paris" in gguf_model[1].decode(mlx_lm_tokens)


def test_llama_tp_on_converted_equals_mlx_lm(converted, prompt_ids, mlx_lm_tokens):
    model, tokenizer = load(converted)
    assert encode_prompt(tokenizer, PROMPT) == prompt_ids
    assert llama_tp_tokens(model, prompt_ids) == mlx_lm_tokens


def test_llama_tp_on_gguf_equals_mlx_lm(gguf_model, prompt_ids, mlx_lm_tokens):
    assert llama_tp_tokens(gguf_model[0], prompt_ids) == mlx_lm_tokens


def test_config(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True
    assert (config["rms_norm_eps"], config["rope_theta"]) == (1e-5, 100000.0)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    quant = config["quantization"]
    assert {k: quant[k] for k in ("group_size", "bits", "mode")} == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
    }
    # Q8_0 embedding among Q4_1 layers: the only override.
    assert {k: v for k, v in quant.items() if isinstance(v, dict)} == {
        "model.embed_tokens": {"group_size": 32, "bits": 8}
    }
    assert config["quantization_config"] == quant


def test_weights_have_hf_names(converted):
    weights, metadata = mx.load(str(converted / "model.safetensors"), return_metadata=True)
    assert metadata == {"format": "mlx"}
    assert len(weights) == 694
    for suffix in ("weight", "scales", "biases"):
        assert f"model.layers.29.mlp.down_proj.{suffix}" in weights
    assert weights["model.embed_tokens.weight"].dtype == mx.uint32
    assert "lm_head.weight" not in weights  # tied
    assert not list(converted.glob("*.index.json"))


def test_hf_name_inverts_reader():
    assert hf_name("tok_embeddings.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("layers.12.attention.wk.scales") == "model.layers.12.self_attn.k_proj.scales"
    assert hf_name("layers.3.feed_forward.w1.biases") == "model.layers.3.mlp.gate_proj.biases"
    assert hf_name("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="no Hugging Face name"):
        hf_name("rope_freqs.weight")


def test_tokenizer_files(converted, gguf_model):
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tokenizers import Tokenizer

    gguf_tok = gguf_model[1]
    raw = Tokenizer.from_file(str(converted / "tokenizer.json"))
    tok = load_tokenizer(converted)
    assert isinstance(tok.detokenizer, BPEStreamingDetokenizer)
    for text in TEXTS:
        ids = gguf_tok.encode(text)
        assert raw.encode(text).ids == ids, text
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text
    config = json.loads((converted / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    messages = [{"role": "user", "content": PROMPT}]
    assert list(tok.apply_chat_template(messages, add_generation_prompt=True)) == encode_prompt(
        gguf_tok, PROMPT
    )


def test_cli_refuses_non_empty_out(default_gguf, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    r = run_python(["-m", "llama_tp.convert", "--model", str(default_gguf), "--out", str(tmp_path)])
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert "--force" in r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_cli_rejects_non_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    r = run_python(["-m", "llama_tp.convert", "--model", str(bad), "--out", str(tmp_path / "o")])
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert str(bad) in r.stderr
    assert not (tmp_path / "o").exists()


def test_cli_force_replaces_stale_shards(default_gguf, tmp_path):
    stale = tmp_path / "model-00001-of-00002.safetensors"
    stale.write_bytes(b"old")
    r = run_python(
        ["-m", "llama_tp.convert", "--model", str(default_gguf), "--out", str(tmp_path), "--force"]
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"wrote {tmp_path} (694 tensors, 98.3 MB)"
    assert not stale.exists()
    assert (tmp_path / "model.safetensors").is_file()
