"""Measure the launch path, the CPU path and the server in one run; write docs/benchmarks.md's
"Launch, CPU path and server" section (between its markers) and docs/benchmarks-wave2.json.

    .venv/bin/python bench/wave2.py --llama-cpp-python /path/to/venv/bin/python
    .venv/bin/python bench/wave2.py --only launch,cpu --out /tmp/x.md    # some parts only

Parts (each row is one command, as printed in the section):
- launch: 2 ranks of the built-in model started directly (MLX_RANK + a ring hostfile),
  through `python -m llama_tp.launch`, and through `mlx.launch`; the launchers' CPU time.
- cpu: the built-in model as stored (Q4_1) and with `--dtype float32` (OpenBLAS preloaded),
  `bfloat16`, `float16`, on 1 and 2 ranks; llama.cpp on the same GGUF through
  llama-cpp-python with 2 threads, in the same run (needs `--llama-cpp-python`: an
  interpreter of a venv where `pip install llama-cpp-python` built it).
- overhead: how much of a decode step is Python and graph building (bench/step_overhead.py).
- serve: `python -m llama_tp.serve` (1 and 2 ranks) driven by bench/serve_bench.py with
  C = 1, 4, 16 streaming clients, float32 + OpenBLAS and as stored, and `mlx_lm.server`
  on the same float32 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run_all import Run, _cpu_seconds, execute  # noqa: E402
from llama_tp.cluster.blas import find_openblas  # noqa: E402

BEGIN, END = "<!-- wave2:begin -->", "<!-- wave2:end -->"
BENCH = ["-p", "64", "-g", "32", "-n", "1", "--collective-steps", "0"]
PY = sys.executable


def launch_rows() -> list[tuple[str, Run]]:
    flags = ["-p", "32", "-g", "32", "-n", "1", "--collective-steps", "0"]
    return [
        ("direct start (MLX_RANK + hostfile)", Run("launch", flags, 2, compare=False)),
        ("python -m llama_tp.launch", Run("launch", flags, 2, compare=False, launcher="llama_tp")),
        ("mlx.launch", Run("launch", flags, 2, compare=False, launcher="mlx.launch")),
    ]


def execute_llama_tp_launch(run: Run, timeout: float) -> dict:
    """One row through `python -m llama_tp.launch` (its own CPU time sampled)."""
    cmd = [PY, "-m", "llama_tp.launch", "-n", str(run.ranks), "-m", *run.command()[2:]]
    tic = time.perf_counter()
    p = subprocess.Popen(
        cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    cpu = 0.0
    while p.poll() is None:
        cpu = _cpu_seconds(p.pid) or cpu
        time.sleep(0.2)
        if time.perf_counter() - tic > timeout:
            p.kill()
    out, err = p.communicate()
    lines = [x for x in out.decode().splitlines() if x.startswith("{")]
    if not lines:
        return {"error": err.decode()[-400:]}
    r = json.loads(lines[-1])
    r.update(wall_s=time.perf_counter() - tic, launcher_cpu_s=cpu)
    return r


def cpu_rows(openblas: str | None) -> list[tuple[str, Run]]:
    rows = []
    for ranks in (1, 2):
        rows.append(("as stored (Q4_1)", Run("cpu", BENCH, ranks, compare=False)))
        for dtype in ("float32", "bfloat16", "float16"):
            blas = "openblas" if dtype == "float32" and openblas else "reference"
            label = f"--dtype {dtype}" + (" + OpenBLAS" if blas == "openblas" else "")
            run = Run("cpu", [*BENCH, "--dtype", dtype], ranks, blas=blas, compare=False)
            run.env["OPENBLAS_NUM_THREADS"] = str(max(1, 2 // ranks))
            rows.append((label, run))
    return rows


def llama_cpp(python: str, gguf: Path) -> dict:
    code = (
        "import sys, time, json\n"
        "from llama_cpp import Llama\n"
        "llm = Llama(model_path=sys.argv[1], n_threads=2, n_ctx=512, verbose=False)\n"
        "prompt = list(range(100, 164))\n"
        "llm.eval(prompt[:8]); llm.reset()\n"  # warm-up
        "t = time.perf_counter(); llm.eval(prompt); tp = time.perf_counter() - t\n"
        "t = time.perf_counter()\n"
        "for _ in range(32): llm.eval([llm.sample(temp=0.0)])\n"
        "tg = time.perf_counter() - t\n"
        "print(json.dumps({'prompt_tps': 64 / tp, 'generation_tps': 32 / tg}))\n"
    )
    out = subprocess.run([python, "-c", code, str(gguf)], capture_output=True, text=True)
    if out.returncode:
        return {"error": out.stderr[-400:]}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    ver = subprocess.run(
        [python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        capture_output=True,
        text=True,
    )
    r["version"] = ver.stdout.strip()
    return r


def overhead(openblas: str | None) -> list[dict]:
    res = []
    for dtype in (None, "float32"):
        env = dict(os.environ)
        cmd = [PY, "bench/step_overhead.py", "-g", "32"]
        if dtype:
            cmd += ["--dtype", dtype]
            if openblas:
                env.update(LD_PRELOAD=openblas, OPENBLAS_NUM_THREADS="2")
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith("{")]
        res.append(json.loads(line[-1]) if line else {"error": out.stderr[-300:]})
    return res


def _wait_ready(url: str, timeout: float = 300) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1)
    return False


def serve_row(
    cmd: list[str], env: dict, port: int, health: str, conc: list[int], model: str = "bench"
) -> dict:
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        if not _wait_ready(f"http://127.0.0.1:{port}{health}"):
            return {"error": "the server did not start"}
        out = subprocess.run(
            [PY, "bench/serve_bench.py", "--base-url", f"http://127.0.0.1:{port}/v1"]
            + ["--concurrency", *map(str, conc), "--json", "--model", model],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        lines = [x for x in out.stdout.splitlines() if x.startswith("[") or x.startswith("{")]
        return {"results": json.loads(lines[-1])} if lines else {"error": out.stderr[-400:]}
    finally:
        os.killpg(p.pid, 15)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)


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
        row = serve_row(cmd, env, port, "/health", conc)
        row.update(label=label, command=" ".join(["python", *cmd[1:]]))
        rows.append(row)
    port += 1
    cmd = [PY, "-m", "mlx_lm.server", "--model", str(f32_dir), "--port", str(port)]
    row = serve_row(cmd, fast, port, "/v1/models", conc, model=str(f32_dir))
    row.update(label="mlx_lm.server, 1 rank, float32", command="python -m mlx_lm.server ...")
    rows.append(row)
    return rows


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def write_section(res: dict) -> str:
    md = [BEGIN, "", "## Launch, CPU path and server (one run)", ""]
    md.append(f"Machine: {res['machine']}; `{res['command']}`; {res['date']}.")
    if "launch" in res:
        md += [
            "",
            "### The launch path",
            "",
            "| start | generation tok/s | vs direct | launcher CPU / wall |",
            "| --- | --- | --- | --- |",
        ]
        direct = res["launch"][0].get("llama_tp", {}).get("generation_tps")
        for row in res["launch"]:
            g = row.get("llama_tp", {}).get("generation_tps")
            ratio = f"{g / direct:.2f}x" if g and direct else "-"
            cpu = row.get("launcher_cpu_s")
            share = f"{cpu / row['wall_s']:.0%}" if cpu is not None and row.get("wall_s") else "-"
            md.append(f"| {row['label']} | {_fmt(g, 2)} | {ratio} | {share} |")
        c = res["launch"][0].get("llama_tp", {}).get("collectives", {})
        if c:
            md += [
                "",
                f"Collectives per generated token (2 ranks, counted): {c['all_reduces_per_token']} "
                f"all-reduces ({c['all_reduces_per_layer']:.0f} per layer) + "
                f"{c['other_collectives_per_token']} sampling exchange that carries the next "
                "token's embedding row: 2 per layer + 1.",
            ]
    if "overhead" in res:
        md += [
            "",
            "### Graph building per decode step (1 rank)",
            "",
            "| weights | step | building the graph | share |",
            "| --- | --- | --- | --- |",
        ]
        for r in res["overhead"]:
            if "error" in r:
                continue
            md.append(
                f"| {r['dtype']} | {r['step_ms'][0]:.1f} ms | {r['graph_build_ms'][0]:.2f} ms "
                f"| {r['build_share'][0]:.1%} |"
            )
        md += [
            "",
            "Building the next step's graph overlaps the current step's evaluation "
            "(`mx.async_eval`), so the visible overhead is smaller still; `mx.compile` could "
            "remove at most this share, and the KV cache's in-place updates at a new offset "
            "every step would make it retrace every step: not compiled.",
        ]
    if "cpu" in res:
        md += [
            "",
            "### The CPU path (built-in model, prompt 64, generate 32)",
            "",
            "| weights | ranks | prompt tok/s | generation tok/s | peak memory per rank |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in res["cpu"]:
            lt = row.get("llama_tp", {})
            peak = ", ".join(f"{p:.2f}" for p in lt.get("peak_memory_gb", [])) or "-"
            md.append(
                f"| {row['label']} | {row['ranks']} | {_fmt(lt.get('prompt_tps'))} "
                f"| {_fmt(lt.get('generation_tps'))} | {peak} GB |"
            )
        lc = res.get("llama_cpp", {})
        if "generation_tps" in lc:
            md.append(
                f"| llama.cpp {lc['version']} (llama-cpp-python, Q4_1, 2 threads) | 1 "
                f"| {lc['prompt_tps']:.1f} | {lc['generation_tps']:.1f} | - |"
            )
            best = max(
                (r.get("llama_tp", {}).get("generation_tps") or 0, r["label"])
                for r in res["cpu"]
                if r["ranks"] == 2
            )
            md += [
                "",
                f"Fastest on 2 ranks: {best[1]}, {best[0]:.1f} tok/s = "
                f"{best[0] / lc['generation_tps']:.2f}x llama.cpp's generation.",
            ]
    if "serve" in res:
        md += ["", "### The server: aggregate generated tokens/s with C streaming clients", ""]
        conc = res["concurrency"]
        md.append("| server | " + " | ".join(f"C={c}" for c in conc) + " | TTFT median at C=max |")
        md.append("| --- |" + " --- |" * (len(conc) + 1))
        for row in res["serve"]:
            rs = {r["concurrency"]: r for r in row.get("results", [])}
            cells = [_fmt(rs[c]["tok_s"]) if c in rs else "-" for c in conc]
            ttft = rs[conc[-1]]["ttft_median"] if conc[-1] in rs else None
            md.append(f"| {row['label']} | " + " | ".join(cells) + f" | {_fmt(ttft, 2)} s |")
    md += ["", "Commands:", "", "```text"]
    md += res["commands"]
    md += ["```", "", END]
    return "\n".join(md) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-cpp-python", help="python of a venv with llama-cpp-python")
    p.add_argument("--only", default="launch,overhead,cpu,serve")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = p.parse_args()
    parts = set(args.only.split(","))
    openblas = find_openblas()
    res: dict = {
        "machine": (
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        ),
        "command": "python bench/wave2.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "commands": [],
        "concurrency": args.concurrency,
    }
    if "launch" in parts:
        res["launch"] = []
        for label, run in launch_rows():
            print(f"launch: {label}", file=sys.stderr, flush=True)
            if run.launcher == "llama_tp":
                row = execute_llama_tp_launch(run, 600)
                res["commands"].append(
                    f"python -m llama_tp.launch -n 2 -m llama_tp.bench {' '.join(run.model)} --json"
                )
            else:
                row = execute(run, 900)
                res["commands"].append(run.shell())
            row["label"] = label
            res["launch"].append(row)
    if "overhead" in parts:
        print("overhead", file=sys.stderr, flush=True)
        res["overhead"] = overhead(openblas)
        res["commands"].append("python bench/step_overhead.py -g 32 [--dtype float32]")
    if "cpu" in parts:
        res["cpu"] = []
        for label, run in cpu_rows(openblas):
            print(f"cpu: {label}, {run.ranks} rank(s)", file=sys.stderr, flush=True)
            row = execute(run, 900)
            row.update(label=label, ranks=run.ranks)
            res["cpu"].append(row)
            res["commands"].append(run.shell())
        if args.llama_cpp_python:
            from llama_tp import default_model

            res["llama_cpp"] = llama_cpp(args.llama_cpp_python, default_model())
            res["commands"].append("llama-cpp-python: Llama(model, n_threads=2).eval(...)")
    if "serve" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            f32 = Path(tmp) / "f32"
            subprocess.run(
                [PY, "-m", "llama_tp.convert", "--dtype", "float32", "--out", str(f32)],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
            print("serve", file=sys.stderr, flush=True)
            res["serve"] = serve_rows(openblas, f32, args.concurrency)
        res["commands"] += [r["command"] for r in res["serve"]]
        res["commands"].append(
            "python bench/serve_bench.py --base-url http://127.0.0.1:PORT/v1 "
            f"--concurrency {' '.join(map(str, args.concurrency))}"
        )
    (ROOT / "docs" / "benchmarks-wave2.json").write_text(json.dumps(res, indent=1) + "\n")
    out = Path(args.out)
    text = out.read_text() if out.exists() else ""
    section = write_section(res)
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END) + "\n?", section, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
