"""Range-sharded linear layers, checked in one process (size-1 group) by
emulating the ranks of a partition, plus a real multi-rank run via mlx.launch."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import _PORTS
from mlx import nn

from llama_tp import kernels
from llama_tp.cluster.distributed import world
from llama_tp.parallel.layers import (
    QuantizedRangeAllToShardedLinear,
    QuantizedRangeShardedToAllLinear,
    RangeAllToShardedLinear,
    RangeShardedToAllLinear,
    shard_linear_range,
)
from llama_tp.parallel.partition import make_plan

REPO = Path(__file__).resolve().parents[1]
QUANT = [(gs, bits) for gs in (32, 64) for bits in (4, 8)]


@pytest.fixture(scope="module")
def group() -> mx.distributed.Group:
    return world()  # a singleton group: all_sum is the identity


def _linear(in_dims: int, out_dims: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    mx.random.seed(seed)
    lin = nn.Linear(in_dims, out_dims, bias=bias)
    if bias:  # nn.Linear's bias is small; make a wrong bias count obvious
        lin.bias = mx.random.normal((out_dims,))
    return lin


def _x(dims: int) -> mx.array:
    return mx.random.normal((2, 3, dims), key=mx.random.key(7))


def _ranges(total: int, n: int, unit: int | None = None) -> list[range]:
    """An uneven partition of range(total), taken from the plan's ffn split."""
    return [p.ffn for p in make_plan(n, n, 1, 1, total, n, group_size=unit).parts]


def _rows_concat(layer: nn.Module, x: mx.array, parts: list[range], group) -> mx.array:
    outs = [shard_linear_range(layer, "all-to-sharded", r.start, r.stop, group)(x) for r in parts]
    return mx.concatenate(outs, axis=-1)


def _columns_sum(layer: nn.Module, x: mx.array, parts: list[range], group) -> mx.array:
    """What the ranks compute together: sum of partial products, plus the bias once.

    With a size-1 group each emulated rank's output is its partial + bias, so
    subtracting the bias from each and adding it back once checks that the
    layer adds it exactly once."""
    bias = layer["bias"] if "bias" in layer else 0.0
    total = 0.0
    for r in parts:
        sl = shard_linear_range(layer, "sharded-to-all", r.start, r.stop, group)
        total = total + (sl(x[..., r.start : r.stop]) - bias)
    return total + bias


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_all_to_sharded_fp32(group, n: int, bias: bool) -> None:
    lin = _linear(48, 37, bias)
    parts = _ranges(37, n)
    sl = shard_linear_range(lin, "all-to-sharded", parts[-1].start, parts[-1].stop, group)
    assert isinstance(sl, RangeAllToShardedLinear)
    assert sl.weight.shape == (len(parts[-1]), 48)
    assert ("bias" in sl) == bias
    x = _x(48)
    assert mx.allclose(_rows_concat(lin, x, parts, group), lin(x), atol=1e-5).item()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_sharded_to_all_fp32(group, n: int, bias: bool) -> None:
    lin = _linear(37, 24, bias)
    parts = _ranges(37, n)
    sl = shard_linear_range(lin, "sharded-to-all", parts[0].start, parts[0].stop, group)
    assert isinstance(sl, RangeShardedToAllLinear)
    assert sl.weight.shape == (24, len(parts[0]))
    x = _x(37)
    assert mx.allclose(_columns_sum(lin, x, parts, group), lin(x), atol=1e-4).item()


def test_sharded_to_all_adds_bias_once(group) -> None:
    lin = _linear(37, 24)
    sl = shard_linear_range(lin, "sharded-to-all", 10, 20, group)
    x = _x(10)
    expected = x @ lin.weight[:, 10:20].T + lin.bias
    assert mx.allclose(sl(x), expected, atol=1e-5).item()


