"""Generation speed on the CPU with llama_tp's native kernels, against MLX's kernel,
float32 + OpenBLAS and llama.cpp; and the kernels' weight bandwidth against the machine's.

    python bench/cpu_kernels.py --quantize PATH/TO/llama-quantize [--rounds 3] [-g 64]

- Bandwidth: `read_bandwidth` (a plain read of 512 MB over the kernels' own threads) and
  one matrix-vector product per format on ~130 MB of random weights (far over the
  caches), 1 and 2 threads; weight bytes (scales included) per second.
- Generation: `python -m llama_tp.bench` (-p 16, -g G, end-of-sequence ignored) of the
  built-in Q4_1 model and its Q4_K_M requantization (made here with `--quantize`, as
  tests/data/make_llama_cpp_ggufs.py makes its files: llama.cpp's own quantizer, from the
  built-in model) on 1 and 2 ranks (`python -m llama_tp.launch -n N`: OpenBLAS preloaded,
  threads per rank = cores / ranks) with the native kernels, with MLX's kernel
  (LLAMA_TP_KERNELS=mlx) and with --dtype float32; llama.cpp through llama-cpp-python with
  1 and 2 threads on the same files, greedy, G tokens. Every configuration runs once per
  round, in turn, so that a busy machine slows them alike; the median of the rounds.

Writes docs/benchmarks-cpu-kernels.json (--out) and prints the markdown table.
llama-cpp-python's build (its flags are reported with its figures):
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON" pip install llama-cpp-python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
LLAMA_CPP_FLAGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON"
FORMATS = ("Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K", "affine4")  # what the two files hold
WEIGHT_BYTES = 130 << 20


def bandwidth() -> dict:
    """GB/s of reading memory and of each format's product, at 1 and 2 threads."""
    import mlx.core as mx
    import numpy as np

    from llama_tp import kernels
    from llama_tp.kernels import GGUF_TYPES, native
    from llama_tp.kernels.blocks import random_blocks

    st = kernels.status()
    if not st.native:
        raise SystemExit(f"the native kernels are off: {st.reason}")
    ext = native.ext()
    rng = np.random.default_rng(0)
    k = 4096
    out = {"isa": ext.isa(), "read": {}, "formats": {}}
    products = {}
    for f in FORMATS:
        if f == "affine4":  # MLX 4-bit, group 64 (an MLX-quantized checkpoint's)
            rows = WEIGHT_BYTES // (k // 2 + k // 64 * 4)
            w = rng.integers(0, 2**32, size=(rows, k // 8), dtype=np.uint32)
            s = mx.array(rng.uniform(0.001, 0.01, (rows, k // 64)).astype(np.float16))
            arrays = (mx.array(w), s, -8 * s)
            nbytes = sum(a.nbytes for a in arrays)
            products[f] = (arrays, nbytes, dict(format=1004, group_size=64))
        else:
            code, per, size = GGUF_TYPES[f]
            rows = WEIGHT_BYTES // (k // per * size)
            w = mx.array(random_blocks(f, rows, k // per, rng))
            products[f] = ((w,), w.nbytes, dict(format=code))
    x = mx.array(rng.normal(size=(1, k)).astype(np.float16))
    mx.eval(x, *[a for arrays, _, _ in products.values() for a in arrays])
    for t in (1, 2):
        ext.set_threads(t)
        out["read"][t] = ext.read_bandwidth(512 << 20, 5)
        for f, (arrays, nbytes, kw) in products.items():
            times = []
            for _ in range(12):
                tic = time.perf_counter()
                mx.eval(ext.qmatmul(x, *arrays, **kw))
                times.append(time.perf_counter() - tic)
            out["formats"].setdefault(f, {})[t] = nbytes / statistics.median(times[2:]) / 1e9
    return out


def make_q4_k_m(quantize: str, source: str, folder: str) -> str:
    out = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_K_M.gguf")
    cmd = [quantize, "--allow-requantize", source, out, "Q4_K_M"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def llama_tp_run(model: str, ranks: int, threads: int, path: str, g: int) -> float:
    """Generation tokens/s of one `llama_tp.bench` run on `ranks` ranks with `threads`
    threads each (the native kernels' pool, OpenBLAS's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_TP_KERNEL")}
    env["LLAMA_TP_KERNEL_THREADS"] = str(threads)
    args = ["-m", "llama_tp.bench", "--model", model, "-p", "16", "-g", str(g), "-n", "1"]
    args += ["--json", "--collective-steps", "0"]
    if path == "mlx":
        env["LLAMA_TP_KERNELS"] = "mlx"
    if path == "float32":
        args += ["--dtype", "float32"]
    if ranks > 1:
        cmd = [PY, "-m", "llama_tp.launch", "-n", str(ranks), "--", PY, *args]
    else:  # one process, with what the launcher would give it
        from llama_tp.cluster.blas import find_openblas

        cmd = [PY, *args]
        if find_openblas():
            env |= {"LD_PRELOAD": find_openblas(), "OPENBLAS_NUM_THREADS": str(threads)}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    line = next((x for x in r.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return json.loads(line)["llama_tp"]["generation_tps"]


LLAMA_CPP = """
import sys, time
from llama_cpp import Llama
model, threads, g = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
llm.eval(llm.tokenize(b"What is the capital of France?")[:16])
tic = time.perf_counter()
for _ in range(g):  # greedy, end-of-sequence ignored
    llm.eval([llm.sample(temp=0.0)])
print(g / (time.perf_counter() - tic))
"""


def llama_cpp_run(model: str, threads: int, g: int) -> float:
    r = subprocess.run(
        [PY, "-c", LLAMA_CPP, model, str(threads), str(g)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if r.returncode:
        raise RuntimeError(f"llama-cpp-python failed:\n{r.stderr[-2000:]}")
    return float(r.stdout.split()[-1])


def generation(models: dict[str, str], rounds: int, g: int) -> dict:
    try:
        import llama_cpp  # noqa: F401

        have_llama_cpp = True
    except ImportError:
        have_llama_cpp = False
        print("llama-cpp-python not installed: its rows are left out", file=sys.stderr)
    configs = []  # (model, what, ranks, threads per rank, path)
    for name, path in models.items():
        for ranks, threads in ROWS:
            for kind in ("native", "mlx", "float32", "llama.cpp"):
                if kind == "mlx" and threads > 1:
                    continue  # MLX's kernel runs on one thread
                if kind == "llama.cpp" and (ranks > 1 or not have_llama_cpp):
                    continue  # llama.cpp runs one process (its 2-thread row is the yardstick)
                configs.append((name, kind, ranks, threads, path))
    results: dict[str, list[float]] = {}
    for i in range(rounds):
        order = configs if i % 2 == 0 else configs[::-1]  # alternate, to pair neighbours
        for model, what, ranks, threads, path in order:
            if what == "llama.cpp":
                tps = llama_cpp_run(path, threads, g)
            else:
                tps = llama_tp_run(path, ranks, threads, what, g)
            results.setdefault(f"{model}|{what}|{ranks}x{threads}", []).append(tps)
            print(
                f"round {i + 1}: {model}, {what}, {ranks}x{threads}: {tps:.1f} tok/s",
                file=sys.stderr,
            )
    return {k: {"median": statistics.median(v), "runs": v} for k, v in results.items()}


# (ranks, threads per rank) of the table's rows
ROWS = ((1, 1), (1, 2), (2, 1))


def table(res: dict) -> str:
    """The markdown of docs/benchmarks.md's section."""
    gen, bw = res["generation"], res["bandwidth"]
    head = "| model | ranks x threads | native kernels | MLX's kernel | float32 + OpenBLAS "
    lines = [head + "| llama.cpp, same threads |", "|---|---|---|---|---|---|"]
    for model in res["models"]:
        for ranks, threads in ROWS:
            cells = []
            for what in ("native", "mlx", "float32", "llama.cpp"):
                key = f"{ranks}x1" if what == "mlx" else f"{ranks}x{threads}"
                if what == "llama.cpp":
                    key = f"1x{ranks * threads}"
                r = gen.get(f"{model}|{what}|{key}")
                cells.append(f"{r['median']:.1f}" if r else "-")
            lines.append(f"| {model} | {ranks} x {threads} | " + " | ".join(cells) + " |")
    read = bw["read"]
    lines += ["", "| weights | 1 thread GB/s | 2 threads GB/s | of the read bandwidth, 2 threads |"]
    lines += ["|---|---|---|---|", f"| (memory read) | {read[1]:.1f} | {read[2]:.1f} | 100% |"]
    for f, v in bw["formats"].items():
        lines.append(f"| {f} | {v[1]:.1f} | {v[2]:.1f} | {100 * v[2] / read[2]:.0f}% |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantize", required=True, help="llama.cpp's llama-quantize")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("-g", "--generation-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks-cpu-kernels.json"))
    args = p.parse_args()
    from llama_tp.engine.loader import default_model

    res = {
        "command": "python bench/cpu_kernels.py " + " ".join(sys.argv[1:]),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "llama_cpp_build": LLAMA_CPP_FLAGS,
        "generation_tokens": args.generation_tokens,
        "rounds": args.rounds,
    }
    res["load_average_before"] = os.getloadavg()  # other work on the machine, for the record
    res["bandwidth"] = bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        models = {"Q4_1 (built-in)": str(default_model())}
        models["Q4_K_M"] = make_q4_k_m(args.quantize, models["Q4_1 (built-in)"], tmp)
        res["models"] = list(models)
        res["generation"] = generation(models, args.rounds, args.generation_tokens)
    res["load_average_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
