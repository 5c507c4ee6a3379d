"""GGUF quantization types loaded quantized and in slices, against llama.cpp's gguf-py.

Block conversion is checked type by type in-process; then every type (and a mixed
file) is loaded on 1, 2 and 3 ranks by `mp_gguf_check.py`, one run per rank count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT, launch, requires, run_python
from gguf_writer import (
    F16,
    NAMES,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    random_blocks,
    tiny_llama_gguf,
    write_gguf,
)
from test_errors import assert_every_rank_failed, assert_one_error

from llama_tp.checkpoints import gguf_quants as gq

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

TYPES = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K]
# head_dim 64: on 2 and 3 ranks the attn_output split falls inside 256-value K-quant
# blocks; hidden 512: the feed-forward splits on whole K blocks on 2 ranks, not on 3.
SMALL = dict(dim=256, hidden=512, vocab=96, heads=4, kv_heads=2)
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _rows(kind: int, rows: int = 6, cols: int = 512, seed: int = 0) -> np.ndarray:
    raw = random_blocks(kind, rows, cols, np.random.default_rng(seed))
    return np.frombuffer(raw, np.uint8).reshape(rows, -1)


@pytest.mark.parametrize("kind", TYPES, ids=[NAMES[k] for k in TYPES])
def test_blocks_convert_as_gguf_py_dequantizes(kind):
    name = NAMES[kind]
    raw = _rows(kind)
    ref = dequantize(raw, gguf.GGMLQuantizationType(kind)).reshape(6, 512)
    per, size = gq.BLOCKS[name]
    assert np.array_equal(gq.dequantize(name, raw.reshape(-1, size)).reshape(6, 512), ref)
    w, s, b = gq.to_mlx(name, raw)
    bits = gq.mlx_bits(name)
    assert w.shape == (6, 512 * bits // 32) and s.shape == b.shape == (6, 16)
    got = mx.dequantize(
        mx.array(w), mx.array(s).astype(mx.float32), mx.array(b).astype(mx.float32), 32, bits
    )
    err = np.abs(np.array(got) - ref).reshape(-1, 32).max(axis=1)
    s, b = np.abs(s.astype(np.float32)).reshape(-1), np.abs(b.astype(np.float32)).reshape(-1)
    if name in gq.REQUANT_BITS:
        assert (err <= s / 2 * 1.001 + 1e-7).all()
    else:  # float16 rounding of the scale and bias products only
        assert (err <= 2**-11 * (s * ((1 << bits) - 1) + b) * 1.01 + 6e-8).all()


def _source_steps(name: str, blk: np.ndarray) -> np.ndarray:
    """The coarser of the two 16-value sub-block steps of each 32-value group."""
    n = blk.shape[0]
    if name == "Q6_K":
        step = gq._f16(blk[:, 208:210]) * blk[:, 192:208].view(np.int8)
    elif name == "Q3_K":
        s = blk[:, 96:108]
        lo = gq._nibbles(s[:, 0:8], 8).reshape(n, 16)
        hi = (s[:, 8:12].reshape(n, 1, 4) >> gq._SHIFT2.reshape(1, 4, 1)) & 3
        step = gq._f16(blk[:, 108:110]) * ((lo | (hi.reshape(n, 16) << 4)).astype(np.float32) - 32)
    else:  # Q2_K
        step = gq._f16(blk[:, 80:82]) * (blk[:, 0:16] & 15)
    return np.abs(step).reshape(-1, 2).max(axis=1)


@pytest.mark.parametrize("kind", [Q6_K, Q3_K, Q2_K], ids=["Q6_K", "Q3_K", "Q2_K"])
def test_requantized_error_stays_inside_half_the_source_step(kind):
    """The documented measure (README "Formats"): worst error on random blocks over
    half the source's own step, <= 0.6 at the chosen width, > 0.6 one width below."""
    name = NAMES[kind]
    raw = _rows(kind, rows=64, cols=1024, seed=1)
    _, size = gq.BLOCKS[name]
    ref = dequantize(raw, gguf.GGMLQuantizationType(kind)).reshape(-1, 32)
    half = _source_steps(name, raw.reshape(-1, size)) / 2
    ok = half > 0
    bits = gq.REQUANT_BITS[name]
    lower = {8: 6, 5: 4, 4: 3}[bits]
    ratios = {}
    for b in (lower, bits):
        q, s, z = gq.requantize(ref, b)
        err = np.abs(q * s[:, None] + z[:, None] - ref).max(axis=1)
        ratios[b] = float((err[ok] / half[ok]).max())
    assert ratios[bits] <= 0.6 < ratios[lower], ratios


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packing_is_mlx_layout(bits):
    q = np.random.default_rng(bits).integers(0, 1 << bits, (3, 64)).astype(np.uint8)
    w = gq.pack(q, bits)
    ones = mx.ones((3, 2), mx.float32)
    got = mx.dequantize(mx.array(w), ones, mx.zeros_like(ones), group_size=32, bits=bits)
    assert np.array_equal(np.array(got), q.astype(np.float32))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_quants")
    out = {}
    for kind in [*TYPES, F16]:  # F16: float tensors sliced by rows and by columns
        q = {f"blk.*.{p}.weight": kind for p in PROJECTIONS}
        q.update({"token_embd.weight": kind, "output.weight": kind})
        out[NAMES[kind]] = tiny_llama_gguf(root / f"{NAMES[kind]}.gguf", q, **SMALL)
    mixed = {f"blk.*.{p}.weight": Q5_0 for p in PROJECTIONS[:4]}
    mixed.update({f"blk.*.{p}.weight": Q4_K for p in PROJECTIONS[4:]})
    mixed.update({"output.weight": Q6_K, "token_embd.weight": Q8_0})
    out["mixed"] = tiny_llama_gguf(root / "mixed.gguf", mixed, **SMALL)
    return out


