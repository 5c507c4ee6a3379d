"""A mixture-of-experts model on 1 and 2 ranks against mlx-lm on the same weights.

    python bench/moe.py [--spec moe-a3b-fp32] [-p 128 -g 64 -n 3] [--json docs/moe.json]

One run, three `python -m llama_tp.bench` invocations on the synthetic Qwen3-MoE `--spec`
(written once into the cache; `moe-a3b` is Qwen3-30B-A3B's shape scaled down):

1. 1 rank, with `--compare mlx-lm`: mlx-lm's own model and loop on the same weights;
2. 2 ranks, experts split by tensor, with `--compare mlx-lm`: mlx-lm's own sharding
   (`sharded_load`, which supports qwen3_moe) on the same 2 ranks;
3. 2 ranks, experts split by expert.

Ranks start through `python -m llama_tp.launch` (OpenBLAS preloaded, one thread per
rank); the one process gets OpenBLAS with two threads. Every figure is bench's own:
tokens/s (means of `-n` trials after a warm-up), each rank's MLX peak memory and
weights, its resident set (max RSS), and the tokens routed to each rank's experts
(counted in one more trial). Prints a markdown table, and the JSON with `--json`.
Targets (issue 26): 1 rank >= 1.0x mlx-lm's generation tokens/s; 2 ranks' per-rank
memory <= 0.55x the 1-rank figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from llama_tp.cluster.blas import find_openblas

PY = sys.executable


def bench(spec: str, ranks: int, flags: list[str], args) -> dict:
    cmd = [PY, "-m", "llama_tp.bench", "--synthetic", spec, "--json", "--quiet"]
    cmd += ["-p", str(args.p), "-g", str(args.g), "-n", str(args.n), *flags]
    env = dict(os.environ)
    if ranks > 1:
        cmd = [PY, "-m", "llama_tp.launch", "-n", str(ranks), "--", *cmd]
        env["OPENBLAS_NUM_THREADS"] = "1"
    else:
        env["OPENBLAS_NUM_THREADS"] = "2"
        if find_openblas():  # as the launcher does for its ranks
            env["LD_PRELOAD"] = find_openblas()
    print(" ".join(cmd[cmd.index("-m") :]), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def _row(name: str, r: dict, engine: str = "llama_tp") -> str:
    x = r[engine]
    peak = " / ".join(f"{v:.2f}" for v in x["peak_memory_gb"])
    rss = " / ".join(f"{v:.2f}" for v in x.get("max_rss_gb", [])) or "-"
    load = x.get("expert_load", {}).get("routes_by_expert")
    share = " / ".join(f"{100 * n / sum(load):.1f}%" for n in load) if load else "-"
    return (
        f"| {name} | {x['prompt_tps']:.1f} | {x['generation_tps']:.2f} | {peak} | {rss} | {share} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="moe-a3b-fp32")
    p.add_argument("-p", type=int, default=128, help="prompt tokens")
    p.add_argument("-g", type=int, default=64, help="generated tokens")
    p.add_argument("-n", type=int, default=3, help="trials")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    compare = ["--compare", "mlx-lm", "--collective-steps", "0"]
    runs = {
        "1 rank": bench(args.spec, 1, compare, args),
        "2 ranks, by tensor": bench(args.spec, 2, [*compare, "--moe-split", "tensor"], args),
        "2 ranks, by expert": bench(
            args.spec, 2, ["--moe-split", "expert", "--collective-steps", "0"], args
        ),
    }
    one, two = runs["1 rank"], runs["2 ranks, by tensor"]
    targets = {
        "generation_vs_mlx_lm_1_rank": one["ratio"]["generation_tps"],
        "peak_memory_2_ranks_over_1": max(
            max(r["llama_tp"]["peak_memory_gb"]) for k, r in runs.items() if k != "1 rank"
        )
        / one["llama_tp"]["peak_memory_gb"][0],
        "weights_2_ranks_over_1": max(two["llama_tp"]["weights_gb"])
        / one["llama_tp"]["weights_gb"][0],
        "max_rss_2_ranks_over_1": max(two["llama_tp"]["max_rss_gb"])
        / one["llama_tp"]["max_rss_gb"][0],
    }
    head = "| run | prompt tok/s | gen tok/s | MLX peak GB per rank | max RSS GB per rank | "
    head += "routes per rank (by expert) |"
    lines = [head, "|" + "---|" * 6]
    for name, r in runs.items():
        lines.append(_row(f"llama_tp, {name}", r))
        if "mlx_lm" in r and r["mlx_lm"].get("supported"):
            lines.append(_row(f"mlx-lm, {name.split(',')[0]}", r, "mlx_lm"))
    lines.append("")
    lines += [f"{k}: {v:.3f}" for k, v in targets.items()]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"spec": args.spec, "runs": runs, "targets": targets}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
