"""`--dtype` / `load(..., dtype=)`: each rank dequantizes its own slices (the CPU fast path)."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import launch, run_python
from mlx.nn.layers.distributed import shard_linear
from mlx.utils import tree_flatten

from llama_tp.cluster.distributed import world
from llama_tp.parallel.cast import cast_model
from llama_tp.parallel.layers import shard_linear_range
from llama_tp.parallel.vocab import VocabParallelEmbedding


def _quantized_linear(din: int, dout: int, bias: bool) -> nn.QuantizedLinear:
    mx.random.seed(0)
    lin = nn.Linear(din, dout, bias=bias)
    return nn.QuantizedLinear.from_linear(lin, group_size=32, bits=4)


class Holder(nn.Module):
    """Every quantized layer kind llama_tp builds, on a group of one."""

    def __init__(self):
        super().__init__()
        group = world()
        q = _quantized_linear(64, 96, bias=True)
        self.plain = q
        self.even_rows = shard_linear(q, "all-to-sharded", group=group)
        self.even_cols = shard_linear(
            _quantized_linear(96, 64, False), "sharded-to-all", group=group
        )
        self.range_rows = shard_linear_range(q, "all-to-sharded", 0, 96, group)
        self.range_cols = shard_linear_range(
            _quantized_linear(96, 64, True), "sharded-to-all", 0, 96, group
        )
        table = nn.QuantizedEmbedding.from_embedding(nn.Embedding(50, 64), group_size=32, bits=8)
        self.embedding = table
        self.vocab = VocabParallelEmbedding(table, 0, 50, group)
        self.layers = [_quantized_linear(64, 64, False)]

    def __call__(self, x: mx.array, ids: mx.array) -> list[mx.array]:
        return [
            self.plain(x),
            self.even_rows(x),
            self.even_cols(self.plain(x)),
            self.range_rows(x),
            self.range_cols(self.plain(x)),
            self.embedding(ids),
            self.vocab(ids),
            self.vocab.as_linear(x),
            self.layers[0](x),
        ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_quantized_layer_has_a_float_twin(dtype):
    m = Holder()
    x = mx.random.normal((3, 64))
    ids = mx.array([0, 7, 49])
    before = m(x, ids)
    cast_model(m, dtype)
    after = m(x, ids)
    kinds = {type(v).__name__ for _, v in m.named_modules()}
    assert not any("Quantized" in k for k in kinds), kinds
    assert not m.vocab.quantized
    assert {v.dtype for _, v in tree_flatten(m.parameters())} == {getattr(mx, dtype)}
    tol = 1e-4 if dtype == "float32" else 5e-2
    for a, b in zip(before, after, strict=True):
        assert a.shape == b.shape
        err = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
        assert err <= tol * (1 + mx.abs(a).max().item()), err


def _text_and_head_bytes(r) -> tuple[str, list[float]]:
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr
    head = re.search(r"Embedding and head: (.*)", r.stderr).group(1)
    return r.stdout, [float(v) for v in re.findall(r"rank \d+ ([\d.]+) MB", head)]


# the built-in model asked one question, in float32 at load (`--dtype`)
FLOAT32 = ["-m", "llama_tp.generate", "--prompt", "Name a color.", "--max-tokens", "8"]
FLOAT32 += ["--dtype", "float32", "--verbose"]


@pytest.fixture(scope="module")
def float32_one(default_gguf):
    """One process's `FLOAT32` run (shared by the two tests that compare with it)."""
    return run_python(FLOAT32, timeout=300)


def test_float32_on_1_and_2_ranks_gives_one_text(float32_one):
    """The built-in Q4_1 model: 2 ranks split its 9/3 heads unevenly (range layers) and
    hold float32 slices. (Even splits in float: test_sharded's float models.)"""
    args = FLOAT32
    one, (head1,) = _text_and_head_bytes(float32_one)
    assert head1 == pytest.approx(49152 * 576 * 4 / 1e6, rel=0.01)  # float32, tied
    for n in (2,):
        text, heads = _text_and_head_bytes(launch(n, args, timeout=400))
        assert text == one, (n, text, one)
        assert sum(heads) == pytest.approx(head1, rel=0.01) and len(heads) == n


def test_bad_dtype_is_a_usage_error():
    r = run_python(["-m", "llama_tp.generate", "--dtype", "float8"], timeout=60)
    assert r.returncode == 2 and "invalid choice: 'float8'" in r.stderr


def test_convert_dtype_writes_the_same_float_model(float32_one, tmp_path):
    """`convert --dtype float32` of the Q4_1 GGUF = `--dtype float32` at load; mlx-lm loads it."""
    out = tmp_path / "f32"
    r = run_python(["-m", "llama_tp.convert", "--out", str(out), "--dtype", "float32"])
    assert r.returncode == 0, r.stderr
    import json

    assert "quantization" not in json.loads((out / "config.json").read_text())
    converted = run_python([*FLOAT32, "--model", str(out)])
    assert converted.returncode == 0 and float32_one.returncode == 0, converted.stderr
    assert converted.stdout == float32_one.stdout and converted.stdout.strip()
    from mlx_lm import load as mlx_lm_load

    model, _ = mlx_lm_load(str(out))
    dtypes = {v.dtype for _, v in tree_flatten(model.parameters())}
    assert dtypes == {mx.float32}, dtypes
    r = run_python(["-m", "llama_tp.convert", "--out", str(tmp_path / "x"), "-q", "4", "-d"])
    assert r.returncode == 2
    assert r.stderr.strip().endswith("--quantize and --dtype/--dequantize exclude each other")
