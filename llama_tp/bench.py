"""`python -m llama_tp.bench`: prompt and generation speed, memory and collectives.

    python -m llama_tp.bench -p 512 -g 128 -n 5
    mlx.launch -n 2 -- python -m llama_tp.bench --synthetic 0.5b-fp16 -p 64 -g 32 --compare mlx-lm

In the spirit of `mlx_lm.benchmark` (same flag names) and llama-bench: random
prompt tokens (the same on every rank), one warm-up trial, end-of-sequence
ignored (greedy decoding through `generate_step`), the mean of `-n` trials.
From the model itself it reports the collectives of one decode step, counted
(`collectives.count_collectives`), and the share of a decode step spent in
them: decode steps timed with the real collectives, then with each replaced by
identity (same compute, no communication): share = 1 - t_identity / t_real.
`--compare mlx-lm` runs mlx-lm's own loop on the same weights in the same run.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from .distributed import agree_ok, all_gather_object, barrier, broadcast_object, eprint0, world


def timed(
    steps: Iterator[tuple[Any, Any]], n_prompt: int, stream: Any = None
) -> tuple[dict[str, float], list[int]]:
    """Consume a generate_step iterator: time to first token, prompt and generation tokens/s.

    Generation tokens/s counts the tokens after the first over the time after it.
    `stream`: the one the loop evaluates on, waited for at the end.
    """
    tic = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    tokens, first = [], tic
    for token, _ in steps:
        tokens.append(int(token))
        if len(tokens) == 1:
            first = time.perf_counter()
    end = time.perf_counter()
    # mlx-lm's loop leaves a step in flight, with its all-reduces: finish it before
    # anything else (another stream's collective would overtake it on one rank only).
    mx.synchronize(stream) if stream is not None else mx.synchronize()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    ttft = first - tic
    stats = {
        "ttft_s": ttft,
        "prompt_tps": n_prompt / ttft,
        "generation_tps": (len(tokens) - 1) / (end - first) if len(tokens) > 1 else 0.0,
        "total_s": end - tic,
        "cpu_per_wall": cpu / (end - tic),  # > 1: more than one core busy (threads, spinning)
    }
    return stats, tokens


def run_trials(trial: Callable[[], tuple[dict, list[int]]], n: int) -> dict[str, Any]:
    """One warm-up trial, then `n` timed ones: their means, every trial, this rank's peak memory."""
    trial()
    mx.reset_peak_memory()
    trials, tokens = [], []
    for _ in range(n):
        stats, tokens = trial()
        trials.append(stats)
    keys = ("prompt_tps", "generation_tps", "ttft_s", "cpu_per_wall")
    out: dict[str, Any] = {k: sum(t[k] for t in trials) / n for k in keys}
    out.update(trials=trials, tokens=tokens, peak_memory_gb=mx.get_peak_memory() / 1e9)
    return out


def bench_llama_tp(
    args: Any, path: Path, group: mx.distributed.Group
) -> tuple[dict[str, Any], list[int]]:
    """llama_tp's trials, collective count and decode share; also the prompt it used."""
    from .collectives import count_collectives, decode_share
    from .generate import generate_step
    from .loader import load_model
    from .sampling import make_sampler, vocab_shard

    mx.reset_peak_memory()
    tic = time.perf_counter()
    model, ckpt = load_model(path, group, not args.no_vocab_parallel)
    load_s = time.perf_counter() - tic
    load_peak = mx.get_peak_memory() / 1e9
    ids = mx.random.randint(0, model.args.vocab_size, (args.prompt_tokens,), key=mx.random.key(0))
    prompt = broadcast_object(ids.tolist(), group)
    sampler = make_sampler(0.0, 1.0, 0.0, 0, shard=vocab_shard(model))

    def trial(prompt=prompt, max_tokens=args.generation_tokens):
        steps = generate_step(
            model, prompt, sampler, max_tokens, prefill_step_size=args.prefill_step_size
        )
        return timed(steps, len(prompt))

    res = run_trials(trial, args.num_trials)
    peaks = all_gather_object(
        (load_peak, res["peak_memory_gb"], ckpt.load_stats["bytes_read"]), group
    )
    res.update(load_time_s=load_s, load_peak_memory_gb=[p[0] for p in peaks])
    res["load_bytes_read"] = [p[2] for p in peaks]  # from weight files, per rank
    res["peak_memory_gb"] = [p[1] for p in peaks]
    res["collectives"] = count_collectives(model, sampler)
    if group.size() > 1 and args.collective_steps > 0:
        k = args.collective_steps
        res.update(decode_share(lambda: 1 / trial(prompt[:16], k + 1)[0]["generation_tps"]))
    else:  # nothing to share with: no collectives
        step_ms = 1e3 / res["generation_tps"] if res["generation_tps"] else 0.0
        res.update(decode_step_ms=step_ms, decode_step_ms_no_collectives=step_ms)
        res["collective_share"] = 0.0
    res["n_layers"] = len(model.layers)
    res["threads"] = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self") else None
    return res, prompt


