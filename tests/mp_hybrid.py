"""Run under llama_tp.launch: Gated DeltaNet hybrids sharded equal one process.

    python -m llama_tp.launch -n N -- python tests/mp_hybrid.py MODEL [MODEL ...]
        [--steps 32] [--extras]

MODEL is PATH, PATH@T,P (a tp x pp mesh), PATH%3:1 (a weighted split) or SPLIT=SRC (a
folder pre-split by `convert --shards`, against SRC). For each, every rank loads it
sharded and builds it whole itself (the one-process reference), and checks:

- logits of a prefill then three cached single-token steps within `mp_moe.atol` (a
  mesh: the last position's, as a stage returns);
- `--steps` greedy tokens identical;
- what its caches hold after them (KV layers' keys and values, linear-attention layers'
  conv and delta-rule states of its own heads only) is what `plan` says
  (`placement.kv_cache_bytes`), and the fixed part (`placement.state_bytes`) too;
- what the loader read and held is its placement's bytes (read exactly from
  safetensors and float GGUF files).

`--extras` (first model): prompt-lookup speculative decoding gives the plain greedy
tokens (the recurrent state checkpointed and the kept drafts fed again), perplexity
equals one process's, and sequence-parallel prefill is refused in one line. Rank 0
prints one JSON line per check; a failure exits 1 on every rank.
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mp_moe import greedy, logits_of, reference

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model
from llama_tp.checkpoints.slices import model_shape
from llama_tp.checkpoints.tokenizer import load_tokenizer
from llama_tp.cluster.distributed import all_gather_object
from llama_tp.loading.loader import load_model
from llama_tp.parallel.placement import kv_cache_bytes, state_bytes


def held_bytes(cache: list) -> tuple[int, int]:
    """(all the caches hold, their recurrent states alone), in bytes."""
    total = state = 0
    for c in cache:
        if isinstance(c, ArraysCache):
            n = sum(a.nbytes for a in c.cache if a is not None)
            total, state = total + n, state + n
        elif c.keys is not None:
            total += c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes
    return total, state


def check(spec: str, world, steps: int) -> dict:
    spec, _, split = spec.partition("%")
    spec, _, shape = spec.partition("@")
    mesh = tuple(int(v) for v in shape.split(",")) if shape else None
    path, _, source = spec.partition("=")
    _, x, ref, ref_tokens, tol = reference(source or path, steps)  # once per checkpoint
    kw = dict(tp=mesh[0], pp=mesh[1]) if mesh else {}
    sharded, ckpt = load_model(path, world, split=split or None, **kw)
    got = logits_of(sharded, x)
    if mesh:  # a stage returns the last position of each call
        ref = ref[[x.shape[1] - 4, -3, -2, -1]]
    same = greedy(sharded, x[0].tolist(), steps) == ref_tokens
    cache = make_prompt_cache(sharded)
    for a, b in [(0, 7), (7, 8), (8, 9), (9, 10)]:
        mx.eval(sharded(x[:, a:b], cache=cache))
    held, state = held_bytes(cache)
    r = sharded.mesh.tp_rank if mesh else world.rank()
    placed = ckpt.placement.at(sharded.mesh.stage, r) if mesh else ckpt.placement.ranks[r]
    shape = model_shape(ckpt)
    stats = ckpt.load_stats
    sliced = ckpt.format == "hf" or (
        ckpt.format == "gguf" and all(n.startswith("F32 ") for n in ckpt.notes)
    )
    mine = {
        "cache": [held, kv_cache_bytes(shape, placed, tokens=10)],
        "state": [state, state_bytes(shape, placed)],
        "held": [stats["bytes_held"], stats["placement_bytes"]],
        "read_is_held": stats["bytes_read"] == stats["bytes_held"] if sliced else True,
        "key_heads": len(placed.part.unit("lin_k")),
    }
    ranks = all_gather_object(mine, world)
    return {
        "path": path,
        "split": split,
        "mesh": mesh,
        "n": world.size(),
        "diff": float(np.max(np.abs(ref - got))),
        "atol": tol,
        "same_tokens": same,
        "cache_is_planned": all(m["cache"][0] == m["cache"][1] for m in ranks),
        "state_is_planned": all(m["state"][0] == m["state"][1] > 0 for m in ranks),
        "held_is_placement": all(m["held"][0] == m["held"][1] for m in ranks),
        "read_is_held": all(m["read_is_held"] for m in ranks),
        "state_per_rank": [m["state"][0] for m in ranks],
        "key_heads": [m["key_heads"] for m in ranks],
    }


def extras(path: str, world) -> dict:
    """Speculative decoding, perplexity and the sequence-parallel refusal."""
    from llama_tp.engine.perplexity import perplexity

    whole = build_model(open_checkpoint(path))
    sharded, ckpt = load_model(path, world)
    prompt = ([5, 6, 7, 8] * 6)[:20]  # repeats: prompt lookup finds drafts
    spec = greedy(sharded, prompt, 24, load_tokenizer(ckpt)) == greedy(whole, prompt, 24)
    tokens = np.random.default_rng(1).integers(0, whole.args.vocab_size, 48).tolist()
    ppl = perplexity(sharded, tokens, 32, 16).perplexity
    ppl_whole = perplexity(whole, tokens, 32, 16).perplexity
    try:
        load_model(path, world, sequence_parallel=True)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return {"speculative_same_tokens": spec, "perplexity": [ppl, ppl_whole], "refusal": refusal}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--steps", type=int, default=32, help="greedy tokens compared")
    p.add_argument("--extras", action="store_true")
    args = p.parse_args()
    world = mx.distributed.init()
    failed = False
    for spec in args.models:
        line = check(spec, world, args.steps)
        keys = ("same_tokens", "cache_is_planned", "state_is_planned", "held_is_placement")
        ok = line["diff"] <= line["atol"] and all(line[k] for k in (*keys, "read_is_held"))
        failed |= not ok
        if world.rank() == 0:
            print(json.dumps({"ok": ok, **line}), flush=True)
    if args.extras:
        line = extras(args.models[0].partition("%")[0], world)
        ppl, ppl_whole = line["perplexity"]
        ok = line["speculative_same_tokens"] and abs(ppl - ppl_whole) <= 1e-4 * ppl_whole
        ok = ok and line["refusal"] == (
            "--sequence-parallel does not take recurrent layers (linear attention)"
        )
        failed |= not ok
        if world.rank() == 0:
            print(json.dumps({"ok": ok, "extras": True, **line}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
