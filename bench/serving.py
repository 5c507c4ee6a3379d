"""The server: aggregate generated tokens/s with C streaming clients (`python -m
llama_tp.serve` on 1 and 2 ranks, float32 + OpenBLAS and as stored, and mlx_lm.server on
the same float32 weights), and a chat's second turn with and without the prompt cache;
writes the sections "The server" and "Server: second chat turn" of docs/benchmarks.md
and docs/benchmarks/serving.json, docs/benchmarks/prompt-cache.json.

    .venv/bin/python bench/serving.py
    .venv/bin/python bench/serving.py --only cache --out /tmp/x.md    # some parts only
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from llama_tp.benchmarks import sections
from llama_tp.benchmarks.serve_clients import second_turn
from llama_tp.benchmarks.servers import serve_row, start, stop, wait_ready
from llama_tp.cluster.blas import find_openblas

PY = sys.executable


def serve_rows(openblas: str | None, f32_dir: Path, conc: list[int]) -> list[dict]:
    rows = []
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",)}
    fast = dict(base, OPENBLAS_NUM_THREADS="1")
    if openblas:
        fast["LD_PRELOAD"] = openblas
    port = 18600 + os.getpid() % 200
    cases = [
        ("llama_tp, 1 rank, --dtype float32", 1, ["--dtype", "float32"], fast),
        ("llama_tp, 2 ranks, --dtype float32", 2, ["--dtype", "float32"], fast),
        ("llama_tp, 1 rank, as stored (Q4_1)", 1, [], base),
    ]
    for label, n, extra, env in cases:
        port += 1
        serve = ["-m", "llama_tp.serve", "--port", str(port), "--max-batch", "16", *extra]
        if n == 1:
            cmd = [PY, *serve]
        else:
            cmd = [PY, "-m", "llama_tp.launch", "-n", str(n), "--starting-port", str(port + 100)]
            cmd += serve
        print(f"serve: {label}", file=sys.stderr, flush=True)
        row = serve_row(cmd, env, port, "/health", conc)
        row.update(label=label, command=" ".join(["python", *cmd[1:]]))
        rows.append(row)
    port += 1
    cmd = [PY, "-m", "mlx_lm.server", "--model", str(f32_dir), "--port", str(port)]
    print("serve: mlx_lm.server", file=sys.stderr, flush=True)
    row = serve_row(cmd, fast, port, "/v1/models", conc, model=str(f32_dir))
    row.update(label="mlx_lm.server, 1 rank, float32", command=" ".join(["python", *cmd[1:]]))
    rows.append(row)
    return rows


def cache_rows(f32: Path, openblas: str | None) -> list[dict]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    if openblas:
        env["LD_PRELOAD"] = openblas
    rows, port = [], 18900 + os.getpid() % 50
    for size in (10, 0):
        port += 1
        cmd = [PY, "-m", "llama_tp.serve", "--model", str(f32), "--port", str(port)]
        cmd += ["--prompt-cache-size", str(size)]
        print(f"cache: --prompt-cache-size {size}", file=sys.stderr, flush=True)
        p = start(cmd, env)
        try:
            if not wait_ready(f"http://127.0.0.1:{port}/health"):
                rows.append({"prompt_cache_size": size, "error": "the server did not start"})
                continue
            r = second_turn(f"http://127.0.0.1:{port}/v1", "none", 3, 32)
            rows.append({"prompt_cache_size": size, **r})
        finally:
            stop(p)
    return rows


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def serve_section(res: dict) -> str:
    md = ["### The server: aggregate generated tokens/s with C streaming clients", ""]
    md += [sections.facts_line(res), ""]
    conc = res["concurrency"]
    md.append("| server | " + " | ".join(f"C={c}" for c in conc) + " | TTFT median at C=max |")
    md.append("| --- |" + " --- |" * (len(conc) + 1))
    for row in res["serve"]:
        rs = {r["concurrency"]: r for r in row.get("results", [])}
        cells = [_f(rs[c]["tok_s"]) if c in rs else "-" for c in conc]
        ttft = rs[conc[-1]]["ttft_median"] if conc[-1] in rs else None
        md.append(f"| {row['label']} | " + " | ".join(cells) + f" | {_f(ttft, 2)} s |")
    md += ["", "```sh", *(r["command"] for r in res["serve"])]
    md += [
        f"python bench/serve_bench.py --base-url http://127.0.0.1:PORT/v1 --concurrency "
        f"{' '.join(map(str, conc))}",
        "```",
    ]
    return "\n".join(md)


def cache_section(res: dict) -> str:
    md = ["### Server: second chat turn, with and without the prompt cache", ""]
    md += [sections.facts_line(res), ""]
    md += ["1 rank, float32 weights, OpenBLAS; median of 3 two-turn chats (turn 1 a"]
    md += ["~400-token message, turn 2 resends it with the reply and a question).", ""]
    md += ["| --prompt-cache-size | turn 1 TTFT | turn 2 TTFT |", "| --- | --- | --- |"]
    for r in res["cache"]:
        md.append(
            f"| {r['prompt_cache_size']} | {_f(r.get('turn1_ttft_median'), 3)} s | "
            f"{_f(r.get('turn2_ttft_median'), 3)} s |"
        )
    md += ["", "```sh", "python -m llama_tp.serve --model F32_DIR --prompt-cache-size 10"]
    md += ["python -m llama_tp.serve --model F32_DIR --prompt-cache-size 0"]
    md += ["python bench/serve_bench.py --second-turn --conversations 3 --max-tokens 32", "```"]
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="serve,cache", help="parts: serve, cache")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--out", default=str(sections.PAGE), help="the page whose sections to rewrite")
    args = p.parse_args()
    parts = set(args.only.split(","))
    openblas = find_openblas()
    facts = sections.run_facts("bench/serving.py")
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32"
        convert = [PY, "-m", "llama_tp.convert", "-d", "--dtype", "float32", "--out", str(f32)]
        subprocess.run([*convert, "--quiet"], check=True)
        # the float32 copy lives in a temporary directory: name it as the docs do
        hide = lambda md: re.sub(r"\S*/f32\b", "F32_DIR", md)  # noqa: E731
        if "serve" in parts:
            res = {**facts, "concurrency": args.concurrency}
            res["serve"] = serve_rows(openblas, f32, args.concurrency)
            sections.write_results("serving", res)
            sections.replace_section("serving", hide(serve_section(res)), args.out)
        if "cache" in parts:
            res = {**facts, "cache": cache_rows(f32, openblas)}
            sections.write_results("prompt-cache", res)
            sections.replace_section("prompt-cache", hide(cache_section(res)), args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