def _parse(r) -> dict[str, dict]:
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
    return {x["path"]: x for x in lines}


@pytest.fixture(scope="module")
def runs(files):
    """Rank count -> path -> what mp_gguf_check.py printed."""
    args = ["tests/mp_gguf_check.py", *map(str, files.values())]
    out = {1: _parse(run_python(args, timeout=120))}
    for n in (2, 3):
        out[n] = _parse(launch(n, args, timeout=240))
    return out


def _expected_bytes(path, n: int) -> list[int]:
    """Bytes of GGUF tensor data each rank keeps: whole rows of row slices, the blocks
    covering the columns of column slices (a straddled block counts for both)."""
    from pathlib import Path

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.gguf import to_model_name
    from llama_tp.checkpoints.gguf_header import read_header
    from llama_tp.parallel.partition import tensor_slice, vocab_ranges
    from llama_tp.parallel.shard import plan_for

    header = read_header(Path(path))
    plan = plan_for(build_model(open_checkpoint(path), whole=False), n)
    out = []
    for part in plan.parts:
        total = 0
        vocab = vocab_ranges(SMALL["vocab"], n)[part.rank] if n > 1 else None
        for name, t in header.tensors.items():
            shape = tuple(reversed(t.shape))
            s = None if n == 1 else tensor_slice(plan, part, to_model_name(name), shape, vocab)
            per, size = t.block
            if s is None:
                total += t.nbytes
            elif s[0] == 0:
                total += t.nbytes // shape[0] * (s[2] - s[1])
            else:
                total += shape[0] * (-(-s[2] // per) - s[1] // per) * size
        out.append(total)
    return out


@pytest.mark.parametrize("n", [1, 2, 3])
def test_weights_equal_gguf_py_on_every_rank(runs, n):
    for path, r in runs[n].items():
        for rank, worst in enumerate(r["worst"]):
            assert max(worst.values()) <= 1.0, (path, n, rank, worst)


@pytest.mark.parametrize("n", [2, 3])
def test_logits_and_tokens_equal_across_rank_counts(runs, n):
    for path, r in runs[n].items():
        one = runs[1][path]
        diff = np.abs(np.array(r["logits"]) - np.array(one["logits"])).max()
        assert diff <= 1e-4, (path, n, diff)
        assert r["tokens"] == one["tokens"], path


@pytest.mark.parametrize("n", [1, 2, 3])
def test_each_rank_reads_its_share(runs, n):
    for path, r in runs[n].items():
        assert r["bytes_read"] == _expected_bytes(path, n), path
    if n == 2:  # an even split of 32-value blocks: the shares add up to the file (+ norms)
        for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
            path = next(p for p in runs[n] if p.endswith(f"/{name}.gguf"))
            assert sum(runs[n][path]["bytes_read"]) <= runs[1][path]["bytes_read"][0] * 1.01


@requires("compiler")
def test_plan_names_the_block_split(files):
    """`plan` holds the types as the loader here would: as stored with the native
    kernels (CI builds them), converted with MLX's kernel."""
    from llama_tp import kernels

    assert kernels.status().native, kernels.status().reason
    cmd = [sys.executable, "-m", "llama_tp.plan", "--model", str(files["mixed"]), "-n", "2"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "split in units of 256: whole GGUF blocks of ffn_down" in r.stdout, r.stderr
    assert "Q6_K -> as stored (native kernels)" in r.stdout
    env = {**os.environ, "LLAMA_TP_KERNELS": "mlx"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "Q6_K -> MLX 8-bit, group 32 (requantized)" in r.stdout, r.stderr


def _generate(path) -> list[str]:
    return ["-m", "llama_tp.generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2"]


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_quants")
    rng = np.random.default_rng(0)
    meta = {"general.architecture": "llama", "llama.embedding_length": 64}
    out = {}
    good = tiny_llama_gguf(root / "good.gguf", {"blk.0.ffn_down.weight": Q4_K})
    data = good.read_bytes()
    (root / "truncated.gguf").write_bytes(data[: len(data) - 1000])
    out["truncated"] = (root / "truncated.gguf", "but the file has")
    blocks = random_blocks(Q4_0, 2, 32, rng)
    write_gguf(root / "size.gguf", meta, {"blk.0.attn_q.weight": (Q4_0, (48, 1), blocks[:18])})
    out["size"] = (root / "size.gguf", "'blk.0.attn_q.weight': rows of 48 values are not whole")
    at = data.find(b"blk.0.ffn_down.weight")  # then ndim (4 bytes), 2 dims (16), the type id
    type_at = at + len(b"blk.0.ffn_down.weight") + 4 + 16
    assert data[type_at] == Q4_K
    (root / "type.gguf").write_bytes(data[:type_at] + bytes([99]) + data[type_at + 1 :])
    out["type"] = (root / "type.gguf", "tensor 'blk.0.ffn_down.weight' has unknown ggml type id 99")
    return out


@pytest.mark.parametrize("name", ["truncated", "size", "type"])
def test_bad_gguf_is_one_line_naming_the_tensor(bad, name):
    path, expected = bad[name]
    r = run_python(_generate(path), timeout=60)
    assert_one_error(r, expected)


def test_bad_gguf_fails_on_every_rank(bad):
    path, expected = bad["type"]
    r = launch(2, _generate(path), timeout=120)
    assert_one_error(r, expected, code=1)  # llama_tp.launch: the failing ranks' code
    assert_every_rank_failed(r, 2)


def test_streaming_convert_equals_the_gguf(tmp_path):
    """convert writes the GGUF's tensors as the loader converts them (tensor by tensor)."""
    from gguf_writer import llama_vocabulary

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.convert import convert

    types = {f"blk.*.{p}.weight": Q5_1 for p in PROJECTIONS[:4]}
    types |= {f"blk.*.{p}.weight": Q5_K for p in PROJECTIONS[4:]}
    types |= {"output.weight": Q3_K, "token_embd.weight": Q2_K}
    small = dict(SMALL, vocab=320)
    path = tiny_llama_gguf(tmp_path / "m.gguf", types, metadata=llama_vocabulary(320), **small)
    out = convert(path, tmp_path / "mlx", progress=False)
    x = mx.array([[1, 5, 300, 7]])
    a = build_model(open_checkpoint(path))(x)
    b = build_model(open_checkpoint(out))(x)
    assert mx.array_equal(a, b).item()


def test_the_block_table_is_llama_cpps():
    """GGML_TYPES (the one table of ggml type names and block sizes; gguf_quants.BLOCKS is
    drawn from it) against gguf-py's. Q8_1 (never stored, a matmul operand) is left out:
    ggml's block_q8_1 is two float16 and 32 int8 (36 bytes), gguf-py still lists 40."""
    from llama_tp.checkpoints.gguf_header import GGML_TYPES

    for tid, (name, per, size) in GGML_TYPES.items():
        kind = gguf.GGMLQuantizationType(tid)
        assert kind.name == name, tid
        if name != "Q8_1":
            assert gguf.GGML_QUANT_SIZES[kind] == (per, size), name
    assert set(gq.BLOCKS) == {*gq.EXACT_BITS, *gq.REQUANT_BITS}  # every converted type
