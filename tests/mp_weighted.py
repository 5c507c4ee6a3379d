"""Run under mlx.launch: a weighted split (--split) computes what one process computes,
and every rank holds what the placement says.

    mlx.launch -n 3 -- python tests/mp_weighted.py DIR@3:1:1 DIR@1:2:5@expert \\
        SPLIT_DIR=DIR@2:1 DIR@memory ...

Each spec is `PATH[=REFERENCE]@SPLIT[@MOE_SPLIT][!OTHER]`: PATH loaded with
`load_model(..., split=SPLIT, moe_split=MOE_SPLIT)` (a pre-split folder: REFERENCE is the
unsplit checkpoint the logits are compared with); `!OTHER` then also loads PATH with
`split=OTHER` and reports each rank's error (a pre-split folder refuses another split).
Every rank builds the reference whole, runs both on the same tokens (a prefill, then
cached single-token steps) and greedy-decodes 8 tokens with both. Rank 0 prints one JSON
line per spec: {"spec", "diff" (max |logits - reference|), "same_tokens", "weights"
(the split as resolved, None: balanced), "ranks": per rank {"bytes_read", "bytes_held",
"placement_bytes", "parameter_bytes", "q_heads", "kv_heads", "ffn", "experts",
"expert_ffn", "vocab"}, "refused": each rank's error line for OTHER (or null)}.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mp_check_logits import logits_of

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model
from llama_tp.cluster.distributed import all_gather_object
from llama_tp.engine.generation import generate_step
from llama_tp.engine.loader import load_model
from llama_tp.engine.sampling import make_sampler, vocab_shard


def greedy(model, prompt: list[int], n: int) -> list[int]:
    sampler = make_sampler(0.0, shard=vocab_shard(model))
    return [t for t, _ in generate_step(model, prompt, sampler, n)]


def span(r: range | None) -> list[int] | None:
    return None if r is None else [r.start, r.stop]


def check(spec: str, world: mx.distributed.Group) -> dict:
    spec, _, other = spec.partition("!")
    path, split, *moe = spec.split("@")
    path, _, ref_path = path.partition("=")
    ref = build_model(open_checkpoint(ref_path or path))
    model, ckpt = load_model(path, world, split=split, moe_split=(moe or ["tensor"])[0])
    x = np.random.default_rng(0).integers(0, ref.args.vocab_size, (1, 12))
    x = mx.array(x, mx.int32)
    diff = float(np.max(np.abs(logits_of(ref, x) - logits_of(model, x))))
    prompt = x[0].tolist()
    same = greedy(ref, prompt, 8) == greedy(model, prompt, 8)
    placement = ckpt.placement
    mine = placement.ranks[world.rank()]
    part = mine.part
    stats = ckpt.load_stats
    row = {
        "bytes_read": stats["bytes_read"],
        "bytes_held": stats["bytes_held"],
        "placement_bytes": stats["placement_bytes"],
        "parameter_bytes": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
        "q_heads": span(part.q_heads),
        "kv_heads": span(part.kv_heads),
        "ffn": span(part.ffn),
        "experts": span(part.experts),
        "expert_ffn": span(part.expert_ffn),
        "vocab": span(mine.vocab),
    }
    refused = None
    if other:
        try:
            load_model(path, world, split=other)
            refused = "loaded"
        except Exception as e:
            refused = str(e).strip().splitlines()[0]
    everyone = all_gather_object((diff, same, row, refused), world)
    return {
        "spec": spec,
        "diff": max(d for d, _, _, _ in everyone),
        "same_tokens": all(s for _, s, _, _ in everyone),
        "weights": placement.plan.weights,
        "ranks": [r for _, _, r, _ in everyone],
        "refused": [f for _, _, _, f in everyone] if other else None,
    }


def main() -> int:
    world = mx.distributed.init()
    for spec in sys.argv[1:]:
        line = check(spec, world)
        if world.rank() == 0:
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