def parser():
    from .cli import ArgumentParser

    p = ArgumentParser(
        prog="python -m llama_tp.bench",
        description="Benchmark prompt and generation speed, memory and collectives "
        "(one process, or every rank of an mlx.launch).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="GGUF file or HF/MLX directory (default: built-in SmolLM2)")
    src.add_argument(
        "--synthetic",
        metavar="SPEC",
        help="a random-weight Llama written once into the cache, e.g. 0.5b-fp16 "
        "(SIZE 0.5b, 0.1b or tiny; DTYPE fp16, bf16 or fp32)",
    )
    p.add_argument("--prompt-tokens", "-p", type=int, default=512, help="prompt length")
    p.add_argument("--generation-tokens", "-g", type=int, default=128, help="tokens to generate")
    p.add_argument("--num-trials", "-n", type=int, default=5, help="timed trials (after warm-up)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt chunk size")
    p.add_argument("--json", action="store_true", help="print one JSON object (rank 0)")
    p.add_argument("--compare", choices=["mlx-lm"], help="also run mlx-lm on the same weights")
    p.add_argument("--no-vocab-parallel", action="store_true", help="embedding and head whole")
    p.add_argument(
        "--collective-steps",
        type=int,
        default=16,
        help="decode steps timed with and without collectives (0: skip)",
    )
    p.add_argument(
        "--pin-core",
        metavar="auto|LIST",
        help="pin each rank to one core: auto = core <rank>, or a list 0,1,... indexed by rank",
    )
    p.add_argument("--blas-threads", type=int, help="OpenBLAS threads (default 1 when pinned)")
    return p


def check_args(args: Any) -> None:
    from .cli import UsageError

    for name in ("prompt_tokens", "generation_tokens", "num_trials", "prefill_step_size"):
        if getattr(args, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be positive, got {getattr(args, name)}")
    if args.generation_tokens < 2:
        raise UsageError(f"--generation-tokens must be >= 2, got {args.generation_tokens}")


def pin(spec: str, rank: int) -> list[int]:
    """Pin every thread of this process to one core (`auto`: core `rank`).

    Returns the cores this process's threads may run on, read back afterwards.
    """
    from .cli import UsageError

    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        raise UsageError("--pin-core needs Linux (sched_setaffinity)")
    if spec == "auto":
        core = rank % (os.cpu_count() or 1)
    else:
        try:
            cores = [int(c) for c in spec.split(",")]
        except ValueError:
            raise UsageError(
                f"--pin-core: expected auto or a list like 0,1, got {spec!r}"
            ) from None
        core = cores[rank % len(cores)]
    # Threads already running (MLX's, OpenBLAS's) keep their own affinity: set each;
    # threads started later inherit it.
    allowed: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
            allowed |= os.sched_getaffinity(int(tid))
        except ProcessLookupError:  # a thread that just ended
            continue
        except OSError as e:
            raise UsageError(f"--pin-core: cannot pin to core {core}: {e}") from None
    return sorted(allowed)


def prepare_model(args: Any, group: mx.distributed.Group) -> tuple[Path, str]:
    """The checkpoint path (a synthetic one is written by rank 0 first) and its label."""
    from .loader import default_model

    if args.synthetic:
        from .synthetic import parse_spec, synthetic_dir

        parse_spec(args.synthetic)
        if group.rank() == 0:
            synthetic_dir(args.synthetic)
        barrier(group)
        return synthetic_dir(args.synthetic), f"synthetic {args.synthetic}"
    path = Path(args.model) if args.model else default_model()
    return path, path.name


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _fmt_gb(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def print_table(r: dict[str, Any]) -> None:
    """The human-readable report (rank 0)."""
    rows = [("llama_tp", r["llama_tp"])]
    ml = r.get("mlx_lm")
    if ml and ml.get("supported"):
        rows.append(("mlx-lm", ml))
    vp = ", vocab-parallel" if r["vocab_parallel"] else ""
    blas = "reference BLAS" if r["blas"]["reference"] else (r["blas"]["library"] or "system BLAS")
    print(f"model: {r['model']}  ({r['ranks']} rank{'s' * (r['ranks'] > 1)}{vp}; {blas})")
    print(
        f"prompt {r['prompt_tokens']} tokens, generation {r['generation_tokens']} tokens, "
        f"{r['num_trials']} trials after a warm-up; pinned: {r['pin_core'] or 'no'}"
    )
    head = "| engine | prompt t/s | gen t/s | TTFT ms | load s | peak GB per rank | CPU/wall |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, x in rows:
        print(
            f"| {name} | {x['prompt_tps']:.2f} | {x['generation_tps']:.2f} | "
            f"{1e3 * x['ttft_s']:.1f} | {x['load_time_s']:.2f} | "
            f"{_fmt_gb(x['peak_memory_gb'])} | {x['cpu_per_wall']:.2f} |"
        )
    t = r["llama_tp"]
    print(
        "llama_tp loading: "
        + ", ".join(
            f"rank {i} read {b / 1e6:.1f} MB, peak {g:.2f} GB"
            for i, (b, g) in enumerate(
                zip(t["load_bytes_read"], t["load_peak_memory_gb"], strict=True)
            )
        )
    )
    if "ratio" in r:
        q = r["ratio"]
        print(
            f"| llama_tp / mlx-lm | {q['prompt_tps']:.2f}x | {q['generation_tps']:.2f}x | | | | |"
        )
        print(f"greedy tokens identical to mlx-lm's: first {r['same_tokens_as_mlx_lm']}")
    if ml and not ml.get("supported"):
        print(f"mlx-lm: {ml['reason']}")
    c, t = r["llama_tp"]["collectives"], r["llama_tp"]
    print(
        f"collectives per token: {c['all_reduces_per_token']} all-reduces "
        f"({c['all_reduces_per_layer']:.2f} per layer over {t['n_layers']} layers, "
        f"{c['all_reduces_in_embedding']} in the embedding), "
        f"{c['other_collectives_per_token']} other (sampling); "
        f"{c['collective_bytes_per_token'] / 1e3:.1f} KB per rank"
    )
    print(
        f"decode step: {t['decode_step_ms']:.1f} ms, {t['decode_step_ms_no_collectives']:.1f} ms "
        f"with collectives replaced by identity: {100 * t['collective_share']:.0f}% in collectives"
    )


def main() -> int:
    from .blas import check, hint, set_threads

    args = parser().parse_args()
    check_args(args)
    group = world()
    cores = pin(args.pin_core, group.rank()) if args.pin_core else None
    if args.blas_threads or cores:
        set_threads(args.blas_threads or len(cores))
    path, label = prepare_model(args, group)
    blas = check()
    if hint(blas):
        eprint0(hint(blas))
    result: dict[str, Any] = {
        "model": label,
        "model_path": str(path),
        "ranks": group.size(),
        "prompt_tokens": args.prompt_tokens,
        "generation_tokens": args.generation_tokens,
        "num_trials": args.num_trials,
        "prefill_step_size": args.prefill_step_size,
        "vocab_parallel": group.size() > 1 and not args.no_vocab_parallel,
        "pin_core": all_gather_object(cores, group) if cores else None,  # per rank
        "blas": blas.to_dict(),
        "ld_preload": os.environ.get("LD_PRELOAD") or None,
    }
    result["llama_tp"], prompt = bench_llama_tp(args, path, group)
    if args.compare == "mlx-lm":
        from .bench_mlx_lm import run_mlx_lm

        gc.collect()
        mx.clear_cache()
        error = None
        try:
            result["mlx_lm"] = run_mlx_lm(args, path, group, prompt)
        except Exception as e:  # every rank must learn of a failure before raising
            error = e
        agree_ok(error, group)
        ml, res = result["mlx_lm"], result["llama_tp"]
        if ml["supported"]:
            result["ratio"] = {
                k: res[k] / ml[k] if ml[k] else None for k in ("prompt_tps", "generation_tps")
            }
            same = _common_prefix(res["tokens"], ml["tokens"])
            result["same_tokens_as_mlx_lm"] = same
    if group.rank() == 0:
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print_table(result)
    return 0


if __name__ == "__main__":
    from .cli import run

    run(main)
