"""The native CPU kernels (llama_tp/kernels): against MLX's quantized_matmul (MLX affine),
gguf-py's dequantization (GGUF blocks), their scalar twins (every SIMD kernel, arm64's
under qemu-user), and the fallback when the extension cannot be built.

Bounds: the kernels quantize each activation row to int16 per 32 values (scale
max|x| / 32767), so a product differs from float arithmetic by at most ~1e-4 of its
largest output on these random rows (measured 2-3e-5); float32 sums in another order
give the rest. `KERNEL_RTOL` states that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT, requires, run_python

from llama_tp import kernels
from llama_tp.kernels import GGUF_TYPES, build, native
from llama_tp.kernels.blocks import random_blocks

KERNEL_RTOL = 2e-4  # max |kernel - reference| / max |reference|, per product


@pytest.fixture(scope="module")
def ext():
    st = kernels.status()
    assert st.native, f"the native kernels must be built here (make kernels): {st.reason}"
    return native.ext()


def _rel(got: mx.array, ref: np.ndarray) -> float:
    got = np.array(got.astype(mx.float32), dtype=np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def test_every_simd_kernel_matches_its_scalar_twin(ext):
    report, ok = ext.selftest(1e-5)
    isas = {line.split()[0] for line in report.splitlines()}
    assert ok, report
    assert isas == {i for i, runs in ext.compiled_isas() if runs and i != "scalar"}, report


@requires("arm64-cross")
def test_neon_kernels_match_the_scalar_ones_under_qemu(tmp_path):
    """The arm64 kernels, cross-compiled and run under qemu-user (.ci/run installs both)."""
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    src = ROOT / "llama_tp" / "kernels" / "src"
    files = [
        "qmv_scalar",
        "qmv_neon",
        "dispatch",
        "pool",
        "profile",
        "matmul",
        "selftest",
        "selftest_main",
    ]
    # compiled once per version of the sources (cross-compiling takes most of the time)
    exe = build.cache_root() / f"aarch64-selftest-{build.build_key().rsplit('-', 1)[1]}"
    if not exe.is_file():
        exe.parent.mkdir(parents=True, exist_ok=True)
        cmd = [cxx, "-O1", "-std=c++17", "-static", "-DLT_HAVE_NEON", "-o", str(tmp_path / "t")]
        subprocess.run(cmd + [str(src / f"{f}.cpp") for f in files] + ["-lpthread"], check=True)
        shutil.move(tmp_path / "t", exe)
    r = subprocess.run([qemu, str(exe), "1e-5"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.endswith("ok\n"), r.stdout + r.stderr
    assert r.stdout.count("neon ") == 12, r.stdout  # every format


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_affine_matches_mx_quantized_matmul(bits, group_size):
    rng = np.random.default_rng(bits * group_size)
    k = group_size * 5
    w = mx.array(rng.normal(size=(70, k)).astype(np.float32))  # 70 rows: not a chunk multiple
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    for batch in (1, 3, 8):
        for dtype in (mx.float32, mx.float16, mx.bfloat16):
            x = mx.array(rng.normal(size=(batch, k)).astype(np.float32))
            x[0, 3] = 30.0  # an outlier, as activations have
            args = (x.astype(dtype), wq, s.astype(dtype), b.astype(dtype))
            got = kernels.quantized_matmul(*args, group_size=group_size, bits=bits)
            assert got.dtype == dtype and got.shape == (batch, 70)
            # float32 arithmetic over the same (16-bit) inputs; the bounds for 16-bit outputs
            # are their rounding (MLX's own kernel is 15x further off: 3e-3 and 2.6e-2)
            x32, s32, b32 = (args[i].astype(mx.float32) for i in (0, 2, 3))
            exact = mx.quantized_matmul(x32, wq, s32, b32, group_size=group_size, bits=bits)
            exact = np.array(exact, dtype=np.float64)
            bound = {mx.float32: KERNEL_RTOL, mx.float16: 1e-3, mx.bfloat16: 8e-3}[dtype]
            assert _rel(got, exact) <= bound, (batch, dtype, _rel(got, exact))


def _gguf_py(raw: np.ndarray, type_name: str) -> np.ndarray:
    import gguf

    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return values.astype(np.float64)


@pytest.fixture
def threads(ext):
    """3 threads for the test (rows split over the pool), then as before."""
    before = ext.threads()
    ext.set_threads(3)
    yield 3
    ext.set_threads(before)


@pytest.mark.parametrize("type_name", list(GGUF_TYPES))
def test_gguf_blocks_match_gguf_py(ext, threads, type_name):
    """Rows and column slices (starting inside a block) of random blocks of every type,
    split over 3 threads: the product against gguf-py's dequantization in float64, and the
    dequantization."""
    rng = np.random.default_rng(GGUF_TYPES[type_name][0])
    _, per, size = GGUF_TYPES[type_name]
    raw = random_blocks(type_name, 37, 3, rng)
    dense = _gguf_py(raw, type_name)  # (37, 3 * per)
    w = mx.array(raw)
    got = kernels.gguf_dequantize(w, type_name, 0, 3 * per, mx.float32)
    np.testing.assert_allclose(np.array(got), dense, rtol=1e-6, atol=1e-7)
    lead = per // 2 + 3  # columns [lead, stop) of the blocks: a slice starting mid-block
    for batch in (1, 2, 5, 8):
        x = rng.normal(size=(batch, 3 * per - lead - 5)).astype(np.float32)
        x[0, 1] = 25.0
        ref = x.astype(np.float64) @ dense[:, lead : lead + x.shape[1]].T
        assert _rel(kernels.gguf_matmul(mx.array(x), w, type_name, lead), ref) <= KERNEL_RTOL
        rows = slice(11, 30)  # a row slice starting mid-tensor
        got = kernels.gguf_matmul(mx.array(x), w[rows], type_name, lead)
        assert _rel(got, ref[:, rows]) <= KERNEL_RTOL


def test_a_build_for_another_mlx_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_TP_KERNELS_CACHE", str(tmp_path))
    d = build.build_dir()
    d.mkdir(parents=True)
    (d / "_ext.so").write_bytes(b"")
    (d / "built.json").write_text(json.dumps({"ok": True, "module": "_ext.so", "mlx": "0.1.0"}))
    assert build.built_module() == (None, f"built against MLX 0.1.0, running {mx.__version__}")


def test_without_a_compiler_generation_falls_back_with_one_warning(tmp_path):
    """The extension made unavailable (an empty cache, no compiler): the build fails with
    its reason, recorded; generation warns once and computes what MLX's kernel computes
    (LLAMA_TP_KERNELS=mlx: the same path, chosen, so without the warning)."""
    args = ["-m", "llama_tp.generate", "--model", str(ROOT / "tests/data/llamacpp-Q4_K_M.gguf")]
    args += ["--prompt", "hello", "--max-tokens", "8", "--verbose"]

    def run(**env):
        env = {**os.environ, "LLAMA_TP_KERNELS_CACHE": str(tmp_path), **env}
        r = subprocess.run(
            [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return r

    r = run(CXX="/nonexistent/c++")
    warning = "warning: quantized matrix products use MLX's slower kernel: no C++ compiler"
    assert r.stderr.count(warning) == 1, r.stderr
    assert "Matrix products: MLX's quantized_matmul (no C++ compiler" in r.stderr
    assert "Q4_K -> MLX 4-bit, group 32 (exact)" in r.stderr  # converted, as before
    record = json.loads(next(tmp_path.glob("*/built.json")).read_text())
    assert not record["ok"] and record["reason"].startswith("no C++ compiler")
    chosen = run(LLAMA_TP_KERNELS="mlx")
    assert "warning" not in chosen.stderr
    assert "Matrix products: MLX's quantized_matmul (LLAMA_TP_KERNELS=mlx)" in chosen.stderr
    assert chosen.stdout == r.stdout


def test_kernels_command_reports_the_path():
    r = run_python(["-m", "llama_tp.kernels", "status"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("quantized products on the CPU: native kernels (")


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_rope_and_attention_match_mlx(ext, dtype):
    """The native RoPE and attention (one primitive each) against MLX's composed ones:
    traditional and half-split RoPE; attention of 1 and 5 queries (causal, aligned to the
    last keys) over strided KV-cache views, grouped heads."""
    from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention

    from llama_tp.kernels.layers import RoPE

    rng = np.random.default_rng(0)
    tol = {mx.float32: 1e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype]
    x = mx.array(rng.normal(size=(2, 9, 3, 64)).astype(np.float32)).astype(dtype)
    for traditional in (True, False):
        rope = RoPE(64, traditional=traditional, base=100000)
        ref = mx.fast.rope(x, 64, traditional=traditional, base=100000, scale=1.0, offset=37)
        assert mx.allclose(rope(x, offset=37), ref, atol=tol).item()
    cache = mx.array(rng.normal(size=(1, 3, 80, 64)).astype(np.float32)).astype(dtype)
    k, v = cache[:, :, :50], cache[:, :, 20:70]  # views into a larger buffer
    for queries, mask in ((1, None), (5, "causal")):
        q = mx.array(rng.normal(size=(1, 9, queries, 64)).astype(np.float32)).astype(dtype)
        got = kernels.scaled_dot_product_attention(q, k, v, None, 0.125, mask)
        ref = mlx_lm_attention(q, k, v, None, scale=0.125, mask=mask)
        assert mx.allclose(got, ref, atol=tol).item(), (queries, mask)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_fused_layer_operations_equal_the_operations_apart(ext, dtype):
    """The decode step's fused operations (issue 41) against what they replace: the heads
    split and q, k rotated in one operation = split then the native RoPE (an int, one
    array, one position per row); SwiGLU of a fused gate/up output = MLX's
    nn.silu(gate) * up (float32: to the bit, MLX's exp and sigmoid reproduced); attention
    written as (B, L, H * D) = its (B, H, L, D) output transposed; a residual sum and the
    next RMSNorm in one = the add, then the native RMSNorm."""
    import mlx.nn as nn

    from llama_tp.kernels.layers import RMSNorm, RoPE

    rng = np.random.default_rng(1)
    tol = {mx.float32: 0, mx.float16: 1e-3, mx.bfloat16: 8e-3}[dtype]
    B, L, nq, nk, d = 3, 2, 5, 1, 32
    y = mx.array(rng.normal(size=(B, L, (nq + 2 * nk) * d)).astype(np.float32)).astype(dtype)
    q0, k0, v0 = ext.split_heads(y, nq, nk, nk, d)
    for traditional in (True, False):
        rope = RoPE(24, traditional=traditional, base=10000.0, scale=0.5)
        kw = dict(rope_dims=24, traditional=traditional, base=10000.0, scale=0.5)
        for offset in (7, mx.array([7], mx.int32), mx.array([0, 5, 11], mx.int32)):
            pos = dict(offset=offset) if isinstance(offset, int) else dict(offsets=offset)
            q, k, v = ext.split_heads(y, nq, nk, nk, d, **kw, **pos)
            assert mx.array_equal(q, rope(q0, offset=offset)).item()
            assert mx.array_equal(k, rope(k0, offset=offset)).item()
            assert mx.array_equal(v, v0).item()

    gu = mx.array(rng.normal(size=(B, L, 2 * 48)).astype(np.float32) * 4).astype(dtype)
    ref = nn.silu(gu[..., :48]) * gu[..., 48:]
    got = ext.swiglu(gu)
    assert got.shape == (B, L, 48) and got.dtype == dtype
    assert mx.allclose(got, ref, rtol=tol, atol=tol).item()
    if dtype == mx.float32:
        assert mx.array_equal(got, ref).item()

    kv = mx.array(rng.normal(size=(B, nk, 9, d)).astype(np.float32)).astype(dtype)
    ranges = mx.array([[0, 9], [2, 9], [4, 8]], mx.int32)
    for causal in (False, True):
        apart = ext.attention(q, kv, kv, scale=0.2, causal=causal, ranges=ranges)
        merged = ext.attention(q, kv, kv, scale=0.2, causal=causal, ranges=ranges, merged=True)
        assert mx.array_equal(merged, apart.transpose(0, 2, 1, 3).reshape(B, L, -1)).item()

    norm = RMSNorm(64, eps=1e-5)
    norm.weight = mx.array(rng.normal(size=(64,)).astype(np.float32)).astype(dtype)
    x, r = (mx.array(rng.normal(size=(B, L, 64)).astype(np.float32)).astype(dtype) for _ in "xr")
    h, n = ext.add_rms_norm(x, r, norm.weight, eps=1e-5)
    assert mx.array_equal(h, x + r).item() and mx.array_equal(n, norm(x + r)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_products_ending_in_their_next_operation_equal_the_two(ext, dtype):
    """A quantized product that ends in SwiGLU, in the heads' split with q and k
    rotated, or in the residual sum and the next RMSNorm (one primitive each in the
    decode step), gives to the bit what the product followed by the separate operation
    gives: GGUF Q4_K and MLX 4-bit weights, a decode row and a few positions, positions
    per row; its inputs are checked."""
    rng = np.random.default_rng(2)
    k, nq, nk, d = 256, 3, 1, 16
    w = rng.normal(size=((nq + 2 * nk) * d, k)).astype(np.float32)
    wq, sc, bi = mx.quantize(mx.array(w), group_size=64, bits=4)
    affine = dict(w=wq, scales=sc.astype(dtype), biases=bi.astype(dtype), format=1004)
    affine["group_size"] = 64
    gguf = dict(
        w=mx.array(random_blocks("Q4_K", w.shape[0], k // 256, rng)), format=GGUF_TYPES["Q4_K"][0]
    )
    rope = dict(rope_dims=d, traditional=False, base=10000.0, scale=1.0)
    for weights in (affine, gguf):
        args = dict(weights)
        wt = args.pop("w")
        for rows in (1, 3):
            x = mx.array(rng.normal(size=(2, rows, k)).astype(np.float32)).astype(dtype)
            y = ext.qmatmul(x, wt, **args)
            assert mx.array_equal(ext.qmatmul_swiglu(x, wt, **args), ext.swiglu(y)).item()
            pos = mx.array([4, 9], mx.int32)
            got = ext.qmatmul_heads(x, wt, **args, a=nq, b=nk, c=nk, d=d, **rope, offsets=pos)
            apart = ext.split_heads(y, nq, nk, nk, d, **rope, offsets=pos)
            assert all(mx.array_equal(g, a).item() for g, a in zip(got, apart, strict=True))
            r = mx.array(rng.normal(size=y.shape).astype(np.float32)).astype(dtype)
            nw = mx.array(rng.normal(size=(y.shape[-1],)).astype(np.float32)).astype(dtype)
            h, n = ext.qmatmul_add_norm(x, wt, **args, r=r, weight=nw, eps=1e-5)
            h0, n0 = ext.add_rms_norm(r, y, nw, eps=1e-5)
            assert mx.array_equal(h, h0).item() and mx.array_equal(n, n0).item()
            assert h.dtype == n.dtype == dtype
    with pytest.raises(ValueError, match="residual differs from the product"):
        ext.qmatmul_add_norm(x, wt, **args, r=r[..., :-1], weight=nw, eps=1e-5)
    with pytest.raises(ValueError, match=f"rms_norm weight must be \\({y.shape[-1]},\\)"):
        ext.qmatmul_add_norm(x, wt, **args, r=r, weight=nw[:-1], eps=1e-5)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_float_products_on_streams_equal_mlxs_product(ext, dtype):
    """float16 / bfloat16 products cut by output rows over 3 CPU streams: bit-equal to
    MLX's one product (with and without a bias, as mx.addmm adds it), a decode row and a
    prefill block, a row count that does not divide by 3; float32 is left to BLAS."""
    from llama_tp.kernels.float_products import float_matmul, parts_for

    before = kernels.status().threads
    kernels.set_threads(3)
    try:
        rng = np.random.default_rng(0)
        w = mx.array(rng.normal(size=(1001, 96)).astype(np.float32) * 0.1).astype(dtype)
        b = mx.array(rng.normal(size=(1001,)).astype(np.float32)).astype(dtype)
        assert parts_for(w) == 3 and parts_for(w.astype(mx.float32)) == 1
        for rows in (1, 7):
            x = mx.array(rng.normal(size=(2, rows, 96)).astype(np.float32)).astype(dtype)
            assert mx.array_equal(float_matmul(x, w), x @ w.T).item(), rows
            assert mx.array_equal(float_matmul(x, w, b), mx.addmm(b, x, w.T)).item(), rows
    finally:
        kernels.set_threads(before)
