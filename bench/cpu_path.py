"""The CPU path: the built-in model as stored (Q4_1) and with `--dtype float32`
(OpenBLAS preloaded), `bfloat16`, `float16`, on 1 and 2 ranks, beside llama.cpp on the
same GGUF (llama-cpp-python, 2 threads) in the same run, and how much of a decode step
is Python and graph building (bench/step_overhead.py); writes the sections "The CPU
path" and "Graph building per decode step" of docs/benchmarks.md and
docs/benchmarks/cpu-path.json.

    .venv/bin/python bench/cpu_path.py --llama-cpp-python /path/to/venv/bin/python
    .venv/bin/python bench/cpu_path.py --only cpu --out /tmp/x.md    # some parts only

`--llama-cpp-python`: an interpreter of a venv where `pip install llama-cpp-python`
built llama.cpp (without it the llama.cpp row is left out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from llama_tp.benchmarks.processes import Run, execute
from llama_tp.benchmarks.sections import PAGE, facts_line, replace_section, run_facts, write_results
from llama_tp.cluster.blas import find_openblas

NAME, OVERHEAD = "cpu-path", "graph-building"
BENCH = ["-p", "64", "-g", "32", "-n", "1", "--collective-steps", "0"]
STEP_OVERHEAD = str(Path(__file__).resolve().parent / "step_overhead.py")


def cpu_rows(openblas: str | None) -> list[tuple[str, Run]]:
    rows = []
    for ranks in (1, 2):
        rows.append(("as stored (Q4_1)", Run("cpu", BENCH, ranks, compare=False)))
        for dtype in ("float32", "bfloat16", "float16"):
            blas = "openblas" if dtype == "float32" and openblas else "reference"
            label = f"--dtype {dtype}" + (" + OpenBLAS" if blas == "openblas" else "")
            run = Run("cpu", [*BENCH, "--dtype", dtype], ranks, blas=blas, compare=False)
            run.env["OPENBLAS_NUM_THREADS"] = str(max(1, 2 // ranks))
            rows.append((label, run))
    return rows


def llama_cpp(python: str, gguf: Path) -> dict:
    """llama.cpp's prompt (64 tokens) and generation (32) tokens/s, 2 threads."""
    code = (
        "import sys, time, json\n"
        "from llama_cpp import Llama\n"
        "llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=512, verbose=False)\n"
        "prompt = list(range(100, 164))\n"
        "llm.eval(prompt[:8]); llm.reset()\n"  # warm-up
        "t = time.perf_counter(); llm.eval(prompt); tp = time.perf_counter() - t\n"
        "t = time.perf_counter()\n"
        "for _ in range(32): llm.eval([llm.sample(temp=0.0)])\n"
        "tg = time.perf_counter() - t\n"
        "print(json.dumps({'prompt_tps': 64 / tp, 'generation_tps': 32 / tg}))\n"
    )
    out = subprocess.run([python, "-c", code, str(gguf)], capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr[-400:]}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    ver = subprocess.run(
        [python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        capture_output=True,
        text=True,
    )
    r["version"] = ver.stdout.strip()
    return r


def overhead(openblas: str | None) -> list[dict]:
    res = []
    for dtype in (None, "float32"):
        env = dict(os.environ)
        cmd = [sys.executable, STEP_OVERHEAD, "-g", "32"]
        if dtype:
            cmd += ["--dtype", dtype]
            if openblas:
                env.update(LD_PRELOAD=openblas, OPENBLAS_NUM_THREADS="2")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("{")]
        res.append(json.loads(line[-1]) if line else {"error": out.stderr[-300:]})
    return res


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def overhead_section(res: dict) -> str:
    md = ["### Graph building per decode step (1 rank)", "", facts_line(res), ""]
    md += ["| weights | step | building the graph | share |", "| --- | --- | --- | --- |"]
    for r in res["overhead"]:
        if "error" not in r:
            md.append(
                f"| {r['dtype']} | {r['step_ms'][0]:.1f} ms | {r['graph_build_ms'][0]:.2f} ms "
                f"| {r['build_share'][0]:.1%} |"
            )
    md += [
        "",
        "Building the next step's graph overlaps the current step's evaluation "
        "(`mx.async_eval`), so the visible overhead is smaller still; `mx.compile` could "
        "remove at most this share, and the KV cache's in-place updates at a new offset "
        "every step would make it retrace every step: not compiled then. The decode step "
        "is compiled since, with the KV buffers' lengths kept a multiple of 256 and the "
        "offset passed as an array ([performance](performance.md#the-compiled-decode-step)).",
        "",
        "```sh",
        "python bench/step_overhead.py -g 32",
        "LD_PRELOAD=$OPENBLAS OPENBLAS_NUM_THREADS=2 python bench/step_overhead.py -g 32 "
        "--dtype float32",
        "```",
    ]
    return "\n".join(md)


def cpu_section(res: dict) -> str:
    md = ["### The CPU path (built-in model, prompt 64, generate 32)", "", facts_line(res), ""]
    md += ["| weights | ranks | prompt tok/s | generation tok/s | peak memory per rank |"]
    md += ["| --- | --- | --- | --- | --- |"]
    for row in res["cpu"]:
        lt = row.get("llama_tp", {})
        peak = ", ".join(f"{p:.2f}" for p in lt.get("peak_memory_gb", [])) or "-"
        md.append(
            f"| {row['label']} | {row['ranks']} | {_fmt(lt.get('prompt_tps'))} "
            f"| {_fmt(lt.get('generation_tps'))} | {peak} GB |"
        )
    lc = res.get("llama_cpp", {})
    if "generation_tps" in lc:
        md.append(
            f"| llama.cpp {lc['version']} (llama-cpp-python, Q4_1, 2 threads) | 1 "
            f"| {lc['prompt_tps']:.1f} | {lc['generation_tps']:.1f} | - |"
        )
        best = max(
            (r.get("llama_tp", {}).get("generation_tps") or 0, r["label"])
            for r in res["cpu"]
            if r["ranks"] == 2
        )
        md += [
            "",
            f"Fastest on 2 ranks: {best[1]}, {best[0]:.1f} tok/s = "
            f"{best[0] / lc['generation_tps']:.2f}x llama.cpp's generation.",
        ]
    md += ["", "```sh", *res["commands"], "```"]
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-cpp-python", help="python of a venv with llama-cpp-python")
    p.add_argument("--only", default="overhead,cpu", help="parts: overhead, cpu")
    p.add_argument("--out", default=str(PAGE), help="the page whose sections to rewrite")
    args = p.parse_args()
    parts = set(args.only.split(","))
    openblas = find_openblas()
    res: dict = {**run_facts("bench/cpu_path.py"), "commands": []}
    if "overhead" in parts:
        print("overhead", file=sys.stderr, flush=True)
        res["overhead"] = overhead(openblas)
        replace_section(OVERHEAD, overhead_section(res), args.out)
    if "cpu" in parts:
        res["cpu"] = []
        for label, run in cpu_rows(openblas):
            print(f"cpu: {label}, {run.ranks} rank(s)", file=sys.stderr, flush=True)
            row = execute(run, 900)
            row.update(label=label, ranks=run.ranks)
            res["cpu"].append(row)
            res["commands"].append(run.shell())
        if args.llama_cpp_python:
            from llama_tp import default_model

            res["llama_cpp"] = llama_cpp(args.llama_cpp_python, default_model())
            res["commands"].append(
                "# llama.cpp: Llama(model, n_threads=2).eval(...) in bench/cpu_path.py"
            )
        replace_section(NAME, cpu_section(res), args.out)
    write_results(NAME, res)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
