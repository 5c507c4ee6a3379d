"""Drive a running `python -m llama_tp.serve` with C concurrent streaming openai clients.

    python -m llama_tp.serve --model M &            # or mlx.launch -n 2 -- ...
    python bench/serve_bench.py --base-url http://127.0.0.1:8080/v1 --concurrency 1 4 16

For each C, C clients each stream `--requests` chat completions of `--max-tokens`
tokens (greedy, distinct prompts, `ignore_eos` is not an OpenAI field, so short
replies may end early: the tokens counted are the ones received). Reports the
aggregate generated tokens/s, time to first token (median, p90) and the mean
time per token after the first.

    python bench/serve_bench.py --second-turn [--json]

instead times the second turn of `--conversations` two-turn chats: turn 1 sends a
long user message (a passage of about 400 tokens), turn 2 resends it with the reply
and a short question, as chat clients do. With the server's prompt cache turn 2
prefills only the new tokens; start the server with `--prompt-cache-size 0` to see
the time without it.
"""

from __future__ import annotations

import argparse
import json

from llama_tp.benchmarks.serve_clients import run, second_turn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=2, help="per client")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", action="store_true", help="one JSON list of the results")
    p.add_argument("--model", default="bench", help="the request's model (mlx_lm.server: its path)")
    p.add_argument("--second-turn", action="store_true", help="time chat turn 2 (prompt cache)")
    p.add_argument("--conversations", type=int, default=3, help="with --second-turn")
    args = p.parse_args()
    if args.second_turn:
        r = second_turn(
            args.base_url, args.api_key, args.conversations, args.max_tokens, args.model
        )
        one, two = r["turn1_ttft_median"], r["turn2_ttft_median"]
        print(json.dumps(r) if args.json else f"TTFT turn 1 {one:.3f} s, turn 2 {two:.3f} s")
        return
    if args.json:
        rows = [
            run(args.base_url, args.api_key, c, args.requests, args.max_tokens, args.model)
            for c in args.concurrency
        ]
        print(json.dumps(rows))
        return
    print("| C | tokens | aggregate tok/s | TTFT median | TTFT p90 | ms/token |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in args.concurrency:
        r = run(args.base_url, args.api_key, c, args.requests, args.max_tokens, args.model)
        print(
            f"| {c} | {r['tokens']} | {r['tok_s']:.1f} | {r['ttft_median']:.3f} s "
            f"| {r['ttft_p90']:.3f} s | {r['ms_per_token']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
