"""Where a decode step's time goes (issue 41): host graph building, operations dispatched,
quantized products, collectives and the rest, per token, on 1 and 2 ranks.

    python bench/step_profile.py                        # the matrix below, a Markdown table
    python bench/step_profile.py --models builtin --ranks 1 --json
    python bench/step_profile.py --instructions         # instructions per step (valgrind)
    python bench/step_profile.py --variants "eager, unfused" "eager, fused" compiled base \
        --base /path/to/older/checkout                  # each change apart, and before them
    python bench/step_profile.py --rank-program [--model PATH | --synthetic SPEC]

The matrix: the built-in model (SmolLM2-135M Q4_1), the synthetic Qwen3 (`qwen3-q4`: MLX
4-bit) and the synthetic Qwen3-MoE (`moe-a3b-q4`), each on 1 process and on 2 ranks
started by `python -m llama_tp.launch -n 2` (its defaults: each rank on its own core,
threads per rank = cores / ranks). Each configuration runs `--rank-program` (every rank
measures itself with `llama_tp.benchmarks.step_profile`; rank 0 prints every rank's JSON)
`--rounds` times in turn; the table gives each figure's median over the rounds, rank 0's.
The load average is printed with the table: CPU-time columns move far less with it than
wall-time ones.

`--instructions` counts instead of timing (what a shared machine cannot distort): each
configuration once under `valgrind --tool=callgrind --instr-atstart=no
--separate-threads=yes`, one kernel thread per rank, instructions counted only during
`--callgrind` steps of steady-state decoding (the extension's `callgrind()` switch), then
per step by thread (main: Python and MLX's dispatching; stream: MLX's CPU stream) and by
where they run (Python, MLX, MLX's compiled kernels, the native kernels, libc). Valgrind
runs AVX2 code (it has no AVX-512): the native kernels' count is their AVX2 build's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MODELS = {"builtin": [], "qwen3": ["--synthetic", "qwen3-q4"], "moe": ["--synthetic", "moe-a3b-q4"]}
# The changes of issue 41 one at a time: eager steps with the products apart, then fused,
# then compiled (the default); `--base DIR` adds another checkout (before them all).
VARIANTS = {
    "eager, unfused": {"LLAMA_TP_COMPILE": "0", "LLAMA_TP_FUSED": "0"},
    "eager, fused": {"LLAMA_TP_COMPILE": "0"},
    "compiled": {},
}


def _lenient_rlimits() -> None:
    """Under valgrind, mlx-lm's import-time setrlimit (raising the open-files limit) fails:
    ignore that failure."""
    import resource

    real = resource.setrlimit

    def setrlimit(*a):
        try:
            real(*a)
        except ValueError:
            pass

    resource.setrlimit = setrlimit


def rank_program(args) -> None:
    if args.callgrind:
        _lenient_rlimits()
    import mlx.core as mx

    from llama_tp import load_model, world
    from llama_tp.benchmarks.step_profile import profile_model
    from llama_tp.cluster.distributed import all_gather_object, barrier
    from llama_tp.loading.loader import default_model

    group = world()
    if args.synthetic:
        from llama_tp.benchmarks.synthetic import synthetic_dir

        if group.rank() == 0:
            synthetic_dir(args.synthetic)
        barrier(group)
        path = synthetic_dir(args.synthetic)
    else:
        path = args.model or default_model()
    model, _ = load_model(path, group, True, None)
    if args.callgrind:
        from llama_tp.benchmarks.step_profile import count_instructions

        count_instructions(model, group, args.callgrind)
        return
    res = profile_model(model, group, args.steps)
    res["threads_per_rank"] = _kernel_threads()
    ranks = all_gather_object(res, group)
    if group.rank() == 0:
        print(json.dumps({"ranks": group.size(), "per_rank": ranks, "mlx": mx.__version__}))


def _kernel_threads() -> int | None:
    from llama_tp.kernels import status

    st = status()
    return st.threads if st.native else None


def _where(variant: str, base: str | None) -> tuple[Path, dict]:
    """(the checkout to run, its environment) for a variant."""
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_TP_COMPILE", "LLAMA_TP_FUSED")}
    if variant == "base":
        return Path(base), env | {"PYTHONPATH": base}
    return ROOT, env | VARIANTS[variant]


def run_config(model: str, ranks: int, steps: int, variant: str, base: str | None) -> dict:
    root, env = _where(variant, base)
    cmd = [PY, str(root / "bench" / "step_profile.py"), "--rank-program", "--steps", str(steps)]
    cmd += MODELS[model]
    if ranks > 1:
        cmd = [PY, "-m", "llama_tp.launch", "-n", str(ranks), "--", *cmd]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    line = next((x for x in r.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads(line)


def instructions(model: str, ranks: int, steps: int, variant: str, base: str | None) -> list:
    """Instructions per step of each rank, by thread and by component (see the module)."""
    root, env = _where(variant, base)
    out_dir = tempfile.mkdtemp(prefix="llama_tp_callgrind_")
    vg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes"]
    vg += [f"--callgrind-out-file={out_dir}/cg.%p"]
    cmd = [*vg, PY, str(root / "bench" / "step_profile.py"), "--rank-program"]
    cmd += ["--callgrind", str(steps), *MODELS[model]]
    env["LLAMA_TP_KERNEL_THREADS"] = "1"
    if ranks > 1:
        cmd = [PY, "-m", "llama_tp.launch", "-n", str(ranks), "--", *cmd]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    files = sorted(Path(out_dir).glob("cg.*"))
    names = _callgrind_names(files)
    by_pid: dict[str, dict] = {}
    for f in files:
        pid, _, thread = f.name.removeprefix("cg.").partition("-")
        per = _callgrind_costs(f, names)
        if not sum(per.values()):
            continue
        comps = collections.Counter()
        for ob, n in per.items():
            comps[_component(ob)] += n / steps
        by_pid.setdefault(pid, {})[int(thread or 1)] = comps
    out = []
    for _, threads in sorted(by_pid.items()):
        # valgrind's thread 1 is the main thread; MLX's stream is the one running the kernels
        stream = max(
            (t for t in threads if t != 1),
            key=lambda t: threads[t]["native kernels"] + threads[t]["MLX compiled kernels"],
            default=None,
        )
        total = collections.Counter()
        for c in threads.values():
            total.update(c)
        out.append(
            {
                "main": sum(threads.get(1, {}).values()),
                "stream": sum(threads[stream].values()) if stream else 0.0,
                "other": sum(sum(c.values()) for t, c in threads.items() if t not in (1, stream)),
                "main_by_component": dict(threads.get(1, {})),
                "by_component": dict(total),
            }
        )
    return out


def _callgrind_names(files) -> dict[str, str]:
    names = {}
    for f in files:
        for line in open(f, errors="replace"):
            m = re.match(r"c?ob=\((\d+)\) (.+)", line.rstrip("\n"))
            if m:
                names[m.group(1)] = m.group(2)
    return names


def _callgrind_costs(path, names) -> collections.Counter:
    """Self instructions by object file (callgrind's compressed format)."""
    ob, per, skip = None, collections.Counter(), False
    for line in open(path, errors="replace"):
        line = line.rstrip("\n")
        if line.startswith("ob="):
            m = re.match(r"ob=\((\d+)\)", line)
            ob = names.get(m.group(1)) if m else line[3:]
        elif line.startswith("calls="):
            skip = True  # the next cost line is the call's inclusive cost
        elif line[:1].isdigit() or line[:1] in ("+", "-", "*"):
            if skip:
                skip = False
                continue
            parts = line.split()
            if len(parts) >= 2:
                per[ob] += int(parts[1])
    return per


def _component(ob: str | None) -> str:
    ob = ob or "?"
    if "_ext" in ob:
        return "native kernels"
    if "libmlx" in ob:
        return "MLX"
    if "/mlx/" in ob and "/cpu/lib" in ob:
        return "MLX compiled kernels"
    if "python" in ob.lower():
        return "Python"
    if any(x in ob for x in ("libc.so", "libm.so", "ld-linux", "libstdc++")):
        return "libc"
    return "other"


def instruction_table(rows) -> str:
    comps = ("Python", "MLX", "libc", "MLX compiled kernels", "native kernels", "other")
    out = [
        "| model | ranks | variant | M instructions per step: main thread (Python, MLX, libc) "
        "| stream thread | other threads | all threads: " + " / ".join(comps) + " |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, ranks, variant, res in rows:
        r0 = res[0]
        m = r0["main_by_component"]
        parts = ", ".join(f"{m.get(c, 0) / 1e6:.1f}" for c in ("Python", "MLX", "libc"))
        main = f"{r0['main'] / 1e6:.1f} ({parts})"
        cells = " / ".join(f"{r0['by_component'].get(c, 0) / 1e6:.1f}" for c in comps)
        th = f"{r0['stream'] / 1e6:.1f} | {r0['other'] / 1e6:.1f}"
        out.append(f"| {model} | {ranks} | {variant} | {main} | {th} | {cells} |")
    return "\n".join(out)


COLUMNS = (
    ("step_ms", "step ms"),
    ("cpu_ms", "CPU ms"),
    ("host_ms", "host (main thread) CPU ms"),
    ("build_ms", "graph build ms"),
    ("dispatch_ms", "dispatch ms"),
    ("ops", "ops"),
    ("qmatmul_ms", "quantized products ms"),
    ("collectives_ms", "collectives ms"),
    ("rest_ms", "rest ms"),
)


def table(rows: list[tuple[str, int, list[dict]]]) -> str:
    head = (
        "| model | ranks | variant | "
        + " | ".join(c[1] for c in COLUMNS)
        + " | CPU by thread: main / stream / pool / other ms |"
    )
    out = [head, "|" + " --- |" * (len(COLUMNS) + 4)]
    for model, ranks, variant, runs in rows:
        r0 = [r["per_rank"][0] for r in runs]
        cells = []
        for key, _ in COLUMNS:
            v = statistics.median(r[key] for r in r0)
            cells.append(f"{v:.0f}" if key == "ops" else f"{v:.2f}")
        th = "/".join(
            f"{statistics.median(r['threads'][k] for r in r0):.2f}"
            for k in ("main", "stream", "pool", "other")
        )
        out.append(f"| {model} | {ranks} | {variant} | " + " | ".join(cells) + f" | {th} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank-program", action="store_true", help="measure this process (a rank)")
    p.add_argument("--model")
    p.add_argument("--synthetic")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the raw results too")
    p.add_argument("--instructions", action="store_true", help="count instructions (valgrind)")
    p.add_argument("--variants", nargs="+", default=["compiled"], choices=[*VARIANTS, "base"])
    p.add_argument("--base", help="another checkout (variant 'base'): its bench/step_profile.py")
    p.add_argument("--callgrind", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_program:
        rank_program(args)
        return
    if "base" in args.variants and not args.base:
        p.error("--variants base needs --base DIR")
    keys = [(m, n, v) for m in args.models for n in args.ranks for v in args.variants]
    if args.instructions:
        rows = [(m, n, v, instructions(m, n, 8, v, args.base)) for m, n, v in keys]
        print("instructions per decode step (valgrind, 1 kernel thread per rank), rank 0")
        print(instruction_table(rows))
        if args.json:
            print(
                json.dumps({"/".join(map(str, k)): r[3] for k, r in zip(keys, rows, strict=True)})
            )
        return
    load = [os.getloadavg()[0]]
    results = {k: [] for k in keys}
    for _ in range(args.rounds):
        for m, n, v in keys:
            results[m, n, v].append(run_config(m, n, args.steps, v, args.base))
    load.append(os.getloadavg()[0])
    rows = [(*k, runs) for k, runs in results.items()]
    print(f"load average {load[0]:.1f} before, {load[1]:.1f} after; ", end="")
    print(f"medians of {args.rounds} rounds, rank 0")
    print(table(rows))
    if args.json:
        print(json.dumps({"/".join(map(str, k)): runs for k, runs in results.items()}))


if __name__ == "__main__":
    main()
