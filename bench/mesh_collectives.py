"""Count one decode step's communication on every rank of a tp x pp mesh.

    MLX_RANK=r MLX_HOSTFILE=ring4.json python bench/mesh_collectives.py --tp 2 --pp 2

Loads the model (default: the built-in one) on the mesh, prefills a short prompt,
then builds and evaluates one greedy decode step with mx.distributed's collectives
and send/recv wrapped: each call is recorded as (op, group size, bytes this rank
contributes). Rank 0 prints one JSON line per rank: calls and bytes by op, and the
bytes of the parameters the rank holds.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from llama_tp.cluster.distributed import all_gather_object
from llama_tp.engine.generation import decode_step
from llama_tp.engine.sampling import make_sampler, vocab_shard
from llama_tp.loading.loader import default_model, load_model

OPS = ("all_sum", "all_gather", "all_max", "all_min", "send", "recv")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    args = p.parse_args()
    world = mx.distributed.init()
    model, _ = load_model(args.model or default_model(), world, tp=args.tp, pp=args.pp)
    cache = make_prompt_cache(model)
    sampler = make_sampler(0.0, shard=vocab_shard(model))
    prompt = mx.array([[1, 2, 3, 4]], mx.int32)
    model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    calls: list[tuple[str, int, int]] = []
    saved = {op: getattr(mx.distributed, op) for op in OPS}

    def wrap(op: str, fn):
        def wrapped(*a, **kw):
            group = kw.get("group") or world
            x = a[0] if op != "recv" else None
            n = x.nbytes if x is not None else 0
            calls.append((op, group.size(), n))
            return fn(*a, **kw)

        return wrapped

    for op, fn in saved.items():
        setattr(mx.distributed, op, wrap(op, fn))
    try:
        y, _, _ = decode_step(model, sampler, cache, mx.array([5], mx.int32))
        mx.eval(y)
    finally:
        for op, fn in saved.items():
            setattr(mx.distributed, op, fn)
    count = Counter((op, g) for op, g, _ in calls)
    sent = Counter()
    for op, g, n in calls:
        sent[(op, g)] += n
    mine = {f"{op}@{g}": [count[(op, g)], sent[(op, g)]] for op, g in sorted(count)}
    mine["parameter_bytes"] = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rows = all_gather_object(mine, world)
    if world.rank() == 0:
        for r, row in enumerate(rows):
            print(json.dumps({"rank": r, "calls_and_bytes": row}), flush=True)


if __name__ == "__main__":
    main()
