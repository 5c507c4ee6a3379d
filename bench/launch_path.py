"""The launch path: 2 ranks of the built-in model started directly (MLX_RANK + a ring
hostfile), through `python -m llama_tp.launch` and through `mlx.launch`, and each
launcher's own CPU time; writes the "The launch path" section of docs/benchmarks.md
and docs/benchmarks/launch-path.json.

    .venv/bin/python bench/launch_path.py
    .venv/bin/python bench/launch_path.py --out /tmp/x.md    # another page
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from llama_tp.benchmarks.processes import Run, cpu_seconds, execute
from llama_tp.benchmarks.sections import PAGE, facts_line, replace_section, run_facts, write_results

NAME = "launch-path"
FLAGS = ["-p", "32", "-g", "32", "-n", "1", "--collective-steps", "0"]


def rows() -> list[tuple[str, Run]]:
    return [
        ("direct start (MLX_RANK + hostfile)", Run("launch", FLAGS, 2, compare=False)),
        ("python -m llama_tp.launch", Run("launch", FLAGS, 2, compare=False, launcher="llama_tp")),
        ("mlx.launch", Run("launch", FLAGS, 2, compare=False, launcher="mlx.launch")),
    ]


def execute_llama_tp_launch(run: Run, timeout: float) -> dict:
    """One row through `python -m llama_tp.launch` (its own CPU time sampled)."""
    cmd = [sys.executable, "-m", "llama_tp.launch", "-n", str(run.ranks), "-m"]
    cmd += run.command()[2:]
    tic = time.perf_counter()
    p = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    cpu = 0.0
    while p.poll() is None:
        cpu = cpu_seconds(p.pid) or cpu
        time.sleep(0.2)
        if time.perf_counter() - tic > timeout:
            p.kill()
    out, err = p.communicate()
    lines = [x for x in out.decode().splitlines() if x.startswith("{")]
    if not lines:
        return {"error": err.decode()[-400:]}
    r = json.loads(lines[-1])
    r.update(wall_s=time.perf_counter() - tic, launcher_cpu_s=cpu)
    return r


def section(res: dict) -> str:
    md = ["### The launch path", "", facts_line(res), ""]
    md += ["| start | generation tok/s | vs direct | launcher CPU / wall |"]
    md += ["| --- | --- | --- | --- |"]
    direct = res["launch"][0].get("llama_tp", {}).get("generation_tps")
    for row in res["launch"]:
        g = row.get("llama_tp", {}).get("generation_tps")
        ratio = f"{g / direct:.2f}x" if g and direct else "-"
        cpu = row.get("launcher_cpu_s")
        share = f"{cpu / row['wall_s']:.0%}" if cpu is not None and row.get("wall_s") else "-"
        gen = "-" if g is None else f"{g:.2f}"
        md.append(f"| {row['label']} | {gen} | {ratio} | {share} |")
    c = res["launch"][0].get("llama_tp", {}).get("collectives", {})
    if c:
        md += [
            "",
            f"Collectives per generated token (2 ranks, counted): {c['all_reduces_per_token']} "
            f"all-reduces ({c['all_reduces_per_layer']:.0f} per layer) + "
            f"{c['other_collectives_per_token']} sampling exchange that carries the next "
            "token's embedding row: 2 per layer + 1.",
        ]
    md += ["", "```sh", *res["commands"], "```"]
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(PAGE), help="the page whose section to rewrite")
    args = p.parse_args()
    res = {**run_facts("bench/launch_path.py"), "launch": [], "commands": []}
    for label, run in rows():
        print(f"launch: {label}", file=sys.stderr, flush=True)
        if run.launcher == "llama_tp":
            row = execute_llama_tp_launch(run, 600)
            res["commands"].append(
                f"python -m llama_tp.launch -n 2 -m llama_tp.bench {' '.join(run.model)} --json"
            )
        else:
            row = execute(run, 900)
            res["commands"].append(run.shell())
        row["label"] = label
        res["launch"].append(row)
    write_results(NAME, res)
    print(f"wrote {replace_section(NAME, section(res), args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
