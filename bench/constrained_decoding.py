"""The cost of constrained decoding: decode tokens/s of the built-in model's server with
and without a JSON schema (`response_format`, llguidance's mask on every step), on 1
and 2 ranks; writes the section "Constrained decoding" of docs/benchmarks.md and
docs/benchmarks/constrained-decoding.json.

    .venv/bin/python bench/constrained_decoding.py
    .venv/bin/python bench/constrained_decoding.py --rounds 5 --out /tmp/x.md

Each round sends the same greedy chat request twice in turn, plain and with the
schema (an array of at least 40 cities, so that the reply runs to max_tokens); a
request's rate is its streamed tokens after the first over the time between the
first and the last chunk, and its tokens per CPU second of the server's processes
(every rank's; steadier than the wall clock on a shared machine). The ratios are
the medians of the rounds' paired ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from llama_tp.benchmarks import sections
from llama_tp.benchmarks.processes import cpu_seconds
from llama_tp.benchmarks.servers import start, stop, wait_ready

NAME = "constrained-decoding"
PY = sys.executable
PROMPT = "List forty large cities of the world with their countries, as JSON."
SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "minItems": 40,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "country": {"type": "string", "maxLength": 40},
                },
                "required": ["name", "country"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["cities"],
    "additionalProperties": False,
}


def _group_cpu(pgid: int) -> float:
    """CPU seconds of every process in the server's process group (its ranks)."""
    total = 0.0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    total += cpu_seconds(int(d.name)) or 0.0
            except (OSError, ValueError):
                pass
    return total


def _rate(client, max_tokens: int, schema: bool, pgid: int = 0) -> tuple[float, int, float]:
    """(decode tokens/s, tokens, tokens per CPU second) of one streamed greedy request."""
    cpu = _group_cpu(pgid) if pgid else 0.0
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "cities",
             "schema": SCHEMA}}} if schema else {}  # fmt: skip
    stream = client.chat.completions.create(
        model="bench",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    first = last = None
    tokens = 0
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        elif chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
    cpu = _group_cpu(pgid) - cpu if pgid else 0.0
    return (tokens - 1) / (last - first), tokens, tokens / cpu if cpu else 0.0


def measure(ranks: int, port: int, rounds: int, max_tokens: int) -> dict:
    import openai

    serve = ["-m", "llama_tp.serve", "--port", str(port)]
    cmd = [PY, *serve]
    if ranks > 1:
        cmd = [PY, "-m", "llama_tp.launch", "-n", str(ranks), "--starting-port", str(port + 100)]
        cmd += serve
    p = start(cmd, dict(os.environ))
    try:
        if not wait_ready(f"http://127.0.0.1:{port}/health"):
            return {"ranks": ranks, "error": "the server did not start"}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=600)
        _rate(client, 8, True)  # warm-up: llguidance's tokenizer, the first forwards
        plain, constrained, ratios, tokens, per_cpu = [], [], [], [], []
        for r in range(rounds):
            a, n_a, cpu_a = _rate(client, max_tokens, False, p.pid)
            b, n_b, cpu_b = _rate(client, max_tokens, True, p.pid)
            plain.append(a), constrained.append(b), ratios.append(b / a)
            tokens.append((n_a, n_b)), per_cpu.append((cpu_a, cpu_b))
            print(
                f"{ranks} rank(s), round {r + 1}: {a:.1f} vs {b:.1f} tok/s, "
                f"{cpu_a:.1f} vs {cpu_b:.1f} tokens per CPU second",
                file=sys.stderr,
            )
        return {
            "ranks": ranks,
            "command": " ".join(["python", *cmd[1:]]),
            "plain_tps": plain,
            "schema_tps": constrained,
            "ratios": ratios,
            "tokens": tokens,
            "tokens_per_cpu_s": per_cpu,
        }
    finally:
        stop(p)


def section(res: dict) -> str:
    md = ["### Constrained decoding (JSON schema, built-in model)", ""]
    md += [sections.facts_line(res), f"Load average before the run: {res['load']}.", ""]
    md += [
        f"Greedy chat replies of up to {res['max_tokens']} tokens, streamed; decode "
        f"tokens/s (median of {res['rounds']} rounds, each a plain request and one with "
        "`response_format` `json_schema`, in turn); the ratio is the median of the "
        "rounds' paired ratios (target: >= 0.8x). Tokens per CPU second count every "
        "rank's CPU time over the request (prefill included): on a shared machine the "
        "steadier of the two.",
        "",
        "| ranks | plain tok/s | JSON schema tok/s | ratio (rounds) | tokens per CPU s, "
        "plain / schema | ratio (rounds) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in res["rows"]:
        if "error" in row:
            md.append(f"| {row['ranks']} | {row['error']} | | |")
            continue
        spread = ", ".join(f"{r:.2f}" for r in row["ratios"])
        cpu = row["tokens_per_cpu_s"]
        cpu_ratios = [b / a for a, b in cpu]
        md.append(
            f"| {row['ranks']} | {statistics.median(row['plain_tps']):.1f} | "
            f"{statistics.median(row['schema_tps']):.1f} | "
            f"{statistics.median(row['ratios']):.2f}x ({spread}) | "
            f"{statistics.median(a for a, _ in cpu):.1f} / "
            f"{statistics.median(b for _, b in cpu):.1f} | "
            f"{statistics.median(cpu_ratios):.2f}x ({', '.join(f'{r:.2f}' for r in cpu_ratios)}) |"
        )
    md += ["", "```sh", *(r["command"] for r in res["rows"] if "command" in r), "```"]
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--port", type=int, default=12500)
    p.add_argument("--out", default=str(sections.PAGE), help="the page whose section to rewrite")
    args = p.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    res = {**sections.run_facts("bench/constrained_decoding.py"), "load": load}
    res.update(rounds=args.rounds, max_tokens=args.max_tokens, rows=[])
    for i, ranks in enumerate((1, 2)):
        res["rows"].append(measure(ranks, args.port + 10 * i, args.rounds, args.max_tokens))
    sections.write_results(NAME, res)
    sections.replace_section(NAME, section(res), args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
