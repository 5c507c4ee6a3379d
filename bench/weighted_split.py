"""A weighted split against the balanced one on 2 ranks: per-rank memory and step time.

    .venv/bin/python bench/weighted_split.py [--split 3:1] [--pairs 6] [--synthetic 0.5b-fp32]

Runs `python -m llama_tp.launch -n 2 -m llama_tp.bench --synthetic SPEC --pin-core auto
--json` (each rank pinned to its own core: two equal machines; the launcher preloads
OpenBLAS with one thread per rank) with `--split SPLIT` and without, in turn (weighted,
balanced, weighted, ...: on a machine shared with other work, the load that comes and
goes weighs on both sides of a pair alike; the ratio is the median of the paired
ratios), and records per run and rank the weights held, the peak memory, the prompt and
generation speed. The prediction to hold the measurement against is the plan's
(`parallel/placement.py`, what `plan --split` prints): on equal cores a decode step is
bound by its busiest rank, so the weighted split's step may take up to
max(bytes per rank, weighted) / max(bytes per rank, balanced) of the balanced one's.
Rewrites the section "Weighted split" of docs/benchmarks.md and
docs/benchmarks/weighted-split.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from llama_tp.benchmarks import sections

NAME = "weighted-split"


def bench(split: str | None, args) -> dict:
    """One 2-rank bench run; rank 0's figures."""
    cmd = ["python", "-m", "llama_tp.launch", "-n", "2", "-m", "llama_tp.bench"]
    cmd += ["--synthetic", args.synthetic, "--pin-core", "auto", "--json", "--quiet"]
    cmd += ["-p", str(args.p), "-g", str(args.g), "-n", str(args.n)]
    cmd += ["--collective-steps", str(args.collective_steps)]
    cmd += ["--split", split] if split else []
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}
    r = subprocess.run(
        [sys.executable, *cmd[1:]], env=env, capture_output=True, text=True, timeout=1800
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stderr[-2000:]}")
    top = json.loads(lines[-1])
    res = top["llama_tp"]
    return {
        "split": split,
        "prompt_tps": res["prompt_tps"],
        "generation_tps": res["generation_tps"],
        "step_ms": 1000 / res["generation_tps"],
        # rank 0's decode step, then the same with the collectives replaced by identity:
        # rank 0's own compute (rank 0 is the busiest rank under --split 3:1)
        "decode_step_ms": res["decode_step_ms"],
        "compute_ms": res["decode_step_ms_no_collectives"],
        "weights_gb": res["weights_gb"],
        "peak_memory_gb": res["peak_memory_gb"],
        "placement_bytes": res["placement_bytes"],
        "pin_core": top["pin_core"],  # the cores each rank's threads may run on
        "command": " ".join(cmd),
    }


def summary(runs: list[dict]) -> dict:
    """Medians of each side, the paired ratios (weighted / balanced step) and the plan's
    prediction (the busiest rank's bytes, weighted over balanced)."""
    weighted = [r for r in runs if r["split"]]
    balanced = [r for r in runs if not r["split"]]
    pairs = list(zip(weighted, balanced, strict=True))
    ratios = [w["step_ms"] / b["step_ms"] for w, b in pairs]
    compute = [w["compute_ms"] / b["compute_ms"] for w, b in pairs]
    return {
        "step_ms_weighted": statistics.median(r["step_ms"] for r in weighted),
        "step_ms_balanced": statistics.median(r["step_ms"] for r in balanced),
        "step_ratios": ratios,
        "step_ratio_median": statistics.median(ratios),
        "compute_ratios": compute,
        "compute_ratio_median": statistics.median(compute),
        "predicted_step_ratio": max(weighted[0]["placement_bytes"])
        / max(balanced[0]["placement_bytes"]),
        "prompt_ratio_median": statistics.median(
            b["prompt_tps"] / w["prompt_tps"] for w, b in pairs
        ),
    }


def _load(xs: list[float]) -> str:
    return " / ".join(f"{x:.1f}" for x in xs)


