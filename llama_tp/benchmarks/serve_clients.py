"""Streaming openai clients against a running OpenAI-compatible server (llama_tp's,
mlx_lm.server): C concurrent clients' aggregate tokens/s and times to first token, and
the second turn of a chat (what the prompt cache saves). bench/serve_bench.py is the
command; bench/serving.py and bench/mesh_serve.py drive servers with it."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

MODEL = "bench"  # llama_tp serves one model whatever the name; mlx_lm.server wants its path


def one_request(
    client, prompt: str, max_tokens: int, model: str = MODEL
) -> tuple[float, float, int]:
    """(time to first token, total seconds, tokens) of one streamed chat completion."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(
        model=model,
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


def _stream(client, messages: list[dict], max_tokens: int, model: str) -> tuple[float, str]:
    """(time to first token, reply text) of one streamed greedy chat completion."""
    t0, first, text = time.perf_counter(), None, []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
    return (first if first is not None else time.perf_counter() - t0), "".join(text)


def second_turn(
    base_url: str, api_key: str, conversations: int, max_tokens: int, model: str = MODEL
) -> dict:
    """Median time to first token of turn 1 and of turn 2 over `conversations` chats."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, timeout=600, max_retries=0)
    first, second = [], []
    for i in range(conversations):
        messages = [{"role": "user", "content": f"Note {i}. " + PASSAGE * 4 + "Summarise."}]
        ttft, reply = _stream(client, messages, max_tokens, model)
        first.append(ttft)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Now in one sentence."},
        ]
        second.append(_stream(client, messages, max_tokens, model)[0])
    return {
        "conversations": conversations,
        "turn1_ttft_median": statistics.median(first),
        "turn2_ttft_median": statistics.median(second),
    }


def run(
    base_url: str, api_key: str, c: int, requests: int, max_tokens: int, model: str = MODEL
) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, timeout=600, max_retries=0)
    prompts = [f"Request {i}: tell me about the number {i * 7}." for i in range(c * requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        results = list(pool.map(lambda p: one_request(client, p, max_tokens, model), prompts))
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
