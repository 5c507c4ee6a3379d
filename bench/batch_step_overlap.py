"""The batch engine's aggregate tokens/s with and without double-buffered steps.

    python bench/batch_step_overlap.py [--concurrency 1 4 16] [--tokens 64] [--rounds 3]
    python -m llama_tp.launch -n 2 -- python bench/batch_step_overlap.py --json

`BatchEngine(overlap=True)` (the engine behind `serve`) starts the next step's
forward (`mx.async_eval`) before it reads this step's tokens, so the Python work
of a step (per-row text, stop strings, events) overlaps the computation;
`overlap=False` reads the tokens first, as the engine did before. For each C,
C sequences of the built-in model (distinct prompts, greedy, end-of-sequence
ignored so every sequence makes `--tokens` tokens) are admitted at once and
decoded to the end, in rounds that alternate the two modes in one process;
reported: the median aggregate generated tokens/s of each mode, and the median of the
rounds' ratios (each round's two runs are neighbours in time, so the ratio holds up
better than the rates when the machine's speed drifts).
Rank 0 prints a table, or one JSON object with --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from llama_tp import encode_prompt, eprint0, load, print0, world
from llama_tp.engine.batch import BatchEngine, Decision, Join, SamplingParams


def decode(model, tokenizer, prompts: list[list[int]], tokens: int, overlap: bool) -> float:
    """Aggregate generated tokens/s of decoding `prompts` together to `tokens` each
    (prefill excluded: the clock starts after the admissions)."""
    engine = BatchEngine(model, tokenizer, eos_token_ids=set(), overlap=overlap)
    params = SamplingParams(max_tokens=tokens)
    engine.apply(Decision(joins=[Join(i, p, params) for i, p in enumerate(prompts)]))
    engine.step()  # the first tokens came from the prefill: start the clock after them
    tic, made = time.perf_counter(), 0
    while len(engine):
        made += len(engine.step())
    return made / (time.perf_counter() - tic)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the built-in model")
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--tokens", type=int, default=64, help="generated per sequence")
    p.add_argument("--rounds", type=int, default=3, help="of each mode, alternating")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
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
        for _ in range(args.rounds):
            for overlap in (False, True):
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
    meta = {"ranks": group.size(), "tokens": args.tokens, "rounds": args.rounds}
    if args.json:
        print0(json.dumps({**meta, "dtype": args.dtype, "results": rows}))
        return
    print0(f"{'C':>3} {'tokens read first':>18} {'overlapped':>11} {'ratio':>6}  (tok/s)")
    for r in rows:
        print0(
            f"{r['concurrency']:>3} {r['tok_s_sequential']:>18.1f} "
            f"{r['tok_s_overlapped']:>11.1f} {r['ratio']:>6.2f}"
        )


if __name__ == "__main__":
    main()
