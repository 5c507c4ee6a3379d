"""Ring or MPI on one machine: 2 ranks of the float32 built-in model on the ring backend
(started directly) and on MPI (`mpirun`, Open MPI's shared-memory transport), 1 rank
beside them, OpenBLAS preloaded; writes the section "Ring or MPI on one machine" of
docs/benchmarks.md and docs/benchmarks/mpi-backend.json. Needs Open MPI
(`apt-get install openmpi-bin libopenmpi-dev`).

    .venv/bin/python bench/mpi_backend.py
    .venv/bin/python bench/mpi_backend.py --out /tmp/x.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from llama_tp.benchmarks import sections
from llama_tp.benchmarks.processes import Run, execute
from llama_tp.cluster.blas import find_openblas

NAME = "mpi-backend"


def rows(f32: Path, openblas: str | None) -> list[dict]:
    flags = ["--model", str(f32), "-p", "64", "-g", "32", "-n", "1", "--collective-steps", "0"]
    out = []
    for label, ranks in (("1 rank", 1), ("2 ranks, ring (direct start)", 2)):
        print(f"mpi: {label}", file=sys.stderr, flush=True)
        run = Run("mpi", flags, ranks, "openblas" if openblas else "reference", False)
        run.env["OPENBLAS_NUM_THREADS"] = "1" if ranks == 2 else "2"
        out.append({"label": label, "command": run.shell(), **execute(run, 900)})
    print("mpi: mpirun", file=sys.stderr, flush=True)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    preload = ["-x", f"LD_PRELOAD={openblas}"] if openblas else []
    cmd = ["mpirun", "-n", "2", "-x", "OPENBLAS_NUM_THREADS=1", *preload]
    cmd += [sys.executable, "-m", "llama_tp.bench", *flags, "--json"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    line = [x for x in p.stdout.splitlines() if x.startswith("{")]
    r = json.loads(line[-1]) if line else {"error": p.stderr[-400:]}
    shown = "mpirun -n 2 -x OPENBLAS_NUM_THREADS=1 -x LD_PRELOAD=$OPENBLAS "
    shown += "python -m llama_tp.bench " + " ".join(flags)
    out.append({"label": "2 ranks, MPI (mpirun)", "command": shown, **r})
    return out


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def section(res: dict) -> str:
    md = ["### Ring or MPI on one machine (float32 + OpenBLAS, prompt 64, generate 32)", ""]
    md += [sections.facts_line(res), ""]
    md += ["| start | prompt tok/s | generation tok/s |", "| --- | --- | --- |"]
    for r in res["mpi"]:
        t = r.get("llama_tp") or r
        md.append(f"| {r['label']} | {_f(t.get('prompt_tps'))} | {_f(t.get('generation_tps'))} |")
    md += ["", "```sh", *(r["command"] for r in res["mpi"]), "```"]
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(sections.PAGE), help="the page whose section to rewrite")
    args = p.parse_args()
    res: dict = sections.run_facts("bench/mpi_backend.py")
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32"
        convert = [sys.executable, "-m", "llama_tp.convert", "-d", "--dtype", "float32"]
        subprocess.run([*convert, "--out", str(f32), "--quiet"], check=True)
        res["mpi"] = rows(f32, find_openblas())
    # the float32 copy lived in a temporary directory: name it as the docs do
    sections.write_results(NAME, res)
    sections.replace_section(NAME, re.sub(r"\S*/f32\b", "F32_DIR", section(res)), args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
