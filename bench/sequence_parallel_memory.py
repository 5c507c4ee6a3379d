"""Sequence-parallel prefill memory: the peak per rank of a 2,048-token prefill on the
synthetic 0.1B fp32 model, 2 ranks started directly (OpenBLAS preloaded), with and
without `--sequence-parallel`; writes the section "Sequence-parallel prefill memory" of
docs/benchmarks.md and docs/benchmarks/sequence-parallel-memory.json.

    .venv/bin/python bench/sequence_parallel_memory.py
    .venv/bin/python bench/sequence_parallel_memory.py --out /tmp/x.md
"""

from __future__ import annotations

import argparse
import sys

from llama_tp.benchmarks import sections
from llama_tp.benchmarks.processes import Run, execute
from llama_tp.cluster.blas import find_openblas

NAME = "sequence-parallel-memory"
FLAGS = ["--synthetic", "0.1b-fp32", "-p", "2048", "-g", "2", "-n", "1", "--collective-steps", "0"]


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def section(res: dict) -> str:
    md = ["### Sequence-parallel prefill memory (2,048 tokens, 2 ranks)", ""]
    md += [sections.facts_line(res), "", "Per rank (the larger of the two ranks'):", ""]
    md += ["| per rank | plain tensor parallel | --sequence-parallel | ratio |"]
    md += ["| --- | --- | --- | --- |"]
    a, b = (r.get("llama_tp", {}) for r in res["sp"])
    for key, label in (
        ("activation_peak_gb", "peak above the weights (activations)"),
        ("peak_memory_gb", "peak memory"),
    ):
        x, y = (max(v) if isinstance(v, list) else v for v in (a.get(key), b.get(key)))
        ratio = f"{y / x:.2f}x" if x and y else "-"
        md.append(f"| {label} | {_f(x)} GB | {_f(y)} GB | {ratio} |")
    md += ["", "```sh", *(r["command"] for r in res["sp"]), "```"]
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(sections.PAGE), help="the page whose section to rewrite")
    args = p.parse_args()
    blas = "openblas" if find_openblas() else "reference"
    res: dict = {**sections.run_facts("bench/sequence_parallel_memory.py"), "sp": []}
    for sp in (False, True):
        run = Run("sp", FLAGS + (["--sequence-parallel"] if sp else []), 2, blas, False)
        print(f"sp: {sp}", file=sys.stderr, flush=True)
        res["sp"].append({"sequence_parallel": sp, "command": run.shell(), **execute(run, 1800)})
    sections.write_results(NAME, res)
    sections.replace_section(NAME, section(res), args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
