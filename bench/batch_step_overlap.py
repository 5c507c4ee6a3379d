"""The batch engine's aggregate tokens/s at C = 1, 4, 16 with and without double-buffered
steps, on 1 and 2 ranks of the float32 built-in model (OpenBLAS preloaded when installed);
writes the section "The batch engine's step: double-buffered or not" of docs/benchmarks.md
and docs/benchmarks/batch-step-overlap.json.

    .venv/bin/python bench/batch_step_overlap.py
    .venv/bin/python bench/batch_step_overlap.py --ranks 1 --rounds 3 --out /tmp/x.md
    python -m llama_tp.launch -n 2 -- python bench/batch_step_overlap.py --worker   # one row

`BatchEngine(overlap=True)` (the engine behind `serve`) starts the next step's
forward (`mx.async_eval`) before it reads this step's tokens, so the Python work
of a step (per-row text, stop strings, events) overlaps the computation;
`overlap=False` reads the tokens first, as the engine did before. For each C,
C sequences (distinct prompts, greedy, end-of-sequence ignored so every sequence
makes `--tokens` tokens) are admitted at once and decoded to the end, in rounds that
run the two modes one after the other in one process (which goes first alternates);
reported: the median aggregate generated tokens/s of each mode, and the median of the
rounds' ratios (each round's two runs are neighbours in time, so the ratio holds up
better than the rates when the machine's speed drifts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llama_tp.benchmarks.sections import PAGE, facts_line, replace_section, run_facts, write_results

NAME = "batch-step-overlap"
HERE = Path(__file__).resolve()


def decode(model, tokenizer, prompts: list[list[int]], tokens: int, overlap: bool) -> float:
    """Aggregate generated tokens/s of decoding `prompts` together to `tokens` each
    (prefill excluded: the clock starts after the admissions)."""
    from llama_tp.engine.batch import BatchEngine, Decision, Join, SamplingParams

    engine = BatchEngine(model, tokenizer, eos_token_ids=set(), overlap=overlap)
    params = SamplingParams(max_tokens=tokens)
    engine.apply(Decision(joins=[Join(i, p, params) for i, p in enumerate(prompts)]))
    engine.step()  # the first tokens came from the prefill: start the clock after them
    tic, made = time.perf_counter(), 0
    while len(engine):
        made += len(engine.step())
    return made / (time.perf_counter() - tic)


def worker(args: argparse.Namespace) -> None:
    """One row, on the ranks this process belongs to: rank 0 prints one JSON line."""
    from llama_tp import encode_prompt, eprint0, load, print0, world

    group = world()
    model, tokenizer = load(args.model, group, dtype=args.dtype)
    rows = []
    for c in args.concurrency:
        prompts = [
            encode_prompt(tokenizer, f"Request {i}: tell me about the number {i * 7}.")
            for i in range(c)
        ]
        decode(model, tokenizer, prompts, 8, True)  # warm-up
        runs: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.rounds):
            for overlap in (False, True) if r % 2 == 0 else (True, False):
                runs[overlap].append(decode(model, tokenizer, prompts, args.tokens, overlap))
        before, after = statistics.median(runs[False]), statistics.median(runs[True])
        ratio = statistics.median(a / b for a, b in zip(runs[True], runs[False], strict=True))
        eprint0(f"C={c}: {before:.2f} tok/s reading first, {after:.2f} overlapped, x{ratio:.2f}")
        rows.append(
            {
                "concurrency": c,
                "tok_s_sequential": before,
                "tok_s_overlapped": after,
                "ratio": ratio,  # the median of the rounds' ratios
                "runs_sequential": runs[False],
                "runs_overlapped": runs[True],
            }
        )
    print0(json.dumps({"ranks": group.size(), "dtype": args.dtype, "results": rows}))


def run_row(ranks: int, args: argparse.Namespace) -> tuple[list[str], dict]:
    """The worker on `ranks` ranks in its own processes: (the command shown, its result)."""
    from llama_tp.cluster.blas import find_openblas

    flags = ["--worker", "--tokens", str(args.tokens), "--rounds", str(args.rounds)]
    flags += ["--concurrency", *map(str, args.concurrency)]
    flags += ["--dtype", args.dtype] + (["--model", args.model] if args.model else [])
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}
    if ranks == 1:
        openblas = find_openblas()
        if openblas:  # what `python -m llama_tp.launch` does for local ranks
            env |= {"LD_PRELOAD": openblas, "OPENBLAS_NUM_THREADS": str(os.cpu_count() or 1)}
        cmd = [sys.executable, str(HERE), *flags]
        shown = ["python", "bench/batch_step_overlap.py", *flags]
    else:  # the launcher preloads OpenBLAS, one thread per rank's share of the cores
        cmd = [sys.executable, "-m", "llama_tp.launch", "-n", str(ranks), "--"]
        cmd += [sys.executable, str(HERE), *flags]
        shown = ["python", "-m", "llama_tp.launch", "-n", str(ranks), "--", "python"]
        shown += ["bench/batch_step_overlap.py", *flags]
    print(f"batch-step-overlap: {ranks} rank(s)", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=3600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        return shown, {"ranks": ranks, "error": f"exit code {p.returncode}"}
    return shown, {**json.loads(lines[-1]), "openblas": bool(find_openblas())}


def section(res: dict) -> str:
    md = ["### The batch engine's step: double-buffered or not", "", facts_line(res), ""]
    md += [
        f"The built-in model, `--dtype {res['dtype']}`"
        + (" with OpenBLAS preloaded" if all(r.get("openblas") for r in res["rows"]) else "")
        + f"; C sequences admitted at once, {res['tokens']} greedy tokens each; aggregate "
        "generated tokens/s (the median of "
        f"{res['rounds']} runs), read first = the step's tokens read before the next "
        "forward starts (before), overlapped = the next forward started first "
        "(`mx.async_eval`, after); the ratio is the median of the rounds' paired ratios. "
        "The machine was shared with other jobs while it ran"
        + (
            f" (load average {res['load_average_before']:.1f} at the start, "
            f"{res['load_average_after']:.1f} at the end, on 2 cores)"
            if "load_average_before" in res
            else ""
        )
        + ": the ratios, taken from neighbouring runs, are the figures to read, with "
        "their spread over the rounds.",
        "",
        "| ranks | C | read first (before) | overlapped (after) | after / before | per round |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in res["rows"]:
        if "error" in row:
            md.append(f"| {row['ranks']} | - | {row['error']} | - | - | - |")
            continue
        for r in row["results"]:
            pairs = zip(r["runs_overlapped"], r["runs_sequential"], strict=True)
            ratios = sorted(a / b for a, b in pairs)
            md.append(
                f"| {row['ranks']} | {r['concurrency']} | {r['tok_s_sequential']:.1f} | "
                f"{r['tok_s_overlapped']:.1f} | {r['ratio']:.2f}x | "
                f"{ratios[0]:.2f} to {ratios[-1]:.2f} |"
            )
    md += ["", "```sh", *res["commands"], "```"]
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the built-in model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="one row each")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--tokens", type=int, default=64, help="generated per sequence")
    p.add_argument("--rounds", type=int, default=4, help="of each mode, alternating")
    p.add_argument("--out", default=str(PAGE), help="the page whose section to rewrite")
    p.add_argument("--worker", action="store_true", help="measure here and print JSON")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    res = {**run_facts("bench/batch_step_overlap.py"), "dtype": args.dtype}
    res["load_average_before"] = os.getloadavg()[0]  # the machine may be shared
    res |= {"tokens": args.tokens, "rounds": args.rounds, "rows": [], "commands": []}
    for ranks in args.ranks:
        shown, row = run_row(ranks, args)
        res["commands"].append(" ".join(shown))
        res["rows"].append(row)
    res["load_average_after"] = os.getloadavg()[0]
    write_results(NAME, res)
    print(f"wrote {replace_section(NAME, section(res), Path(args.out))}", file=sys.stderr)


if __name__ == "__main__":
    main()
