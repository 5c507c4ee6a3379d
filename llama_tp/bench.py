"""`python -m llama_tp.bench`: prompt and generation speed, memory and collectives.

    python -m llama_tp.bench -p 512 -g 128 -n 5
    mlx.launch -n 2 -- python -m llama_tp.bench --synthetic 0.5b-fp16 -p 64 -g 32 --compare mlx-lm

In the spirit of `mlx_lm.benchmark` (same flag names) and llama-bench: random
prompt tokens (the same on every rank), one warm-up trial, end-of-sequence
ignored (greedy decoding through `generate_step`), the mean of `-n` trials.
From the model itself it reports the collectives of one decode step, counted
(`benchmarks.layer_collectives.count_collectives`), and the share of a decode step spent in
them: decode steps timed with the real collectives, then with each replaced by
identity (same compute, no communication): share = 1 - t_identity / t_real.
`--compare mlx-lm` runs mlx-lm's own loop on the same weights in the same run.
The runs themselves are in `llama_tp.benchmarks`.
"""

from __future__ import annotations

import gc
import json
import os
from typing import Any

import mlx.core as mx

from .cluster.distributed import agreed, all_gather_object, eprint0, world
from .console.command import script, start


def parser():
    from .console.cli import ArgumentParser, add_load_args, add_mesh_args

    p = ArgumentParser(
        prog="python -m llama_tp.bench",
        description="Benchmark prompt and generation speed, memory and collectives "
        "(one process, or every rank of a launcher).",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="GGUF file or HF/MLX directory (default: built-in SmolLM2)")
    src.add_argument(
        "--synthetic",
        metavar="SPEC",
        help="a random-weight model written once into the cache, e.g. 0.5b-fp16 or "
        "moe-a3b-fp32 (SIZE 0.5b, 0.1b, 1b, tiny, the Qwen3 qwen3, the Qwen3-MoE moe-tiny, "
        "moe-a3b, or the "
        "DeepSeek-V3 deepseek-tiny, deepseek-v3, the GLM-4.5 glm-tiny, glm4-moe, the Gated "
        "DeltaNet hybrids qwen35-tiny, qwen35, qwen35-moe, qwen3-next, the Gemma 4 "
        "gemma4-tiny, gemma4-moe, the DeepSeek-V3.2 dsv32-tiny, deepseek-v32, the MiniMax-M2 "
        "minimax-tiny, minimax, the Kimi-Linear kimi-tiny, kimi-linear, the Kimi K3 "
        "kimi-k3-tiny, kimi-k3, the Llama 4 "
        "llama4-tiny, llama4, the Step-3.5 step3p5-tiny, step3p5, the "
        "Nemotron-H nemotron-tiny, nemotron; "
        "DTYPE fp16, bf16, fp32 or q4)",
    )
    p.add_argument("--prompt-tokens", "-p", type=int, default=512, help="prompt length")
    p.add_argument("--generation-tokens", "-g", type=int, default=128, help="tokens to generate")
    p.add_argument("--num-trials", "-n", type=int, default=5, help="timed trials (after warm-up)")
    p.add_argument("--prefill-step-size", type=int, default=2048, help="prompt chunk size")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (rank 0); no progress bars"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars on stderr")
    p.add_argument("--compare", choices=["mlx-lm"], help="also run mlx-lm on the same weights")
    add_load_args(p)
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="prefill with the norms and residual stream split along the sequence",
    )
    add_mesh_args(p)
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
    p.add_argument(
        "--prompt", help="a prompt text (chat template applied) instead of -p random tokens"
    )
    p.add_argument(
        "--draft", metavar="ngram|PATH", help="speculative decoding: prompt lookup or a draft model"
    )
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="K", help="default 4")
    p.add_argument("--draft-sharded", action="store_true", help="shard the draft model too")
    return p


def check_args(args: Any) -> None:
    from .console.cli import UsageError, check_mesh_args
    from .engine.settings import MAX_DRAFT_TOKENS

    check_mesh_args(args)

    for name in ("prompt_tokens", "generation_tokens", "num_trials", "prefill_step_size"):
        if getattr(args, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be positive, got {getattr(args, name)}")
    if args.draft and not 1 <= args.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise UsageError(
            f"--num-draft-tokens must be from 1 to {MAX_DRAFT_TOKENS}, got {args.num_draft_tokens}"
        )
    if args.generation_tokens < 2:
        raise UsageError(f"--generation-tokens must be >= 2, got {args.generation_tokens}")


def main() -> int:
    from .benchmarks.report import common_prefix, print_table
    from .benchmarks.runner import bench_llama_tp, pin, prepare_model
    from .cluster.blas import check, hint, set_threads

    args = start(parser(), check_args)
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
        "cores": os.environ.get("LLAMA_TP_CORES"),  # set by llama_tp.launch (affinity.py)
        "blas": blas.to_dict(),
        "ld_preload": os.environ.get("LD_PRELOAD") or None,
    }
    result["llama_tp"], prompt = bench_llama_tp(args, path, group)
    if result["llama_tp"]["mesh"]["tp"] == 1:  # --pp = the ranks: no tensor group to split over
        result["vocab_parallel"] = False
    result["prompt_tokens"] = len(prompt)  # --prompt TEXT: its length
    result["prompt_text"] = args.prompt
    if args.compare == "mlx-lm":
        from .benchmarks.compare_mlx_lm import run_mlx_lm

        gc.collect()
        mx.clear_cache()
        mesh = result["llama_tp"]["mesh"]
        staged = mesh["pp"] > 1 and mesh["tp"] == 1  # mlx-lm's own pipeline beside it
        result["mlx_lm"] = agreed(lambda: run_mlx_lm(args, path, group, prompt, staged), group)
        result["mlx_lm"]["split"] = "pipeline" if staged else "tensor"
        ml, res = result["mlx_lm"], result["llama_tp"]
        if ml["supported"]:
            result["ratio"] = {
                k: res[k] / ml[k] if ml[k] else None for k in ("prompt_tps", "generation_tps")
            }
            same = common_prefix(res["tokens"], ml["tokens"])
            result["same_tokens_as_mlx_lm"] = same
    if group.rank() == 0:
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print_table(result)
    return 0


cli = script(main)  # the console script

if __name__ == "__main__":
    cli()
