"""llama_tp against mlx-lm on the same weights: speed, memory and collectives, 1 and 2
ranks, reference BLAS and OpenBLAS, pinned and not; writes its section of
docs/benchmarks.md ("llama_tp against mlx-lm") and docs/benchmarks/versus-mlx-lm.json
and .png.

    .venv/bin/python bench/versus_mlx_lm.py            # the full matrix (12-17 minutes on 2 cores)
    .venv/bin/python bench/versus_mlx_lm.py --quick    # fewer tokens and trials
    .venv/bin/python bench/versus_mlx_lm.py --only fp32 --out /tmp/x.md   # some rows only

Every row is one `python -m llama_tp.bench ... --json` run (one process, or N
ranks), parsed from rank 0's JSON (llama_tp/benchmarks/processes.py). Multi-rank rows
start the ranks directly (each gets MLX_RANK and a ring hostfile, as mlx.launch gives
them, but no launcher process runs beside them), one row through `mlx.launch` for
comparison: mlx.launch's I/O threads spin on a CPU core while the ranks run, which on a
2-core machine takes a core from the ranks. Rows marked OpenBLAS run with LD_PRELOAD set
to the installed OpenBLAS (llama_tp/cluster/blas.py). Needs matplotlib for the plot
(`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from llama_tp.benchmarks.matrix_report import write_plot, write_report
from llama_tp.benchmarks.processes import Run, blas_check, execute, machine
from llama_tp.benchmarks.sections import DOCS, PAGE, replace_section
from llama_tp.cluster.blas import find_openblas

NAME = "versus-mlx-lm"


def matrix(quick: bool) -> list[Run]:
    default = ["-p", "32", "-g", "16" if quick else "32"]
    default += ["-n", "1" if quick else "2"]
    big = ["-p", "16", "-g", "8" if quick else "16", "-n", "1"]
    s16, s32 = ["--synthetic", "0.5b-fp16"], ["--synthetic", "0.5b-fp32"]
    runs = [
        Run("SmolLM2-135M Q4_1", default, 1),
        Run("SmolLM2-135M Q4_1", default, 1, "openblas"),
        Run("SmolLM2-135M Q4_1", default, 2),
        Run("SmolLM2-135M Q4_1", default, 2, "openblas"),
        # only to show what mlx.launch's spinning costs: fewer tokens, it is slow
        Run(
            "SmolLM2-135M Q4_1",
            ["-p", "32", "-g", "16", "-n", "1"],
            2,
            compare=False,
            launcher="mlx.launch",
        ),
        Run("synthetic 0.5B fp16", s16 + big, 1),
        Run("synthetic 0.5B fp16", s16 + big, 2),
        Run("synthetic 0.5B fp16", s16 + big, 1, compare=False, pin=True),
        Run("synthetic 0.5B fp16", s16 + big, 2, compare=False, pin=True),
        Run("synthetic 0.5B fp16", s16 + big, 1, compare=False, pin=True, copies=2),
        Run("synthetic 0.5B fp32", s32 + big, 1),
        Run("synthetic 0.5B fp32", s32 + big, 1, "openblas"),
        Run("synthetic 0.5B fp32", s32 + big, 2, "openblas"),
        Run("synthetic 0.5B fp32", s32 + big, 2, "openblas", compare=False, blas_threads=False),
        Run("synthetic 0.5B fp32", s32 + big, 1, "openblas", compare=False, pin=True),
        Run("synthetic 0.5B fp32", s32 + big, 2, "openblas", compare=False, pin=True),
        Run("synthetic 0.5B fp32", s32 + big, 1, "openblas", compare=False, pin=True, copies=2),
    ]
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens and trials")
    p.add_argument("--only", help="run only rows whose label contains this text")
    p.add_argument("--timeout", type=float, default=600, help="seconds per row")
    p.add_argument("--out", default=str(PAGE), help="the page whose section to rewrite")
    p.add_argument("--results", default=str(DOCS / "benchmarks" / f"{NAME}.json"))
    p.add_argument("--note", default="", help="a sentence about the conditions, for the report")
    p.add_argument(
        "--from-json", action="store_true", help="only rewrite the section from --results"
    )
    args = p.parse_args()
    out, results = Path(args.out), Path(args.results)
    png = results.with_suffix(".png")
    if args.from_json:
        data = json.loads(results.read_text())
        write_plot(data, png)
        replace_section(NAME, write_report(data, os.path.relpath(png, out.parent)), out)
        return 0
    runs = [r for r in matrix(args.quick) if not args.only or args.only in r.label]
    if not find_openblas():
        print("OpenBLAS not installed: its rows are skipped", file=sys.stderr)
        runs = [r for r in runs if r.blas != "openblas"]
    from llama_tp.benchmarks.synthetic import synthetic_dir

    for spec in sorted({r.model[1] for r in runs if r.model[:1] == ["--synthetic"]}):
        print(f"synthetic checkpoint {spec}: {synthetic_dir(spec)}", file=sys.stderr)
    tic = time.perf_counter()
    info = machine()
    info["blas_product"] = blas_check()
    rows = []
    for i, run in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {run.label}, {run.ranks} rank(s), {run.blas}", file=sys.stderr)
        load = os.getloadavg()[0]  # other processes' load makes a row slower and noisier
        result = execute(run, args.timeout)
        result["load_before"] = load
        if "error" in result:
            print(f"  failed: {result['error']}: {result['stderr']}", file=sys.stderr)
        rows.append({"run": run.__dict__, "shell": run.shell(), "result": result})
    info["total_s"] = time.perf_counter() - tic
    data = {"machine": info, "rows": rows, "quick": args.quick, "note": args.note}
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(data, indent=1) + "\n")
    write_plot(data, png)
    replace_section(NAME, write_report(data, os.path.relpath(png, out.parent)), out)
    print(f"wrote {out} ({info['total_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
