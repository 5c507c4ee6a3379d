"""Generation speed on the CPU with llama_tp's native kernels, against MLX's kernel,
float32 + OpenBLAS and llama.cpp; and the kernels' weight bandwidth against the machine's.

    python bench/cpu_kernels.py --quantize PATH/TO/llama-quantize [--rounds 3] [-g 64]
    python bench/cpu_kernels.py --bandwidth-only [--formats Q4_K affine4/32] [--isa avx2]
        [--cpu-seconds]

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
  round, in turn, the order reversed every other round, so that a busy machine (this one
  is shared with other jobs) slows them alike; medians of the rounds, and the targets as
  medians of each round's ratio.

Rewrites the section "cpu-kernels" of docs/benchmarks.md and keeps the raw results in
docs/benchmarks/cpu-kernels.json (`llama_tp.benchmarks.sections`); prints the section.
llama-cpp-python's build (its flags are reported with its figures):
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON" pip install llama-cpp-python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from llama_tp.benchmarks import sections
from llama_tp.benchmarks.kernel_bandwidth import FORMATS, bandwidth

ROOT = Path(__file__).resolve().parent.parent
NAME = "cpu-kernels"
PY = sys.executable
LLAMA_CPP_FLAGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON"


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
        if path == MPI:  # as root, Open MPI's mpirun wants both
            cmd[3:3] = ["--backend", "mpi"]
            env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
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


def llama_cpp_run(model: str, threads: int, g: int, passive: bool = False) -> float:
    """Generation tokens/s of llama.cpp on `threads` threads; `passive`: its OpenMP threads
    sleep at barriers instead of spinning (OMP_WAIT_POLICY=passive), which a machine
    shared with other work favours."""
    env = os.environ | {"OMP_WAIT_POLICY": "passive"} if passive else None
    r = subprocess.run(
        [PY, "-c", LLAMA_CPP, model, str(threads), str(g)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    if r.returncode:
        raise RuntimeError(f"llama-cpp-python failed:\n{r.stderr[-2000:]}")
    return float(r.stdout.split()[-1])


def generation(models: dict[str, str], rounds: int, g: int) -> dict:
    """Generation tokens/s of every configuration, `rounds` times in turn: each one's
    runs and median, keyed "model|path|ranks x threads"."""
    configs = []  # (model, path, ranks, threads per rank, file)
    for name, file in models.items():
        for ranks, threads in ROWS:
            for kind in PATHS:
                if kind == "mlx" and threads > 1:
                    continue  # MLX's kernel runs on one thread
                if kind.startswith("llama.cpp") and ranks > 1:
                    continue  # llama.cpp runs one process (its 2-thread row is the yardstick)
                if kind == PASSIVE and threads == 1:
                    continue  # no barriers to wait at
                if kind == MPI and (ranks == 1 or not shutil.which("mpirun")):
                    continue  # Open MPI's shared memory instead of the ring's loopback TCP
                configs.append((name, kind, ranks, threads, file))
    results: dict[str, list[float]] = {}
    for i in range(rounds):
        order = configs if i % 2 == 0 else configs[::-1]  # alternate, to pair neighbours
        for model, what, ranks, threads, file in order:
            if what.startswith("llama.cpp"):
                tps = llama_cpp_run(file, threads, g, passive=what == PASSIVE)
            else:
                tps = llama_tp_run(file, ranks, threads, what, g)
            results.setdefault(f"{model}|{what}|{ranks}x{threads}", []).append(tps)
            print(
                f"round {i + 1}: {model}, {what}, {ranks}x{threads}: {tps:.1f} tok/s",
                file=sys.stderr,
            )
    return {k: {"median": statistics.median(v), "runs": v} for k, v in results.items()}


# (ranks, threads per rank) of the table's rows, and the paths of its columns
ROWS = ((1, 1), (1, 2), (2, 1))
PASSIVE = "llama.cpp, passive"
MPI = "native, MPI"
PATHS = ("native", MPI, "mlx", "float32", "llama.cpp", PASSIVE)


def _ratio(gen: dict, a: str, *bs: str) -> float:
    """The median over rounds of run a / the fastest of runs bs in the same round
    (neighbours in time)."""
    rb = [max(r) for r in zip(*(gen[b]["runs"] for b in bs if b in gen), strict=True)]
    return statistics.median(x / y for x, y in zip(gen[a]["runs"], rb, strict=True))


def targets(res: dict) -> list[tuple[str, str, float, float]]:
    """The issue's targets: (what, model, measured, target)."""
    gen, bw = res["generation"], res["bandwidth"]
    out = []
    worst = min(bw["formats"].items(), key=lambda kv: kv[1]["of_read_2"])
    out.append((f"kernel bandwidth / read bandwidth, 2 threads (worst: {worst[0]})", "-",
                worst[1]["of_read_2"], 0.5))  # fmt: skip
    two = ("llama.cpp|1x2", f"{PASSIVE}|1x2")  # the faster of its two ways of waiting
    best = ("llama.cpp|1x1", *two)  # its fastest row: 1 or 2 threads
    for model in res["models"]:
        for mine, theirs, goal, what in (
            ("native|1x1", ("llama.cpp|1x1",), 0.5, "1 rank, 1 thread / llama.cpp, 1 thread"),
            ("native|1x2", two, 0.5, "1 rank, 2 threads / llama.cpp, 2 threads"),
            ("native|2x1", two, 1 / 3, "2 ranks / llama.cpp, 2 threads"),
            ("native|1x2", best, 0.5, "1 rank, 2 threads / llama.cpp's fastest (1 or 2 threads)"),
            ("native|2x1", best, 1 / 3, "2 ranks / llama.cpp's fastest (1 or 2 threads)"),
            ("native|2x1", two, 2 / 3, "2 ranks / llama.cpp, 2 threads (the moonshot)"),
            (f"{MPI}|2x1", two, 2 / 3, "2 ranks, Open MPI / llama.cpp, 2 threads (the moonshot)"),
        ):
            if f"{model}|{mine}" in gen:  # no MPI column where mpirun was missing
                ratio = _ratio(gen, f"{model}|{mine}", *(f"{model}|{t}" for t in theirs))
                out.append((what, model, ratio, goal))
    return out


