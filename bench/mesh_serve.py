"""The server on 2 ranks laid out three ways, and the pipeline's micro-batched prefill.

    python bench/mesh_serve.py --model F32_DIR [--json]

1. Serving: one process, then 2 ranks as `--tp 2`, `--pp 2` and `--dp 2`, each driven
   by `bench/serve_bench.py`'s clients (concurrency 1 and 8, greedy, 48 tokens): the
   aggregate generated tokens/s and the median time to first token.
2. Prefill on `--pp 2`: `bench` with a 1,024-token prompt, micro-batched (the default)
   and in one piece (`LLAMA_TP_PP_MICRO_BATCHES=1`), alternated, twice each.

Ranks are started by `python -m llama_tp.launch` (OpenBLAS preloaded when installed,
one thread per rank; the one process gets it preloaded too, with two threads).
Prints a markdown table per part (or one JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

from llama_tp.benchmarks.serve_clients import run
from llama_tp.benchmarks.servers import wait_ready
from llama_tp.cluster.blas import find_openblas

PY = sys.executable
LAUNCH = [PY, "-m", "llama_tp.launch", "-n", "2"]
MESHES = {"1 process": [], "--tp 2": ["--tp", "2"], "--pp 2": ["--pp", "2"]}
MESHES["--dp 2"] = ["--dp", "2"]


def serve(model: str, mesh: list[str], port: int) -> subprocess.Popen:
    args = ["-m", "llama_tp.serve", "--model", model, "--port", str(port), "--quiet"]
    if mesh:
        cmd = [*LAUNCH, "--starting-port", str(port + 100), "--", PY, *args, *mesh]
    else:
        cmd = [PY, *args]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1" if mesh else "2"}
    if not mesh and find_openblas():  # as the launcher does for its ranks
        env["LD_PRELOAD"] = find_openblas()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    if wait_ready(f"http://127.0.0.1:{port}/health"):
        return p
    os.killpg(p.pid, signal.SIGKILL)
    raise TimeoutError(f"server {mesh} not ready")


def serving(model: str) -> list[dict]:
    rows = []
    for i, (name, mesh) in enumerate(MESHES.items()):
        port = 18600 + 10 * i
        p = serve(model, mesh, port)
        try:
            base = f"http://127.0.0.1:{port}/v1"
            run(base, "none", 1, 1, 8)  # warm-up
            for c in (1, 8):
                r = run(base, "none", c, 2 if c == 1 else 1, 48)
                rows.append({"mesh": name, **r})
                print(json.dumps(rows[-1]), file=sys.stderr)
        finally:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(30)
    return rows


def prefill(model: str, rounds: int = 2) -> list[dict]:
    rows = []
    for i in range(rounds):
        for micro in ("default", "1"):
            env = {**os.environ}
            if micro == "1":
                env["LLAMA_TP_PP_MICRO_BATCHES"] = "1"
            cmd = [*LAUNCH, "--starting-port", str(18800 + 20 * i), "--", PY, "-m"]
            cmd += ["llama_tp.bench", "--model", model, "--pp", "2", "-p", "1024", "-g", "4"]
            cmd += ["-n", "2", "--collective-steps", "0", "--json"]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            r = json.loads(out.stdout.strip().splitlines()[-1])["llama_tp"]
            rows.append({"micro_batches": micro, "prompt_tps": r["prompt_tps"]})
            rows[-1]["ttft_s"] = r["ttft_s"]
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="e.g. convert -d --dtype float32 --out DIR")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    result = {"serving": serving(args.model), "prefill": prefill(args.model)}
    if args.json:
        print(json.dumps(result))
        return
    print("| mesh (2 ranks) | clients | generated tokens/s | median time to first token |")
    print("| --- | --- | --- | --- |")
    for r in result["serving"]:
        print(f"| {r['mesh']} | {r['concurrency']} | {r['tok_s']:.1f} | {r['ttft_median']:.2f} s |")
    print()
    print("| --pp 2 prefill, 1,024 tokens | prompt tokens/s | time to first token |")
    print("| --- | --- | --- |")
    for r in result["prefill"]:
        name = "micro-batches (default)" if r["micro_batches"] == "default" else "one piece"
        print(f"| {name} | {r['prompt_tps']:.0f} | {r['ttft_s']:.2f} s |")


if __name__ == "__main__":
    main()
