"""The built-in SmolLM2-135M-Instruct (Q4_1 GGUF, 9 query / 3 KV heads) on 1..4 ranks."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import launch, run_python

PROMPT = "What is the capital of France?"
# Activations stay float32 (the GGUF's norms are F32; quantized weights dequantize into
# float32 products), so ranks differ from one process only in the order the all-reduce
# adds float32 partial sums: observed <= 1e-4 on logits of magnitude ~25 with MLX's
# kernel. The native kernels (the default on the CPU) round activations to int16 per 32
# values, which turns that reordering noise into an occasional flip of one rounding
# (1/32767 of a block's largest value): observed 0.0037 on 2-4 ranks. 0.01 leaves room
# for that and still catches any wrong head, column or bias (those move logits by >0.1).
LOGITS_ATOL = 0.01
# The native kernels (llama_tp.kernels) against MLX's quantized_matmul: int16 activations
# per 32 values move the logits by 0.009 (measured, 1 rank); 0.05 still catches a wrong
# block or scale (those move them by > 0.5).
KERNEL_ATOL = 0.05


def greedy_args(model, out, *flags: str) -> list[str]:
    return [
        "tests/mp_greedy.py",
        *flags,
        "--model",
        str(model),
        "--prompt",
        PROMPT,
        "--tokens",
        "16",
        "--out",
        str(out),
    ]


@pytest.fixture(scope="module")
def reference(default_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("greedy") / "n1.npz"
    r = run_python(greedy_args(default_gguf, out))
    assert r.returncode == 0, r.stderr
    return np.load(out)


@pytest.fixture(scope="module")
def mlx_reference(default_gguf, tmp_path_factory):
    """One process, everything as without llama_tp's native kernels."""
    out = tmp_path_factory.mktemp("greedy") / "mlx.npz"
    r = run_python(greedy_args(default_gguf, out, "--mlx-kernel"))
    assert r.returncode == 0, r.stderr
    return np.load(out)


def test_native_kernels_answer_as_mlx_does(reference, mlx_reference):
    assert reference["tokens"].tolist() == mlx_reference["tokens"].tolist()
    np.testing.assert_allclose(reference["logits"], mlx_reference["logits"], atol=KERNEL_ATOL)


def test_single_process_answers_paris(reference, default_gguf):
    from llama_tp import load

    _, tokenizer = load(default_gguf)
    assert "Paris" in tokenizer.decode(reference["tokens"].tolist())


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_match_single_process(reference, mlx_reference, default_gguf, tmp_path, n):
    """N ranks (native kernels, as by default on the CPU) = one process with them, and
    the same greedy text as without them (logits within KERNEL_ATOL). Uneven head
    splits and replicated KV heads (4 ranks of its 9/3 heads) are test_sharded's, on
    tiny models: 4 ranks of this one cost 70 s of CPU on 2 cores."""
    out = tmp_path / f"n{n}.npz"
    r = launch(n, greedy_args(default_gguf, out))
    assert out.exists(), r.stderr[-3000:]
    got = np.load(out)
    assert got["prompt"].tolist() == reference["prompt"].tolist()
    assert got["tokens"].tolist() == reference["tokens"].tolist()
    np.testing.assert_allclose(got["logits"], reference["logits"], atol=LOGITS_ATOL, rtol=0)
    assert got["tokens"].tolist() == mlx_reference["tokens"].tolist()
    np.testing.assert_allclose(got["logits"], mlx_reference["logits"], atol=KERNEL_ATOL, rtol=0)


def test_generate_command_two_ranks_prints_paris_once():
    args = ["-m", "llama_tp.generate", "--prompt", PROMPT, "--max-tokens", "16"]
    single = run_python(args)
    assert single.returncode == 0, single.stderr
    assert "Paris" in single.stdout
    r = launch(2, args)
    assert r.stdout == single.stdout, r.stderr[-2000:]
