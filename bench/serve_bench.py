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
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

MODEL = "bench"  # llama_tp serves one model whatever the name; mlx_lm.server wants its path


def one_request(client, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, total seconds, tokens) of one streamed chat completion."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        elif first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, tokens


PASSAGE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. It is "
    "named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889 as the centerpiece of the World's Fair. Although criticised at first "
    "by some of France's leading artists, it has become a global cultural icon of France. "
)


def _stream(client, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(time to first token, reply text) of one streamed greedy chat completion."""
    t0, first, text = time.perf_counter(), None, []
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
    return (first if first is not None else time.perf_counter() - t0), "".join(text)


def second_turn(base_url: str, api_key: str, conversations: int, max_tokens: int) -> dict:
    """Median time to first token of turn 1 and of turn 2 over `conversations` chats."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, timeout=600, max_retries=0)
    first, second = [], []
    for i in range(conversations):
        messages = [{"role": "user", "content": f"Note {i}. " + PASSAGE * 4 + "Summarise."}]
        ttft, reply = _stream(client, messages, max_tokens)
        first.append(ttft)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Now in one sentence."},
        ]
        second.append(_stream(client, messages, max_tokens)[0])
    return {
        "conversations": conversations,
        "turn1_ttft_median": statistics.median(first),
        "turn2_ttft_median": statistics.median(second),
    }


def run(base_url: str, api_key: str, c: int, requests: int, max_tokens: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, timeout=600, max_retries=0)
    prompts = [f"Request {i}: tell me about the number {i * 7}." for i in range(c * requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        results = list(pool.map(lambda p: one_request(client, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in results)
    per_token = [(r[1] - r[0]) / (r[2] - 1) for r in results if r[2] > 1]
    return {
        "concurrency": c,
        "tokens": sum(r[2] for r in results),
        "tok_s": sum(r[2] for r in results) / wall,
        "ttft_median": statistics.median(ttft),
        "ttft_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "ms_per_token": 1000 * statistics.mean(per_token) if per_token else float("nan"),
    }


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
    global MODEL
    MODEL = args.model
    if args.second_turn:
        r = second_turn(args.base_url, args.api_key, args.conversations, args.max_tokens)
        one, two = r["turn1_ttft_median"], r["turn2_ttft_median"]
        print(json.dumps(r) if args.json else f"TTFT turn 1 {one:.3f} s, turn 2 {two:.3f} s")
        return
    if args.json:
        rows = [
            run(args.base_url, args.api_key, c, args.requests, args.max_tokens)
            for c in args.concurrency
        ]
        print(json.dumps(rows))
        return
    print("| C | tokens | aggregate tok/s | TTFT median | TTFT p90 | ms/token |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in args.concurrency:
        r = run(args.base_url, args.api_key, c, args.requests, args.max_tokens)
        print(
            f"| {c} | {r['tokens']} | {r['tok_s']:.1f} | {r['ttft_median']:.3f} s "
            f"| {r['ttft_p90']:.3f} s | {r['ms_per_token']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
