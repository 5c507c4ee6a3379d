"""Run under mlx.launch: a weighted split (--split) computes what one process computes,
and every rank holds what the placement says.

    mlx.launch -n 3 -- python tests/mp_weighted.py DIR@3:1:1 DIR@1:2:5@expert \\
        SPLIT_DIR=DIR@2:1 DIR@memory ...

Each spec is `PATH[=REFERENCE]@SPLIT[@MOE_SPLIT][!OTHER]`: PATH loaded with
`load_model(..., split=SPLIT, moe_split=MOE_SPLIT)` (a pre-split folder: REFERENCE is the
unsplit checkpoint the logits are compared with); `!OTHER` then also loads PATH with
`split=OTHER` and reports each rank's error (a pre-split folder refuses another split).
Every rank builds the reference whole, runs both on the same tokens (a prefill, then
cached single-token steps) and greedy-decodes 8 tokens with both; on the last position
it also takes the 80 most likely tokens from the vocabulary shards (more than a small
rank's rows) and samples with top-p 0.5. Rank 0 prints one JSON line per spec: {"spec",
"diff" (max |logits - reference|, top-80 log-probabilities too), "same_tokens" (greedy,
the top-80 ids, and the sampled token inside the reference's nucleus), "weights"
(the split as resolved, None: balanced), "ranks": per rank {"bytes_read", "bytes_held",
"placement_bytes", "parameter_bytes", "q_heads", "kv_heads", "ffn", "experts",
"expert_ffn", "vocab"}, "refused": each rank's error line for OTHER (or null)}.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mp_check_logits import logits_of

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model
from llama_tp.cluster.distributed import all_gather_object
from llama_tp.engine.generation import generate_step
from llama_tp.engine.sampling import make_sampler, token_logprobs, vocab_shard
from llama_tp.kernels import status as kernel_status
from llama_tp.kernels.layers import use_native
from llama_tp.loading.loader import load_model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    sampler = make_sampler(0.0, shard=vocab_shard(model))
    return [t for t, _ in generate_step(model, prompt, sampler, n)]


def sharded_top(ref, model, x: mx.array) -> tuple[float, bool]:
    """The 80 most likely next tokens and a top-p 0.5 draw on the shards, against the
    reference's full logits: (max |log-probability diff|, same ids and token in the nucleus)."""
    shard = vocab_shard(model)
    local = model(x)[:, -1, :].astype(mx.float32)
    full = ref(x)[:, -1, :].astype(mx.float32)
    lp = np.array(full - mx.logsumexp(full, axis=-1, keepdims=True))[0]
    _, ids, vals = token_logprobs(local, mx.array([0]), shard, top=80)
    order = np.argsort(-lp, kind="stable")
    diff = float(np.max(np.abs(np.array(vals)[0] - lp[order[:80]])))
    token = make_sampler(1.0, top_p=0.5, shard=shard, seed=7)(local).item()
    before = np.cumsum(np.exp(lp[order])) - np.exp(lp[order])  # mass of the likelier ones
    nucleus = set(order[before < 0.5].tolist())
    # The ids, in order, are a top 80 of the reference up to ties within the tolerance:
    # two tokens whose log-probabilities differ by less than the products' rounding may
    # come in either order (the quantized products round activations per 32 values).
    ids = np.array(ids)[0]
    diff = max(diff, float(np.max(np.abs(lp[ids] - lp[order[:80]]))))
    return diff, len(set(ids.tolist())) == 80 and token in nucleus


def atol(whole: nn.Module) -> float:
    """1e-4, or 5e-4 for quantized products on the native kernels: they round activations
    to int16 per 32 values (as tests/mp_moe.py)."""
    quantized = any(isinstance(m, nn.QuantizedLinear) for m in whole.modules())
    return 5e-4 if quantized and kernel_status().native else 1e-4


def span(r: range | None) -> list[int] | None:
    return None if r is None else [r.start, r.stop]


def check(spec: str, world: mx.distributed.Group) -> dict:
    spec, _, other = spec.partition("!")
    path, split, *moe = spec.split("@")
    path, _, ref_path = path.partition("=")
    ref = build_model(open_checkpoint(ref_path or path))
    if kernel_status().native:  # the products the loader gives the sharded model
        use_native(ref)
    split = split or None  # DIR@ (nothing after the @): no --split
    model, ckpt = load_model(path, world, split=split, moe_split=(moe or ["tensor"])[0])
    x = np.random.default_rng(0).integers(0, ref.args.vocab_size, (1, 12))
    x = mx.array(x, mx.int32)
    diff = float(np.max(np.abs(logits_of(ref, x) - logits_of(model, x))))
    prompt = x[0].tolist()
    same = greedy(ref, prompt, 8) == greedy(model, prompt, 8)
    if not same:
        print(
            f"rank {world.rank()} {spec}: greedy {greedy(ref, prompt, 8)} vs "
            f"{greedy(model, prompt, 8)}",
            file=sys.stderr,
        )
    top_diff, same_top = sharded_top(ref, model, x) if vocab_shard(model) else (0.0, True)
    diff, same = max(diff, top_diff), same and same_top
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
        "atol": atol(ref),
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
