"""How much of a decode step is Python and graph building (issue: graph overhead).

    python bench/step_overhead.py [--dtype float32] [-g 64]
    python -m llama_tp.launch -n 2 -- python bench/step_overhead.py --dtype float32

Times, per decode step of the built-in model (greedy, steady state): the whole
step as `generate_step` runs it, and the part spent in Python building the step's
graph (model call + sampler, no evaluation). The rest is MLX evaluating the graph,
which `mx.compile` cannot shorten; compiling can at most remove the building part
(and, on the CPU, fuse some element-wise kernels). Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from llama_tp import default_model, load_model, print0, world
from llama_tp.cluster.distributed import all_gather_object
from llama_tp.engine.generation import decode_step, generate_step
from llama_tp.engine.sampling import make_sampler, vocab_shard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("-g", type=int, default=64)
    args = p.parse_args()
    group = world()
    model, _ = load_model(args.model or default_model(), group, True, args.dtype)
    sampler = make_sampler(shard=vocab_shard(model))
    prompt = list(range(100, 164))
    # whole steps, as generation runs them (async_eval overlap included)
    for _ in generate_step(model, prompt, sampler, 8):
        pass
    tic = time.perf_counter()
    n = 0
    for i, _ in enumerate(generate_step(model, prompt, sampler, args.g + 1)):
        if i == 0:
            tic = time.perf_counter()  # after the prefill and the first token
        n = i
    step_ms = 1e3 * (time.perf_counter() - tic) / n
    # graph building alone: the same step's graph, never evaluated
    cache = make_prompt_cache(model)
    y, _, rows = decode_step(model, sampler, cache, mx.array(prompt, dtype=mx.int32))
    mx.eval(y, rows if rows is not None else y)
    builds = []
    for _ in range(args.g):
        t = time.perf_counter()
        out = decode_step(model, sampler, cache, y, rows)
        builds.append(time.perf_counter() - t)
        mx.eval(out[0], out[2] if out[2] is not None else out[0])
        y, rows = out[0], out[2]
    build_ms = 1e3 * sorted(builds)[len(builds) // 2]
    res = all_gather_object({"step_ms": step_ms, "build_ms": build_ms}, group)
    print0(
        json.dumps(
            {
                "ranks": group.size(),
                "dtype": args.dtype or "as stored",
                "step_ms": [round(r["step_ms"], 2) for r in res],
                "graph_build_ms": [round(r["build_ms"], 2) for r in res],
                "build_share": [round(r["build_ms"] / r["step_ms"], 3) for r in res],
            }
        )
    )


if __name__ == "__main__":
    main()
