"""Issue 41's decode-speed targets, side by side in one run, in turn, paired by round.

    python bench/decode_targets.py                      # 5 rounds, 64 tokens
    python bench/decode_targets.py --rounds 9 -g 128 --base /path/to/older/checkout
    python bench/decode_targets.py --quiet 0.1   # on a shared machine: runs no one disturbed

Every configuration generates `-g` tokens greedily after a 16-token prompt (end of
sequence ignored) once per round, the order reversed every other round, and each target
is the median over the rounds of that round's ratio (so that a machine whose speed drifts
slows both sides of a ratio alike):

The llama.cpp side of a ratio is the faster of its two rows in that round (its threads
spinning at barriers, or sleeping: `OMP_WAIT_POLICY=passive`, which a busy machine
favours), as bench/cpu_kernels.py takes it.

| ratio | target |
| --- | --- |
| 1 process (its default threads) / llama.cpp, 2 threads, built-in model | >= 1.0 |
| 1 process / mlx-lm, same weights, MLX's kernels, synthetic 0.5B float16 | >= 1.1 |
| 2 ranks (`python -m llama_tp.launch -n 2`) / llama.cpp, 2 threads | >= 0.6 |
| 2 ranks under `mlx.launch -n 2` / the same under `llama_tp.launch` | >= 0.5 |

llama.cpp is llama-cpp-python (docs/cpu-kernels.md: built with
`CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON"`); mlx-lm runs in the
same process as llama_tp (`bench --compare mlx-lm`). `--base DIR` adds the llama_tp rows
of another checkout (its package first on PYTHONPATH): before and after in one run. The
launchers' stdin is empty (as under a script or CI). Prints a Markdown table with the
load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
BIN = Path(PY).parent
sys.path.insert(0, str(ROOT / "bench"))
from cpu_kernels import llama_cpp_run  # noqa: E402

BENCH = ["-m", "llama_tp.bench", "-p", "16", "-n", "1", "--json", "--collective-steps", "0"]
CLEAN = ("LLAMA_TP_KERNEL_THREADS", "LLAMA_TP_CORES", "LLAMA_TP_COMPILE", "LLAMA_TP_FUSED")


def _bench(launcher: list[str], extra: list[str], g: int, base: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN}
    if base:
        env["PYTHONPATH"] = base
    cmd = [*launcher, PY, *BENCH, "-g", str(g), *extra]
    r = subprocess.run(
        cmd, cwd=base or ROOT, env=env, capture_output=True, text=True, timeout=3600,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    line = next((x for x in r.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads(line)


def configs(g: int, base: str | None) -> dict:
    from llama_tp.loading.loader import default_model

    model = str(default_model())
    one: list[str] = []
    lt = [PY, "-m", "llama_tp.launch", "-n", "2", "--"]
    mlx = [str(BIN / "mlx.launch"), "-n", "2", "--"]
    out = {
        "llama.cpp, 2 threads": lambda: llama_cpp_run(model, 2, g),
        # its threads sleep at barriers instead of spinning: faster next to other jobs
        "llama.cpp, 2 threads, passive": lambda: llama_cpp_run(model, 2, g, passive=True),
        "1 process": lambda: _bench(one, [], g)["llama_tp"]["generation_tps"],
        "2 ranks, llama_tp.launch": lambda: _bench(lt, [], g)["llama_tp"]["generation_tps"],
        "2 ranks, mlx.launch": lambda: _bench(mlx, [], g)["llama_tp"]["generation_tps"],
        "0.5B fp16 vs mlx-lm": lambda: _fp16(g, None),
    }
    if base:
        out["1 process (base)"] = lambda: _bench(one, [], g, base)["llama_tp"]["generation_tps"]
        out["2 ranks, llama_tp.launch (base)"] = lambda: _bench(lt, [], g, base)["llama_tp"][
            "generation_tps"
        ]
        out["2 ranks, mlx.launch (base)"] = lambda: _bench(mlx, [], g, base)["llama_tp"][
            "generation_tps"
        ]
        out["0.5B fp16 vs mlx-lm (base)"] = lambda: _fp16(g, base)
    return out


def _busy_jiffies() -> int:
    """The machine's CPU time so far, every process's (clock ticks, /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system = (int(x) for x in f.readline().split()[1:4])
    return user + nice + system


def _own_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def quiet_run(fn, max_other: float, tries: int = 20) -> tuple[float, float]:
    """fn() while the rest of the machine is idle: waits for a second in which other
    processes used less than `max_other` of a core, runs fn, and runs it again when
    others used more than `max_other` cores on average meanwhile (a shared machine's
    jobs would otherwise slow one side of a ratio). Returns (fn's value, the others'
    cores during it)."""
    hz = os.sysconf("SC_CLK_TCK")
    for _ in range(tries):
        for _ in range(600):  # up to 10 minutes for an idle second
            b = _busy_jiffies()
            time.sleep(1.0)
            if (_busy_jiffies() - b) / hz < max_other:
                break
        b, own, t = _busy_jiffies(), _own_seconds(), time.perf_counter()
        value = fn()
        wall = time.perf_counter() - t
        other = ((_busy_jiffies() - b) / hz - (_own_seconds() - own)) / wall
        if other < max_other:
            return value, other
    raise RuntimeError(
        f"the machine was not quiet in {tries} tries (others used {other:.2f} cores)"
    )


def _fp16(g: int, base: str | None) -> float:
    """llama_tp / mlx-lm generation tokens/s on the synthetic 0.5B float16, one process."""
    res = _bench([], ["--synthetic", "0.5b-fp16", "--compare", "mlx-lm"], min(g, 16), base)
    return res["ratio"]["generation_tps"]


TARGETS = (
    ("1 process / llama.cpp 2 threads", "1 process", "llama.cpp, 2 threads", 1.0),
    ("1 process / mlx-lm (0.5B float16)", "0.5B fp16 vs mlx-lm", None, 1.1),
    ("2 ranks / llama.cpp 2 threads", "2 ranks, llama_tp.launch", "llama.cpp, 2 threads", 0.6),
    (
        "mlx.launch / llama_tp.launch, 2 ranks",
        "2 ranks, mlx.launch",
        "2 ranks, llama_tp.launch",
        0.5,
    ),
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("-g", type=int, default=64)
    p.add_argument("--base", help="another checkout's root, its llama_tp rows side by side")
    p.add_argument("--only", nargs="+", help="run these configurations only")
    p.add_argument("--progress", action="store_true", help="each figure on stderr as measured")
    p.add_argument(
        "--quiet",
        type=float,
        metavar="CORES",
        help="run each configuration while other processes use less than CORES cores (on a "
        "shared machine: waits for an idle second, reruns a run others disturbed)",
    )
    args = p.parse_args()
    runs = configs(args.g, args.base)
    if args.only:
        runs = {k: v for k, v in runs.items() if k in args.only}
    load = [os.getloadavg()[0]]
    res: dict[str, list[float]] = {k: [] for k in runs}
    others: list[float] = []  # with --quiet: other processes' cores during each run
    for i in range(args.rounds):
        for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            other = None
            if args.quiet is None:
                res[name].append(runs[name]())
            else:
                value, other = quiet_run(runs[name], args.quiet)
                res[name].append(value)
                others.append(other)
            if args.progress:
                note = "" if other is None else f" (others: {other:.2f} cores)"
                print(
                    f"round {i + 1}: {name}: {res[name][-1]:.2f}{note}", file=sys.stderr, flush=True
                )
    load.append(os.getloadavg()[0])
    print(
        f"load average {load[0]:.1f} before, {load[1]:.1f} after; {args.rounds} rounds, -g {args.g}"
        + (f"; other processes used at most {max(others):.2f} cores during a run" if others else "")
    )
    print("| configuration | tokens/s (median) | rounds |\n| --- | --- | --- |")
    for name, xs in res.items():
        print(f"| {name} | {statistics.median(xs):.2f} | {', '.join(f'{x:.1f}' for x in xs)} |")
    print("\n| target | median of the rounds' ratios | rounds | goal |\n| --- | --- | --- | --- |")
    if "llama.cpp, 2 threads, passive" in res and "llama.cpp, 2 threads" in res:
        res["llama.cpp, 2 threads"] = [
            max(x, y)
            for x, y in zip(
                res["llama.cpp, 2 threads"], res.pop("llama.cpp, 2 threads, passive"), strict=True
            )
        ]
    for label, a, b, goal in TARGETS:
        for suffix in ("", " (base)"):
            if a + suffix not in res or (b and b + suffix not in res and b not in res):
                continue
            bs = res.get(b + suffix) or res.get(b) if b else None
            ratios = (
                [x / y for x, y in zip(res[a + suffix], bs, strict=True)] if b else res[a + suffix]
            )
            print(
                f"| {label}{suffix} | {statistics.median(ratios):.2f} | "
                f"{', '.join(f'{r:.2f}' for r in ratios)} | >= {goal} |"
            )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
