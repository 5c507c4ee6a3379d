"""gpt-oss (issue 30): attention sinks, sliding-window layers, biased experts behind the
clamped SwiGLU, YaRN RoPE, MXFP4 experts. mlx-lm's own gpt_oss model on the same folder
is the oracle in one process; the multi-rank checks of both fixtures (float32, MXFP4
experts), the release layout and the GGUF file under both expert splits against one
process (`mp_moe.py`: 2, 3 and 4 ranks, and a tp2 x pp2 mesh, with what each rank's
loader read and held against its placement) are in test_flagships.py's launches, one per
rank count for every family. The GGUF `gpt-oss` file llama.cpp's converter writes from
the release layout: against a float64 forward pass over gguf-py's dequantization
(`reference64_gpt_oss.py`) and the release folder. `serve` on 2 ranks batches requests.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import run_python
from family_kit import greedy, greedy_mlx_lm
from gpt_oss_fixtures import gguf_release, gpt_oss_models

ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return gpt_oss_models(tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def gguf_file(models, tmp_path_factory) -> Path:
    return gguf_release(models["gpt_oss-hf"], tmp_path_factory.mktemp("gguf") / "gpt_oss.gguf")


def test_one_process_equals_mlx_lm(models):
    """Logits within 1e-4 of mlx-lm's gpt_oss on the same folder (float32, MXFP4 experts
    as mlx-lm's convert writes them and as the Hugging Face release stores them: blocks,
    scales, gate and up interleaved) and the same 32 greedy tokens (past the window of 4:
    the rotating caches wrap); the experts held as MXFP4, never dequantized; each layer's
    cache the kind mlx-lm's model makes, holding what `plan` says (sliding ones: the
    window)."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.slices import model_shape
    from llama_tp.parallel.cast import cast_model
    from llama_tp.parallel.placement import kv_cache_bytes, place

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    for name, path in models.items():
        ckpt = open_checkpoint(path)
        ours, theirs = build_model(ckpt), load_model(path)[0]
        assert type(theirs).__module__.endswith("gpt_oss")
        diff = mx.abs(ours(x) - theirs(x)).max().item()
        assert diff <= ATOL, (name, diff)
        prompt = x[0].tolist()
        assert greedy(ours, prompt, 32) == greedy_mlx_lm(theirs, prompt, 32), name
        experts = ours.layers[0].feed_forward.switch_mlp
        if name != "gpt_oss":
            assert experts.down_proj.mode == "mxfp4" and experts.down_proj.weight.dtype == mx.uint32
            assert experts.down_proj.scales.dtype == mx.uint8
        cache = make_prompt_cache(ours)
        kinds = [type(c).__name__ for c in cache]
        assert kinds == [type(c).__name__ for c in theirs.make_cache()]
        assert kinds == ["RotatingKVCache", "KVCache"] * 2
        mx.eval(ours(x, cache=cache))
        for t in range(6):
            mx.eval(ours(mx.array([[t]]), cache=cache))
        held = sum(c.keys[..., : c.offset, :].nbytes * 2 for c in cache)
        shape = model_shape(ckpt)
        assert held == kv_cache_bytes(shape, place(shape).ranks[0], tokens=18)
        if name != "gpt_oss":  # --dtype float32: the MXFP4 experts dequantized, same logits
            quantized = ours(x)
            cast_model(ours, "float32")
            assert mx.abs(ours(x) - quantized).max().item() <= ATOL


def test_serve_concurrent_requests_on_two_ranks(models, tmp_path):
    """gpt-oss on 2 ranks answers concurrent requests exactly as it answers each alone:
    batches merge each sliding-window layer's rotating cache (mlx-lm's
    BatchRotatingKVCache) and the full layers' caches, with the prompt cache on."""
    from serve_client import Server, chat

    server = Server(2, models["gpt_oss-mxfp4"], tmp_path, "--max-batch", "8")
    try:
        server.wait_ready()
        c = server.client()
        prompts = ["hello", "The quick brown fox", "Tensor parallel", "abc", "xyz 0123"]
        alone = [chat(c, p, max_tokens=16)[0] for p in prompts]
        with ThreadPoolExecutor(5) as pool:
            together = list(pool.map(lambda p: chat(c, p, stream=True, max_tokens=16)[0], prompts))
        assert together == alone
    finally:
        server.close()


