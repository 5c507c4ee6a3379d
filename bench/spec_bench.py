"""Speculative decoding figures: `python -m llama_tp.bench` with and without a drafter.

    .venv/bin/python bench/spec_bench.py --model DIR [--model DIR ...] [--draft-model DIR]
        [--ranks 1 2] [--openblas] [-g 64] [-n 2] [--out results.jsonl]

Runs every (model, rank count, prompt kind, drafter) on this machine, multi-rank
rows with the ranks started directly (MLX_RANK + a ring hostfile; mlx.launch's
launcher spins a core), appends each rank-0 JSON line to --out and prints a
markdown table: generation tokens/s, the speed-up over plain decoding of the same
row, acceptance rate, tokens per target forward, collective rounds per token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llama_tp.benchmarks.speculative_rows import PROMPTS, run_row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--draft-model")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--openblas", action="store_true")
    p.add_argument("-g", type=int, default=64)
    p.add_argument("-n", type=int, default=2)
    p.add_argument("-k", type=int, default=6, help="draft tokens for ngram")
    p.add_argument("--k-model", type=int, default=3, help="draft tokens for the draft model")
    p.add_argument("--prompts", nargs="+", default=list(PROMPTS))
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", default="spec_bench.jsonl")
    a = p.parse_args()
    drafts = [None, "ngram"] + ([a.draft_model] if a.draft_model else [])
    rows = []
    for model in a.model:
        for ranks in a.ranks:
            for kind in a.prompts:
                base = None
                for draft in drafts:
                    r = run_row(model, ranks, PROMPTS[kind], draft, a)
                    if r is None:
                        print(f"failed: {model} {ranks} {kind} {draft}", file=sys.stderr)
                        continue
                    r["kind"], r["draft"] = kind, draft
                    with open(a.out, "a") as f:
                        f.write(json.dumps(r) + "\n")
                    t = r["llama_tp"]
                    base = t["generation_tps"] if draft is None else base
                    sp = t.get("speculative") or {}
                    name = Path(draft).name if draft else "-"
                    speed = t["generation_tps"] / base if base else float("nan")
                    rate = f"{100 * sp['acceptance_rate']:.0f}%" if sp else "-"
                    rows.append(
                        f"| {Path(model).name} | {ranks} | {kind} | {name} | "
                        f"{t['generation_tps']:.2f} | {speed:.2f}x | {rate} | "
                        f"{sp.get('tokens_per_forward', 1.0):.2f} | {t['rounds_per_token']:.1f} |"
                    )
                    print(rows[-1], flush=True)
    print(
        "| model | ranks | prompt | drafter | gen tok/s | vs plain | acceptance | "
        "tokens/forward | collective rounds/token |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