@pytest.mark.parametrize("gs,bits", QUANT)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_all_to_sharded_quantized_exact(group, n: int, gs: int, bits: int) -> None:
    q = nn.QuantizedLinear.from_linear(_linear(128, 45), gs, bits)
    parts = _ranges(45, n)  # rows need no group alignment
    sl = shard_linear_range(q, "all-to-sharded", parts[0].start, parts[0].stop, group)
    assert isinstance(sl, QuantizedRangeAllToShardedLinear)
    rows = len(parts[0])
    assert sl.weight.shape == (rows, 128 * bits // 32)
    assert sl.scales.shape == sl.biases.shape == (rows, 128 // gs)
    x = _x(128)
    # Slicing rows does not change the quantization: bit-for-bit equal, with MLX's kernel
    # and with the native ones (llama_tp.kernels, which the range layers call on the CPU)
    for path in (kernels.off, contextlib.nullcontext):
        with path():
            whole = kernels.quantized_matmul(x, q.weight, q.scales, q.biases, True, gs, bits)
            assert mx.array_equal(_rows_concat(q, x, parts, group), whole + q.bias).item()


@pytest.mark.parametrize("gs,bits", QUANT)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_sharded_to_all_quantized(group, n: int, gs: int, bits: int) -> None:
    hidden = 7 * gs  # 7 groups: uneven for n = 2, 3
    q = nn.QuantizedLinear.from_linear(_linear(hidden, 40), gs, bits)
    parts = _ranges(hidden, n, gs)
    r = parts[-1]
    sl = shard_linear_range(q, "sharded-to-all", r.start, r.stop, group)
    assert isinstance(sl, QuantizedRangeShardedToAllLinear)
    assert sl.weight.shape == (40, len(r) * bits // 32)
    assert sl.scales.shape == sl.biases.shape == (40, len(r) // gs)
    assert sl.bias.shape == (40,)
    x = _x(hidden)
    assert mx.allclose(_columns_sum(q, x, parts, group), q(x), atol=1e-4).item()


@pytest.mark.parametrize("start,stop", [(16, 64), (0, 48), (32, 100)])
def test_quantized_misaligned_columns_raise(group, start: int, stop: int) -> None:
    q = nn.QuantizedLinear.from_linear(_linear(128, 8), 32, 4)
    with pytest.raises(ValueError, match=rf"\[{start}, {stop}\).*group_size 32"):
        shard_linear_range(q, "sharded-to-all", start, stop, group)


def test_bad_arguments(group) -> None:
    lin = _linear(16, 8)
    with pytest.raises(ValueError, match="sharding"):
        shard_linear_range(lin, "rows", 0, 4, group)
    with pytest.raises(ValueError, match=r"\[4, 4\).*size 8"):
        shard_linear_range(lin, "all-to-sharded", 4, 4, group)
    with pytest.raises(ValueError, match=r"\[0, 17\).*size 16"):
        shard_linear_range(lin, "sharded-to-all", 0, 17, group)
    with pytest.raises(TypeError, match="Embedding"):
        shard_linear_range(nn.Embedding(10, 8), "all-to-sharded", 0, 4, group)


def test_quantized_params_frozen(group) -> None:
    q = nn.QuantizedLinear.from_linear(_linear(64, 16), 32, 4)
    for sharding in ("all-to-sharded", "sharded-to-all"):
        sl = shard_linear_range(q, sharding, 0, 32 if sharding == "sharded-to-all" else 8, group)
        assert sl.trainable_parameters() == {}
        sl.unfreeze()
        assert sl.trainable_parameters() == {}
        assert set(sl.parameters()) == {"weight", "scales", "biases", "bias"}


def test_fp32_params_trainable(group) -> None:
    sl = shard_linear_range(_linear(16, 8), "all-to-sharded", 2, 5, group)
    assert set(sl.trainable_parameters()) == {"weight", "bias"}


def test_evaluating_keeps_only_the_slice(group) -> None:
    """mx.eval(layer.parameters()) must not keep the unsharded weight alive."""
    gc.collect()
    before = mx.get_active_memory()
    lin = nn.Linear(1024, 1024, bias=False)  # 4 MiB
    sl = shard_linear_range(lin, "all-to-sharded", 0, 16, group)  # 64 KiB
    sc = shard_linear_range(lin, "sharded-to-all", 0, 16, group)
    mx.eval(sl.parameters(), sc.parameters())
    del lin
    gc.collect()
    assert mx.get_active_memory() - before < 1 << 20
    assert sl.weight.shape == (16, 1024) and sc.weight.shape == (1024, 16)


@pytest.mark.parametrize("n", [2, 3])
def test_multi_rank(n: int) -> None:
    launcher = str(Path(sys.executable).parent / "mlx.launch")
    cmd = [launcher, "-n", str(n), "--starting-port", str(next(_PORTS)), sys.executable]
    cmd.append("tests/mp_layers_check.py")
    # mlx.launch exits 0 even when a rank fails, so check the output too.
    res = subprocess.run(
        cmd,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    msg = f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert res.returncode == 0, msg
    assert res.stdout.split() == ["OK"], msg
    assert "exited with code" not in res.stderr and "killed" not in res.stderr, msg
