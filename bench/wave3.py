"""Speculative decoding, sequence-parallel prefill memory, the server's prompt cache and
the MPI backend, in one run; writes docs/benchmarks.md's section between its
`wave3` markers and docs/benchmarks-wave3.json.

    .venv/bin/python bench/wave3.py                    # everything (~15 min here)
    .venv/bin/python bench/wave3.py --only spec,sp --out /tmp/x.md

Parts (each row one command, as printed in the section):
- spec: `python -m llama_tp.bench --prompt TEXT [--draft ngram|DRAFT_DIR]` on the built-in model
  as stored (Q4_1) and with `--dtype float32` weights (a converted float32 copy,
  OpenBLAS preloaded), 1 and 2 ranks started directly, a free-form question and a
  "repeat this passage" prompt (bench/spec_bench.py's rows).
- sp: peak memory per rank of a 2,048-token prefill on the synthetic 0.1B fp32 model,
  2 ranks, with and without `--sequence-parallel`.
- cache: `python -m llama_tp.serve` (1 rank, float32) and the second turn of a chat
  (bench/serve_bench.py --second-turn) with and without the prompt cache.
- mpi: 2 ranks of the float32 built-in model on the ring backend (direct start) and on
  MPI (`mpirun`, Open MPI's shared-memory transport), 1 rank beside them.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import spec_bench  # noqa: E402
from bench.run_all import Run, execute  # noqa: E402
from bench.wave2 import _wait_ready  # noqa: E402
from llama_tp.cluster.blas import find_openblas  # noqa: E402

BEGIN, END = "<!-- wave3:begin -->", "<!-- wave3:end -->"
PY = sys.executable


def layer_skip_draft(f32: Path, out: Path, layers: int = 8) -> Path:
    """The first `layers` layers of the float32 model with its norm and head: the only
    draft model sharing SmolLM2's tokenizer on a machine without a model hub."""
    import shutil

    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    weights = mx.load(str(f32 / "model.safetensors"))
    keep = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    mx.save_safetensors(str(out / "model.safetensors"), keep, metadata={"format": "mlx"})
    config = json.loads((f32 / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in f32.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def spec_rows(f32: Path, gguf: str, g: int, draft_model: Path) -> list[dict]:
    a = argparse.Namespace(g=g, n=1, k=6, k_model=3, timeout=1200, openblas=False)
    rows = []
    for label, model, blas in (("float32 + OpenBLAS", str(f32), True), ("Q4_1", gguf, False)):
        a.openblas = blas
        for ranks in (1, 2):
            for kind in ("question", "repeat"):
                for draft in (None, "ngram", str(draft_model)):
                    print(f"spec: {label} {ranks} {kind} {draft}", file=sys.stderr, flush=True)
                    r = spec_bench.run_row(model, ranks, spec_bench.PROMPTS[kind], draft, a)
                    t = (r or {}).get("llama_tp", {})
                    rows.append(
                        {"weights": label, "ranks": ranks, "prompt": kind, "draft": draft, **t}
                    )
    return rows


def sp_rows() -> list[dict]:
    flags = ["--synthetic", "0.1b-fp32", "-p", "2048", "-g", "2", "-n", "1"]
    flags += ["--collective-steps", "0"]
    rows = []
    for sp in (False, True):
        run = Run("sp", flags + (["--sequence-parallel"] if sp else []), 2, "openblas", False)
        print(f"sp: {sp}", file=sys.stderr, flush=True)
        r = execute(run, 1800)
        rows.append({"sequence_parallel": sp, "command": run.shell(), **r})
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
        p = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            if not _wait_ready(f"http://127.0.0.1:{port}/health"):
                rows.append({"prompt_cache_size": size, "error": "the server did not start"})
                continue
            out = subprocess.run(
                [PY, "bench/serve_bench.py", "--base-url", f"http://127.0.0.1:{port}/v1"]
                + ["--second-turn", "--conversations", "3", "--max-tokens", "32", "--json"],
                cwd=ROOT, capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            line = [x for x in out.stdout.splitlines() if x.startswith("{")]
            r = json.loads(line[-1]) if line else {"error": out.stderr[-400:]}
            rows.append({"prompt_cache_size": size, **r})
        finally:
            os.killpg(p.pid, 15)
            p.wait(30)
    return rows


def mpi_rows(f32: Path, openblas: str | None) -> list[dict]:
    flags = ["--model", str(f32), "-p", "64", "-g", "32", "-n", "1", "--collective-steps", "0"]
    rows = []
    for label, ranks in (("1 rank", 1), ("2 ranks, ring (direct start)", 2)):
        print(f"mpi: {label}", file=sys.stderr, flush=True)
        run = Run("mpi", flags, ranks, "openblas" if openblas else "reference", False)
        run.env["OPENBLAS_NUM_THREADS"] = "1" if ranks == 2 else "2"
        rows.append({"label": label, "command": run.shell(), **execute(run, 900)})
    print("mpi: mpirun", file=sys.stderr, flush=True)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    preload = ["-x", f"LD_PRELOAD={openblas}"] if openblas else []
    cmd = ["mpirun", "-n", "2", "-x", "OPENBLAS_NUM_THREADS=1", *preload]
    cmd += [PY, "-m", "llama_tp.bench", *flags, "--json"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")]
    r = json.loads(line[-1]) if line else {"error": out.stderr[-400:]}
    shown = "mpirun -n 2 -x OPENBLAS_NUM_THREADS=1 -x LD_PRELOAD=$OPENBLAS "
    shown += "python -m llama_tp.bench "
    rows.append({"label": "2 ranks, MPI (mpirun)", "command": shown + " ".join(flags), **r})
    return rows


def _drafter(draft: str | None) -> str:
    if draft is None:
        return "-"
    return "ngram (K=6)" if draft == "ngram" else "draft model: 8 of 30 layers (K=3)"


def _t(row: dict, key: str) -> float | None:
    return (row.get("llama_tp") or row).get(key)


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def write_section(res: dict) -> str:
    md = [BEGIN, "", "## Speculative decoding, sequence parallelism, prompt cache, MPI (one run)"]
    md += ["", f"Machine: {res['machine']}; `{res['command']}`; {res['date']}.", ""]
    if "spec" in res:
        md += ["### Speculative decoding (prompt lookup)", ""]
        md += ["F32_DIR: `python -m llama_tp.convert -d --dtype float32 --out F32_DIR`."]
        md += ["The draft model is F32_DIR's first 8 layers with its norm and head"]
        md += ["(`layer_skip_draft` in bench/wave3.py): SmolLM2-135M is the only model with"]
        md += ["its tokenizer on this machine, so no trained small draft exists here."]
        md += ["Greedy, 48 new tokens, end-of-sequence ignored; ranks started directly,"]
        md += ["`OPENBLAS_NUM_THREADS=1`. Rounds = collective rounds per generated token.", ""]
        md += ["| weights | ranks | prompt | drafter | gen tok/s | vs plain | acceptance "]
        md[-1] += "| tokens/forward | rounds/token |"
        md += ["| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        base = None
        for r in res["spec"]:
            tps = r.get("generation_tps")
            base = tps if r["draft"] is None else base
            sp = r.get("speculative") or {}
            acc = f"{100 * sp['acceptance_rate']:.0f}%" if sp else "-"
            vs = f"{tps / base:.2f}x" if tps and base else "-"
            md.append(
                f"| {r['weights']} | {r['ranks']} | {r['prompt']} | {_drafter(r['draft'])} | "
                f"{_f(tps)} | {vs} | {acc} | {_f(sp.get('tokens_per_forward', 1.0))} | "
                f"{_f(r.get('rounds_per_token'), 1)} |"
            )
        md += ["", "`python bench/spec_bench.py --model DIR_OR_GGUF --ranks 1 2 [--openblas] "]
        md[-1] += "-g 48 -n 1` runs the same rows."
        md += [""]
    if "sp" in res:
        md += ["### Sequence-parallel prefill memory (2,048 tokens, 2 ranks)", ""]
        md += ["Per rank (the larger of the two ranks'):", ""]
        md += ["| per rank | plain tensor parallel | --sequence-parallel | ratio |"]
        md += ["| --- | --- | --- | --- |"]
        a, b = (r.get("llama_tp", {}) for r in res["sp"])
        for key, label in (("activation_peak_gb", "peak above the weights (activations)"),
                           ("peak_memory_gb", "peak memory")):  # fmt: skip
            x, y = (max(v) if isinstance(v, list) else v for v in (a.get(key), b.get(key)))
            ratio = f"{y / x:.2f}x" if x and y else "-"
            md.append(f"| {label} | {_f(x, 3)} GB | {_f(y, 3)} GB | {ratio} |")
        md += ["", "```text", *(r["command"] for r in res["sp"]), "```", ""]
    if "cache" in res:
        md += ["### Server: second chat turn, with and without the prompt cache", ""]
        md += ["1 rank, float32 weights, OpenBLAS; median of 3 two-turn chats (turn 1 a"]
        md += ["~400-token message, turn 2 resends it with the reply and a question).", ""]
        md += ["| --prompt-cache-size | turn 1 TTFT | turn 2 TTFT |", "| --- | --- | --- |"]
        for r in res["cache"]:
            md.append(
                f"| {r['prompt_cache_size']} | {_f(r.get('turn1_ttft_median'), 3)} s | "
                f"{_f(r.get('turn2_ttft_median'), 3)} s |"
            )
        md += ["", "```text", "python -m llama_tp.serve --model F32_DIR --prompt-cache-size N &"]
        md += ["python bench/serve_bench.py --second-turn --conversations 3 --max-tokens 32"]
        md += ["```", ""]
    if "mpi" in res:
        md += ["### Ring or MPI on one machine (float32 + OpenBLAS, prompt 64, generate 32)", ""]
        md += ["| start | prompt tok/s | generation tok/s |", "| --- | --- | --- |"]
        for r in res["mpi"]:
            md.append(
                f"| {r['label']} | {_f(_t(r, 'prompt_tps'), 1)} | "
                f"{_f(_t(r, 'generation_tps'), 1)} |"
            )
        md += ["", "```text", *(r["command"] for r in res["mpi"]), "```", ""]
    md += [END]
    return "\n".join(md) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="spec,sp,cache,mpi")
    p.add_argument("-g", type=int, default=48, help="generated tokens per speculative row")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = p.parse_args()
    parts = set(args.only.split(","))
    openblas = find_openblas()
    res: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "command": "python bench/wave3.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
    }
    from llama_tp import default_model

    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32"
        if parts & {"spec", "cache", "mpi"}:
            subprocess.run(
                [PY, "-m", "llama_tp.convert", "-d", "--dtype", "float32", "--out", str(f32)]
                + ["--quiet"],
                cwd=ROOT, check=True,
            )  # fmt: skip
        if "spec" in parts:
            draft = layer_skip_draft(f32, Path(tmp) / "draft8")
            res["spec"] = spec_rows(f32, str(default_model()), args.g, draft)
        if "sp" in parts:
            res["sp"] = sp_rows()
        if "cache" in parts:
            res["cache"] = cache_rows(f32, openblas)
        if "mpi" in parts:
            res["mpi"] = mpi_rows(f32, openblas)
    # the float32 copy lived in a temporary directory: name it as the README does
    section = re.sub(r"\S*/f32\b", "F32_DIR", write_section(res))
    out = Path(args.out)
    text = out.read_text() if out.exists() else ""
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END) + "\n?", lambda _: section, text,
                      flags=re.S)  # fmt: skip
    else:
        text += "\n" + section
    out.write_text(text)
    (ROOT / "docs" / "benchmarks-wave3.json").write_text(json.dumps(res, indent=1) + "\n")
    print(section)


if __name__ == "__main__":
    main()