def _gb(xs: list[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in xs)


def section(res: dict) -> str:
    s, runs = res["summary"], res["runs"]
    weighted = [r for r in runs if r["split"]]
    balanced = [r for r in runs if not r["split"]]
    md = [
        f"### Weighted split: --split {res['split']} against balanced, 2 ranks pinned "
        f"one core each (synthetic {res['synthetic']}, prompt {res['p']}, generate {res['g']})",
        "",
        sections.facts_line(res),
        "",
        f"{len(weighted)} pairs of runs, weighted and balanced in turn (each run `-n "
        f"{res['n']}` trials after a warm-up); ratios are the medians of the paired ratios.",
        "",
        "| split | weights GB (rank 0 / 1) | peak GB (rank 0 / 1) | prompt tok/s | "
        "generation tok/s | step ms | rank 0 compute ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, rs in ((f"--split {res['split']}", weighted), ("balanced", balanced)):
        peak = [max(r["peak_memory_gb"][k] for r in rs) for k in range(2)]
        prompt = statistics.median(r["prompt_tps"] for r in rs)
        gen = statistics.median(r["generation_tps"] for r in rs)
        step = statistics.median(r["step_ms"] for r in rs)
        compute = statistics.median(r["compute_ms"] for r in rs)
        md.append(
            f"| {label} | {_gb(rs[0]['weights_gb'])} | {_gb(peak)} | {prompt:.1f} | "
            f"{gen:.2f} | {step:.0f} | {compute:.0f} |"
        )

    def within(x: float) -> str:
        return "within" if x <= s["predicted_step_ratio"] else "above"

    md += [
        "",
        "Rank 0 compute: its decode step with the collectives replaced by identity "
        "(bench's `--collective-steps`), the busiest rank's own work under the weighted "
        f"split. The plan predicts at most **{s['predicted_step_ratio']:.2f}x** (the "
        "busiest rank's bytes, weighted over balanced). Weighted over balanced, medians "
        f"of the paired ratios: decode step **{s['step_ratio_median']:.2f}x** "
        f"({within(s['step_ratio_median'])} the prediction; pairs "
        f"{', '.join(f'{x:.2f}' for x in s['step_ratios'])}), rank 0 compute "
        f"**{s['compute_ratio_median']:.2f}x** ({within(s['compute_ratio_median'])}; pairs "
        f"{', '.join(f'{x:.2f}' for x in s['compute_ratios'])}), prompt time "
        f"{s['prompt_ratio_median']:.2f}x. Load average at the start and the end: "
        f"{_load(res['load_average_start'])}, {_load(res['load_average_end'])}.",
        "",
        "```sh",
        weighted[0]["command"],
        balanced[0]["command"],
        "```",
    ]
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--synthetic", default="0.5b-fp32", help="the model (bench --synthetic)")
    p.add_argument("--split", default="3:1", help="the weighted split to hold against balanced")
    p.add_argument("--pairs", type=int, default=6, help="weighted/balanced pairs of runs")
    p.add_argument("-p", type=int, default=64, help="prompt tokens")
    p.add_argument("-g", type=int, default=32, help="generated tokens")
    p.add_argument("-n", type=int, default=3, help="bench's timed trials per run")
    p.add_argument("--collective-steps", type=int, default=8, help="as for bench")
    p.add_argument("--out", default=str(sections.PAGE), help="the page whose section to rewrite")
    args = p.parse_args()
    res: dict = sections.run_facts("bench/weighted_split.py")
    res.update(split=args.split, synthetic=args.synthetic, p=args.p, g=args.g, n=args.n)
    res["load_average_start"] = os.getloadavg()
    runs = []
    for i in range(args.pairs):
        for split in (args.split, None):
            runs.append(bench(split, args))
            r = runs[-1]
            print(
                f"pair {i + 1} {split or 'balanced'}: {r['generation_tps']:.2f} tok/s, "
                f"weights {_gb(r['weights_gb'])} GB",
                file=sys.stderr,
                flush=True,
            )
    res["runs"] = runs
    res["summary"] = summary(runs)
    res["load_average_end"] = os.getloadavg()
    sections.write_results(NAME, res)
    sections.replace_section(NAME, section(res), args.out)
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
