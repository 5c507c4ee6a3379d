"""`python -m llama_tp.bench`, its collective counting, and the BLAS detection."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import launch, requires, run_python

from llama_tp.benchmarks.report import print_table
from llama_tp.benchmarks.synthetic import parse_spec
from llama_tp.cluster import blas
from llama_tp.cluster.collectives import Call, collectives, traffic

FLAGS = ["-p", "8", "-g", "4", "-n", "1", "--json", "--compare", "mlx-lm"]
ENGINE_FIELDS = [
    "prompt_tps",
    "generation_tps",
    "ttft_s",
    "cpu_per_wall",
    "trials",
    "tokens",
    "peak_memory_gb",
    "load_peak_memory_gb",
    "load_time_s",
    "collectives",
]
TOP_FIELDS = [
    "model",
    "model_path",
    "ranks",
    "prompt_tokens",
    "generation_tokens",
    "num_trials",
    "prefill_step_size",
    "vocab_parallel",
    "pin_core",
    "blas",
    "ld_preload",
    "llama_tp",
    "mlx_lm",
    "ratio",
    "same_tokens_as_mlx_lm",
]
LLAMA_TP_FIELDS = [
    "decode_step_ms",
    "decode_step_ms_no_collectives",
    "collective_share",
    "load_bytes_read",
]
COLLECTIVE_FIELDS = [
    "all_reduces_per_token",
    "all_reduces_per_layer",
    "all_reduces_in_layers",
    "all_reduces_outside_layers",
    "other_collectives_per_token",
    "collective_bytes_per_token",
    "by_op",
]


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stdout  # one JSON object, from rank 0 only
    return json.loads(lines[0])


def _check_fields(r: dict, ranks: int) -> None:
    assert [k for k in TOP_FIELDS if k not in r] == []
    lt, ml = r["llama_tp"], r["mlx_lm"]
    assert [k for k in ENGINE_FIELDS + LLAMA_TP_FIELDS if k not in lt] == []
    assert [k for k in COLLECTIVE_FIELDS if k not in lt["collectives"]] == []
    assert ml["supported"] is True
    assert [k for k in ENGINE_FIELDS if k not in ml] == []
    assert r["ranks"] == ranks
    # Each rank reads its own share of the weight files: all of them alone, less on 2 ranks.
    assert len(lt["load_bytes_read"]) == ranks and min(lt["load_bytes_read"]) > 0
    weights = sum(f.stat().st_size for f in Path(r["model_path"]).glob("*.safetensors"))
    assert max(lt["load_bytes_read"]) <= weights
    if ranks > 1:
        assert max(lt["load_bytes_read"]) < 0.75 * weights
    for x in (lt, ml):
        assert len(x["peak_memory_gb"]) == ranks and min(x["peak_memory_gb"]) > 0
        assert len(x["trials"]) == 1 and len(x["tokens"]) == 4
        assert x["prompt_tps"] > 0 and x["generation_tps"] > 0
    assert r["ratio"]["generation_tps"] == pytest.approx(
        lt["generation_tps"] / ml["generation_tps"]
    )
    # Same fp32 weights, same prompt, greedy: both engines pick the same tokens.
    assert r["same_tokens_as_mlx_lm"] == 4 and lt["tokens"] == ml["tokens"]


def test_one_process_json_and_table(tiny_dir, capsys):
    r = run_python(["-m", "llama_tp.bench", "--model", str(tiny_dir), *FLAGS], timeout=120)
    assert r.returncode == 0, r.stderr
    result = _result(r.stdout)
    _check_fields(result, 1)
    c = result["llama_tp"]["collectives"]
    assert c["all_reduces_per_token"] == 0 and c["collective_bytes_per_token"] == 0
    assert c["all_reduces_in_layers"] == [0, 0]
    assert result["llama_tp"]["collective_share"] == 0.0
    assert result["mlx_lm"]["collectives"]["all_reduces_per_token"] == 0
    print_table(result)
    table = capsys.readouterr().out
    assert "| llama_tp |" in table and "| mlx-lm |" in table
    assert "| llama_tp / mlx-lm |" in table
    assert "0 all-reduces (0.00 per layer over 2 layers" in table


def test_two_ranks_count_two_all_reduces_per_layer(tiny_dir, capsys):
    r = launch(2, ["-m", "llama_tp.bench", "--model", str(tiny_dir), *FLAGS], timeout=240)
    assert "error" not in r.stderr, r.stderr
    result = _result(r.stdout)
    _check_fields(result, 2)
    assert result["vocab_parallel"] is True
    c = result["llama_tp"]["collectives"]
    # Counted while a steady-state decode step's graph is built: 2 per layer (wo, w2)
    # and the greedy sampler's one exchange of (value, index, embedding row), which
    # replaces the vocabulary-parallel embedding's all-reduce: 2 per layer + 1.
    assert c["all_reduces_in_layers"] == [2, 2] and c["all_reduces_per_layer"] == 2.0
    assert c["all_reduces_outside_layers"] == 0
    assert c["all_reduces_per_token"] == 4
    assert c["by_op"]["all_gather"]["calls"] == 1 and c["other_collectives_per_token"] == 1
    dim = 64  # tiny_dir's hidden size, fp32: each all-reduce carries one (1, 1, dim) vector
    assert c["by_op"]["all_sum"]["bytes"] == 4 * dim * 4
    assert c["by_op"]["all_gather"]["bytes"] == (2 + dim) * 4  # this rank's candidate
    # mlx-lm's own sharded Llama: 2 per layer, nothing else.
    assert result["mlx_lm"]["collectives"]["all_reduces_per_token"] == 4
    assert 0.0 <= result["llama_tp"]["collective_share"] <= 1.0
    print_table(result)
    assert "4 all-reduces (2.00 per layer over 2 layers, 0 outside the layers)" in (
        capsys.readouterr().out
    )


def test_two_ranks_without_vocab_parallel_pinned(tiny_dir):
    args = ["-m", "llama_tp.bench", "--model", str(tiny_dir), "-p", "8", "-g", "4", "-n", "1"]
    args += ["--json", "--no-vocab-parallel", "--pin-core", "auto", "--collective-steps", "0"]
    r = launch(2, args, timeout=240)
    assert "error" not in r.stderr, r.stderr
    result = _result(r.stdout)
    assert result["vocab_parallel"] is False
    # Every thread of rank r ends up on core r (read back from the threads).
    assert result["pin_core"] == [[0], [1 % os.cpu_count()]]
    c = result["llama_tp"]["collectives"]
    # Whole embedding and head: no embedding all-reduce, no sampling exchange.
    assert c["all_reduces_in_layers"] == [2, 2] and c["all_reduces_outside_layers"] == 0
    assert c["all_reduces_per_token"] == 4 and c["other_collectives_per_token"] == 0


def test_traffic_splits_a_stage_by_group():
    pipe = object()  # a stage of a mesh: 2 layer all-reduces, the hop, the logits, sampling
    calls = [Call("all_sum", 256), Call("all_sum", 256), Call("send", 256, pipe)]
    calls += [Call("all_sum", 780, pipe), Call("all_gather", 264)]
    assert traffic(calls, pipe) == {
        "messages": [
            {"group": "tensor", "op": "all_gather", "calls": 1, "bytes": 264},
            {"group": "tensor", "op": "all_sum", "calls": 2, "bytes": 256},
            {"group": "pipeline", "op": "all_sum", "calls": 1, "bytes": 780},
            {"group": "pipeline", "op": "send", "calls": 1, "bytes": 256},
        ],
        "bytes_sent": 2 * 256 + 256 + 780 + 264,
        "rounds": 5,
        "tensor_rounds": [2, 1],  # before the logits' all-reduce, and after it
    }


def test_tp2_x_pp2_mesh_counts_each_ranks_messages(tiny_dir, capsys):
    args = ["-m", "llama_tp.bench", "--model", str(tiny_dir), "-p", "8", "-g", "2", "-n", "1"]
    args += ["--json", "--collective-steps", "1", "--tp", "2", "--pp", "2"]
    r = launch(4, args, timeout=240)
    assert "error" not in r.stderr, r.stderr
    result = _result(r.stdout)
    lt = result["llama_tp"]
    assert lt["mesh"] == {
        "tp": 2,
        "pp": 2,
        "layers_per_stage": [1, 1],
        "stages": [[0, 1], [2, 3]],
        "rounds_per_token": 7,
    }
    # Counted per rank while a decode step's graph is built (tiny_dir: 2 layers, dim 64,
    # 389 tokens split 195 + 194, fp32). Stage 0: its layer's 2 all-reduces, the hidden
    # state sent on, the logits' all-reduce over the pipeline group (zeros from stage 0),
    # the sampling exchange (value, index and the next token's embedding row); stage 1
    # receives, and its exchange carries no row (it has no embedding).
    h, logits = 64 * 4, [195 * 4, 194 * 4]
    for rank in lt["traffic"]:
        stage, t = rank["stage"], rank["tp_rank"]
        assert (rank["rank"], stage, t) == (2 * stage + t, rank["rank"] // 2, rank["rank"] % 2)
        hop = "send" if stage == 0 else "recv"
        row = (2 + 64) * 4 if stage == 0 else 2 * 4
        assert rank["messages"] == [
            {"group": "tensor", "op": "all_gather", "calls": 1, "bytes": row},
            {"group": "tensor", "op": "all_sum", "calls": 2, "bytes": h},
            {"group": "pipeline", "op": "all_sum", "calls": 1, "bytes": logits[t]},
            {"group": "pipeline", "op": hop, "calls": 1, "bytes": h},
        ], rank
        assert rank["bytes_sent"] == row + 2 * h + logits[t] + (h if stage == 0 else 0)
        assert rank["rounds"] == 5 and rank["tensor_rounds"] == [2, 1]
    # Stage 0's 2, the hop, stage 1's 2, the logits, then both stages' sampling side by side.
    assert lt["rounds_per_token"] == 7
    assert lt["tokens"] and lt["generation_tps"] > 0
    print_table(result)
    table = capsys.readouterr().out
    assert "(4 ranks, vocab-parallel; mesh --tp 2 x --pp 2, layers 1,1;" in table
    assert (
        "  rank 2 (stage 1, tensor rank 0): tensor all_gather 1 x 8 B, tensor all_sum 2 x 256 B, "
        "pipeline all_sum 1 x 780 B, pipeline recv 1 x 256 B; sends 1.27 KiB in 5 rounds"
    ) in table
    assert "collective rounds per token: 7 (the stages one after the other" in table


def test_usage_errors():
    r = run_python(["-m", "llama_tp.bench", "-g", "1"], timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --generation-tokens must be >= 2, got 1"
    r = run_python(["-m", "llama_tp.bench", "--synthetic", "3b-fp8", "-g", "2"], timeout=60)
    assert r.returncode == 1
    assert "synthetic model '3b-fp8': expected SIZE-DTYPE" in r.stderr
    r = run_python(["-m", "llama_tp.bench", "--pp-split", "1,1"], timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --pp-split needs --pp (the number of pipeline stages)"


def test_collectives_wrapper_counts_and_restores():
    original = mx.distributed.all_sum
    x = mx.ones((3, 4))
    with collectives("identity") as calls:
        y = mx.distributed.all_sum(x)
        g = mx.distributed.all_gather(x)
        s = mx.distributed.send(x, 0)
        r = mx.distributed.recv((2, 3), mx.float16, 0)
    assert calls == [("all_sum", 48, None), ("all_gather", 48, None), ("send", 48, None)] + [
        ("recv", 12, None)
    ]
    assert y is x and g.shape == (3, 4)  # a group of one: gathering one copy
    assert s is x and r.shape == (2, 3) and r.dtype == mx.float16
    assert mx.distributed.all_sum is original
    with pytest.raises(RuntimeError), collectives():
        raise RuntimeError("boom")
    assert mx.distributed.all_sum is original


def test_synthetic_spec():
    size, dtype = parse_spec("0.5b-fp16")
    assert size["dim"] == 2048 and size["n_layers"] == 8 and dtype == mx.float16
    with pytest.raises(ValueError, match="SIZE in 0.5b, 0.1b, tiny"):
        parse_spec("0.5b")


def test_synthetic_folder_of_an_older_format_is_not_reused(tmp_path, monkeypatch):
    from llama_tp.benchmarks import synthetic

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    old = synthetic.cache_root() / "tiny-fp32-seed0"  # the name before format versions
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    path = synthetic.synthetic_dir("tiny-fp32")
    assert path != old and path.name.endswith(f"-v{synthetic.FORMAT}")
    assert json.loads((path / "config.json").read_text())["hidden_size"] > 0
    assert synthetic.synthetic_dir("tiny-fp32") == path  # written once, then reused


def test_blas_hint_without_openblas():
    info = blas.BlasInfo("/x/mlx_cpu.libs/libblas-1.so.3", True, None, 1.0)
    assert blas.hint(info) == (
        "note: MLX uses the slow reference BLAS (libblas-1.so.3); for fast fp32 matrix "
        "products: apt-get install libopenblas0-pthread, then run with "
        f"LD_PRELOAD={blas.OPENBLAS_CANDIDATES[0]}"
    )
    assert blas.hint(blas.BlasInfo("/usr/lib/libopenblas.so.0", False, None, 50.0)) is None
    assert blas.is_reference("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3")
    assert not blas.is_reference("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD and MLX's bundled BLAS: Linux")
def test_blas_detection_names_the_reference_blas():
    plain = _blas_json({k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    if "mlx_cpu.libs" in (plain["library"] or ""):  # the CPU wheel's bundled reference BLAS
        assert plain["reference"] is True
        hint = blas.hint(blas.BlasInfo(**plain))  # how to preload OpenBLAS, or install it
        assert hint and "LD_PRELOAD=" in hint, hint
        if plain["openblas"] is None:
            assert "apt-get install libopenblas0-pthread" in hint


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD and MLX's bundled BLAS: Linux")
@requires("openblas")
def test_blas_detection_follows_ld_preload():
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    openblas = blas.find_openblas()
    preloaded = _blas_json({**env, "LD_PRELOAD": openblas})
    assert preloaded["reference"] is False
    assert os.path.realpath(preloaded["library"]) == os.path.realpath(openblas)
    assert blas.hint(blas.BlasInfo(**preloaded)) is None


def _blas_json(env: dict) -> dict:
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "llama_tp.cluster.blas", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# docs/benchmarks.md section -> (driver in bench/, its function from the results to markdown,
# and the results file when it is not the section's own)
SECTIONS = {
    "versus-mlx-lm": None,  # llama_tp.benchmarks.matrix_report.write_report
    "launch-path": ("launch_path", "section"),
    "graph-building": ("cpu_path", "overhead_section", "cpu-path"),
    "cpu-path": ("cpu_path", "cpu_section"),
    "serving": ("serving", "serve_section"),
    "batch-step-overlap": ("batch_step_overlap", "section"),
    "prompt-cache": ("serving", "cache_section"),
    "speculative": ("speculative", "section"),
    "sequence-parallel-memory": ("sequence_parallel_memory", "section"),
    "mpi-backend": ("mpi_backend", "section"),
    "mixture-of-experts": ("moe", "section"),
    "deepseek-v3": ("moe", "section"),
    "gpt-oss": ("moe", "section"),
    "glm4-moe": ("moe", "section"),
    "qwen35-moe": ("moe", "section"),
    "llama4": ("moe", "section"),
    "step3p5": ("moe", "section"),
    "kimi-linear": ("moe", "section"),
    "kimi-k3": ("moe", "section"),
    "weighted-split": ("weighted_split", "section"),
    "cpu-kernels": ("cpu_kernels", "section"),
    "constrained-decoding": ("constrained_decoding", "section"),
    "generic": ("generic", "section"),
}


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_each_benchmark_section_is_its_driver_output_of_its_results(name):
    """docs/benchmarks.md's section NAME is what its driver writes from the results kept
    beside it (docs/benchmarks/NAME.json): figures and page cannot drift apart."""
    import importlib.util
    import re

    from llama_tp.benchmarks import sections

    results = SECTIONS[name][2] if SECTIONS[name] and len(SECTIONS[name]) > 2 else name
    res = json.loads((sections.DOCS / "benchmarks" / f"{results}.json").read_text())
    if SECTIONS[name] is None:
        from llama_tp.benchmarks.matrix_report import write_report

        md = write_report(res, f"benchmarks/{name}.png")
    else:
        driver, fn = SECTIONS[name][:2]
        path = Path(__file__).resolve().parent.parent / "bench" / f"{driver}.py"
        spec = importlib.util.spec_from_file_location(f"bench_{driver}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        md = re.sub(r"\S*/f32\b", "F32_DIR", getattr(module, fn)(res))
    page = sections.PAGE.read_text()
    begin, end = sections.begin(name), sections.end(name)
    assert begin in page, f"docs/benchmarks.md has no section {name}"
    assert page[page.index(begin) + len(begin) : page.index(end)].strip() == md.strip()