def bandwidth_table(bw: dict) -> str:
    """The bandwidth results as a table (keys as the results file holds them: strings)."""
    bw = json.loads(json.dumps(bw))
    md = [
        "| weights | 1 thread GB/s | 2 threads GB/s | of the read bandwidth, 2 threads |",
        "| --- | --- | --- | --- |",
        f"| (memory read) | {bw['read']['1']:.1f} | {bw['read']['2']:.1f} | 100% |",
    ]
    for f, v in bw["formats"].items():
        md.append(f"| {f} | {v['1']:.1f} | {v['2']:.1f} | {100 * v['of_read_2']:.0f}% |")
    return "\n".join(md)


def section(res: dict) -> str:
    """The section "cpu-kernels" of docs/benchmarks.md, from the results."""
    gen, bw = res["generation"], res["bandwidth"]
    md = [
        "### Native CPU kernels: generation tokens/s (prompt 16, generate "
        f"{res['generation_tokens']})",
        "",
        "Generated by `python bench/cpu_kernels.py` (raw results: "
        "[benchmarks/cpu-kernels.json](benchmarks/cpu-kernels.json)). One run: every "
        f"configuration once per round, {res['rounds']} rounds, the order reversed every "
        "other round; medians. The machine is shared with other jobs (load average "
        f"{res['load_average_before'][0]:.1f} before, {res['load_average_after'][0]:.1f} "
        "after): single runs vary by up to 2x, medians and paired ratios less, and "
        "llama.cpp's 2-thread rows suffer most (its threads spin at barriers while another "
        "job holds a core; on a quiet machine it generated 147 tok/s on 2 threads, "
        "[the CPU path](#the-cpu-path-built-in-model-prompt-64-generate-32)): read them "
        "against its 1-thread row too. llama.cpp: "
        f"llama-cpp-python {res['llama_cpp_version']} built with "
        f'`CMAKE_ARGS="{res["llama_cpp_build"]}"` (a native build crashes on this host).',
        "",
        "| model | ranks x threads per rank | native kernels | native kernels, Open MPI | "
        "MLX's kernel | float32 + OpenBLAS | llama.cpp, same threads in all | "
        "llama.cpp, passive |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model in res["models"]:
        for ranks, threads in ROWS:
            cells = []
            for what in PATHS:
                llama = what.startswith("llama.cpp")
                key = f"1x{ranks * threads}" if llama else f"{ranks}x{threads}"
                r = gen.get(f"{model}|{what}|{key}")
                cells.append(f"{r['median']:.1f}" if r else "-")
            md.append(f"| {model} | {ranks} x {threads} | " + " | ".join(cells) + " |")
    md += [
        "",
        "Ranks are started by `python -m llama_tp.launch`, which puts each on its own core "
        "([Two ranks on one machine](cpu-kernels.md#two-ranks-on-one-machine)); they talk "
        "over the ring backend (loopback TCP), or Open MPI's shared memory (`--backend "
        "mpi`). MLX's kernel is single-threaded: no 1 x 2 row. llama.cpp, passive: with "
        "`OMP_WAIT_POLICY=passive` (its threads sleep at barriers instead of spinning, "
        "which is faster when another job holds a core); the targets compare with the "
        "faster of the two in each round, and, stricter, with llama.cpp's fastest row "
        "(on this busy machine its 1-thread row). Weight bandwidth of one "
        "matrix-vector product per format on ~130 MB of random weights (scales included), "
        "against reading memory (`read_bandwidth`, 512 MB), the same threads, in turn:",
        "",
        bandwidth_table(bw),
    ]
    md += ["", "| target | model | measured | wanted | met |", "| --- | --- | --- | --- | --- |"]
    for what, model, got, goal in targets(res):
        ok = "yes" if got >= goal else "no"
        md.append(f"| {what} | {model} | {got:.2f} | >= {goal:.2f} | {ok} |")
    g = res["generation_tokens"]
    run = f"python -m llama_tp.bench --model MODEL -p 16 -g {g} -n 1 --json --collective-steps 0"
    md += [
        "",
        "```sh",
        f"{run}   # native kernels (LLAMA_TP_KERNEL_THREADS=T)",
        f"LLAMA_TP_KERNELS=mlx {run}   # MLX's kernel",
        f"LD_PRELOAD=$OPENBLAS OPENBLAS_NUM_THREADS=T {run} --dtype float32",
        f"python -m llama_tp.launch -n 2 -- python -m llama_tp.bench --model MODEL -p 16 -g {g} "
        "-n 1 --json --collective-steps 0   # each of the three on 2 ranks (--backend mpi: "
        "Open MPI)",
        "# llama.cpp: Llama(MODEL, n_threads=T).eval(...) in bench/cpu_kernels.py",
        "# MODEL: the built-in Q4_1 file, or its Q4_K_M: llama-quantize --allow-requantize "
        "IN OUT Q4_K_M",
        "```",
    ]
    return "\n".join(md)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quantize", help="llama.cpp's llama-quantize (needed but with --bandwidth-only)"
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("-g", "--generation-tokens", type=int, default=64)
    p.add_argument("--out", default=str(sections.PAGE), help="the page whose section to rewrite")
    p.add_argument(
        "--bandwidth-only",
        action="store_true",
        help="only the bandwidth table, printed (the page is not rewritten)",
    )
    p.add_argument(
        "--formats",
        nargs="+",
        default=list(FORMATS),
        help="the formats of the bandwidth table (GGUF types, affine4/G, affine8/G)",
    )
    p.add_argument(
        "--cpu-seconds",
        action="store_true",
        help="with --bandwidth-only: GB per CPU-second on 1 thread instead",
    )
    p.add_argument("--isa", help="the kernels' instruction set (default: the CPU's best)")
    args = p.parse_args()
    if args.isa:
        os.environ["LLAMA_TP_KERNELS"] = args.isa
    if args.bandwidth_only:
        load = os.getloadavg()[0]
        bw = bandwidth(args.rounds, tuple(args.formats), args.cpu_seconds)
        print(f"isa {bw['isa']}, load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
        if args.cpu_seconds:
            for f, v in bw["formats"].items():
                print(f"{f}: {v['cpu_1']:.1f} GB per CPU-second, 1 thread")
        else:
            print(bandwidth_table(bw))
        return 0
    if not args.quantize:
        p.error("--quantize is needed for the generation table")
    import llama_cpp

    from llama_tp.loading.loader import default_model

    res = sections.run_facts("bench/cpu_kernels.py")
    res.update(
        cpu=platform.processor() or platform.machine(),
        llama_cpp_build=LLAMA_CPP_FLAGS,
        llama_cpp_version=llama_cpp.__version__,
        generation_tokens=args.generation_tokens,
        rounds=args.rounds,
        load_average_before=os.getloadavg(),  # other work on the machine, for the record
    )
    res["bandwidth"] = bandwidth(args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        models = {"Q4_1 (built-in)": str(default_model())}
        models["Q4_K_M"] = make_q4_k_m(args.quantize, models["Q4_1 (built-in)"], tmp)
        res["models"] = list(models)
        res["generation"] = generation(models, args.rounds, args.generation_tokens)
    res["load_average_after"] = os.getloadavg()
    res = json.loads(json.dumps(res))  # as the results file holds it (string keys)
    sections.write_results(NAME, res)
    sections.replace_section(NAME, section(res), Path(args.out))
    print(section(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