def _variant(src: Path, path: Path, **changes) -> Path:
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


def _one_error(r, expected: str) -> None:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert errors[0] == f"error: {expected}", errors[0]
    assert r.returncode == 1, r.stderr


def test_refusals_are_one_line(models, tmp_path):
    """Configs that disagree with themselves or with the tensors: one line, the numbers;
    a quantization mode that is not read, and sequence parallelism (its chunks' masks
    are not windowed): one line."""
    from llama_tp.checkpoints import CheckpointError, open_checkpoint

    src = models["gpt_oss"]
    cases = {
        "types": (
            dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
            "config.json: model config: 3 layer_types for 4 layers",
        ),
        "window": (
            dict(sliding_window=0),
            "config.json: model config: sliding-window layers with sliding_window 0",
        ),
        "kind": (
            dict(layer_types=["chunked_attention", "full_attention"] * 2),
            "config.json: model config: layer type 'chunked_attention' (supported: "
            "sliding_attention, full_attention)",
        ),
        "experts": (
            dict(num_local_experts=6),
            ": model.layers.0.mlp.experts.down_proj.weight holds 5 experts but config.json's "
            "num_local_experts is 6",
        ),
        "topk": (
            dict(num_experts_per_tok=6),
            "config.json: model config: 6 experts per token (top-k) with 5 experts: need "
            "1 <= top-k <= experts",
        ),
    }
    for name, (changes, message) in cases.items():
        path = _variant(src, tmp_path / name, **changes)
        with pytest.raises(CheckpointError) as e:
            open_checkpoint(path)
        assert str(e.value) == f"{path}{'/' if message[0] != ':' else ''}{message}"
    quant = json.loads((models["gpt_oss-mxfp4"] / "config.json").read_text())["quantization"]
    path = _variant(
        models["gpt_oss-mxfp4"], tmp_path / "nvfp4", quantization={**quant, "mode": "nvfp4"}
    )
    r = run_python(["-m", "llama_tp.generate", "--model", str(path), "--prompt", "hi", "-m", "2"])
    _one_error(
        r,
        f"{path / 'config.json'}: quantization mode 'nvfp4' is not supported (supported: "
        "affine, mxfp4)",
    )
    args = ["--model", str(src), "--prompt", "hi", "-m", "2", "--sequence-parallel"]
    _one_error(
        run_python(["-m", "llama_tp.generate", *args]),
        "--sequence-parallel does not take sliding-window layers (gpt-oss, Gemma)",
    )


def test_plan_of_gpt_oss_120b_config():
    """`plan` of gpt-oss-120b's own config.json (MXFP4 experts, bfloat16 rest) on 3 ranks:
    64 / 8 heads as 24/24/16 and 3/3/2, every expert's 2880 columns in whole 32-value
    blocks, and the KV cache line naming the window."""
    config = Path(__file__).parents[1] / "docs" / "configs" / "gpt-oss-120b" / "config.json"
    out = run_python(["-m", "llama_tp.plan", "-n", "3", "--model", str(config)])
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if re.match(r"^[0-2] ", line)]
    assert [r[1:5] for r in rows] == [
        ["0-23", "[24]", "0-2", "[3]"],
        ["24-47", "[24]", "3-5", "[3]"],
        ["48-63", "[16]", "6-7", "[2]"],
    ]
    assert [int(r[9].strip("[]")) % 32 for r in rows] == [0, 0, 0]
    assert "18 of 36 layers slide over a window of 128 tokens" in out.stdout


def test_gguf_mxfp4_blocks_are_mlx_mxfp4():
    """ggml's MXFP4 blocks (gguf-py's quantizer: the exponent, then values 0..15 in the low
    nibbles and 16..31 in the high ones) repacked for MLX's mxfp4 mode (values 2i, 2i+1 in
    byte i) dequantize exactly as gguf-py dequantizes them, in the same 17 bytes per 32."""
    import gguf
    from gguf.quants import dequantize, quantize

    from llama_tp.checkpoints.gguf_quants import mxfp4_to_mlx

    values = np.random.default_rng(0).normal(0, 0.1, (3, 40, 96)).astype(np.float32)
    values[0, 0, :32] = 0.0  # an all-zero block: exponent 0
    raw = quantize(values, gguf.GGMLQuantizationType.MXFP4)
    weight, scales = mxfp4_to_mlx(raw.reshape(-1, raw.shape[-1]))
    assert weight.nbytes + scales.nbytes == raw.nbytes
    ours = mx.dequantize(mx.array(weight), mx.array(scales), None, 32, 4, mode="mxfp4")
    ref = dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(-1, 96)
    assert np.array_equal(np.array(ours.astype(mx.float32)), ref)


def test_gguf_file_equals_float64_and_the_release(models, gguf_file, tmp_path):
    """The GGUF file (F32, MXFP4 experts): next-token log-probabilities within 1e-4 nats of
    llama.cpp's computation in float64 over gguf-py's dequantization (sinks, the window
    of 4 on even layers over 10 tokens, YaRN, biases, the clamped SwiGLU); the logits and
    32 greedy tokens of the release folder it was converted from, the same ModelArgs but
    for YaRN's keys; the experts held in MLX's mxfp4 mode. An inconsistent file: one line
    with the numbers."""
    import dataclasses

    import reference64
    import reference64_gpt_oss

    from llama_tp.checkpoints import CheckpointError, open_checkpoint
    from llama_tp.checkpoints.build import build_model

    tokens = [1, 5, 9, 22, 7, 100, 3, 250, 11, 12]
    ckpt = open_checkpoint(gguf_file)
    ours = build_model(ckpt)
    got = np.array(ours(mx.array([tokens]))[0])
    ref = reference64_gpt_oss.logits(str(gguf_file), tokens)
    assert reference64.top5_gap(got, ref) <= 1e-4
    release = open_checkpoint(models["gpt_oss-hf"])
    theirs = build_model(release)
    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL
    prompt = x[0].tolist()
    assert greedy(ours, prompt, 32) == greedy(theirs, prompt, 32)
    a, b = dataclasses.asdict(ckpt.args), dataclasses.asdict(release.args)
    assert {k for k in a if a[k] != b[k]} == {"rope_scaling", "norm_eps"}  # eps: float32
    assert a["norm_eps"] == pytest.approx(b["norm_eps"])
    yarn = {k: v for k, v in a["rope_scaling"].items() if k != "type"}
    assert yarn.items() <= b["rope_scaling"].items()  # the release's "rope_type" yarn
    down = ours.layers[1].feed_forward.switch_mlp.down_proj
    assert down.mode == "mxfp4" and down.weight.dtype == mx.uint32
    assert down.scales.dtype == mx.uint8
    assert "MXFP4 -> MLX mxfp4 (as stored, nibbles reordered): 12 tensors" in ckpt.notes
    cases = {
        "layers": (
            {"block_count": 5},
            "gpt-oss.block_count says 5 layers but the file has tensors of 4 (blk.0 to blk.3)",
        ),
        "yarn": (
            {"rope.scaling.yarn_attn_factor": 2.0},
            "gpt-oss.rope.scaling.yarn_attn_factor is 2.0: only gpt-oss's own YaRN "
            "(yarn_attn_factor 1.0) is read",
        ),
    }
    for name, (changes, message) in cases.items():
        bad = gguf_release(models["gpt_oss-hf"], tmp_path / f"{name}.gguf", **changes)
        with pytest.raises(CheckpointError) as e:
            open_checkpoint(bad)
        assert str(e.value) == f"{bad}: {message}"
