"""Run under mlx.launch: a tp x pp mesh computes what one process computes.

    mlx.launch -n 4 -- python tests/mp_mesh.py --tp 2 --pp 2 DIR[@SPLIT][%WEIGHTS] [DIR ...]
    mlx.launch -n 4 -- python tests/mp_mesh.py --tp 2 --pp 2 PRESPLIT=DIR[@SPLIT]

For each model (optionally with a `--pp-split` after `@`, e.g. DIR@1,3,1 or DIR@3:2, and
a `--split` of each tensor group after `%`, e.g. DIR%2:1) every
rank builds the unsharded reference and its own stage, runs both on the same
tokens (a prefill, then cached single-token steps) and greedy-decodes a few
tokens with both. `PRESPLIT=DIR` loads the stage from PRESPLIT (a folder pre-split
for the mesh) and the reference from DIR, and also loads DIR on the mesh: "mesh_diff"
is then max |logits of PRESPLIT - logits of DIR on the same mesh|.
Rank 0 prints one JSON line per model:
{"model", "diff" (max |logits - reference|), "same_tokens", "stages" (each rank's
stage, tensor rank, global layer range, parameter bytes without the norms, layers
built, all its parameter bytes), "full_bytes", ...}.
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model
from llama_tp.cluster.distributed import all_gather_object
from llama_tp.engine.generation import generate_step
from llama_tp.engine.sampling import make_sampler, vocab_shard
from llama_tp.kernels import status as kernel_status
from llama_tp.kernels.layers import use_native
from llama_tp.loading.loader import load_model


def last_logits(model, x: mx.array) -> np.ndarray:
    """The last position's logits after a prefill and after each of 3 cached steps: (4, V)."""
    cache = make_prompt_cache(model)
    shard = vocab_shard(model)

    def whole(logits: mx.array) -> mx.array:
        logits = logits[0, -1:].astype(mx.float32)
        return shard.full_logits(logits)

    out = [whole(model(x[:, :-3], cache=cache))]
    mx.eval(out[-1])
    for i in range(x.shape[1] - 3, x.shape[1]):
        out.append(whole(model(x[:, i : i + 1], cache=cache)))
        mx.eval(out[-1])
    return np.array(mx.concatenate(out, axis=0))


def greedy(model, prompt: list[int], n: int) -> list[int]:
    sampler = make_sampler(0.0, shard=vocab_shard(model))
    return [t for t, _ in generate_step(model, prompt, sampler, n)]


def non_norm_bytes(model) -> int:
    return sum(v.nbytes for k, v in tree_flatten(model.parameters()) if "norm" not in k)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--tokens", type=int, default=12)
    args = p.parse_args()
    world = mx.distributed.init()
    for spec in args.models:
        spec, _, weights = spec.partition("%")
        path, _, split = spec.partition("@")
        path, _, ref_path = path.partition("=")
        ref = build_model(open_checkpoint(ref_path or path))
        native = kernel_status().native and use_native(ref) > 0  # the loader's products
        mesh_flags = dict(tp=args.tp, pp=args.pp, pp_split=split or None, split=weights or None)
        model, _ = load_model(path, world, **mesh_flags)
        x = np.random.default_rng(0).integers(0, ref.args.vocab_size, (1, args.tokens))
        x = mx.array(x, mx.int32)
        got = last_logits(model, x)
        diff = float(np.max(np.abs(last_logits(ref, x) - got)))
        mesh_diff = None
        if ref_path:  # the unsplit checkpoint on the same mesh
            unsplit, _ = load_model(ref_path, world, **mesh_flags)
            mesh_diff = float(np.max(np.abs(last_logits(unsplit, x) - got)))
        prompt = x[0].tolist()
        same = greedy(ref, prompt, 8) == greedy(model, prompt, 8)
        mesh = model.mesh
        r = mesh.layers[mesh.stage]
        held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        mine = [mesh.stage, mesh.tp_rank, r.start, r.stop, non_norm_bytes(model), len(model.layers)]
        mine.append(held)
        stages = all_gather_object(mine, world)
        ok = all_gather_object((diff, same, mesh_diff), world)
        if world.rank() == 0:
            line = {
                "model": spec + (f"%{weights}" if weights else ""),
                "diff": max(d for d, _, _ in ok),
                "same_tokens": all(s for _, s, _ in ok),
                # the native kernels round activations to int16 per 32 (as mp_moe.py)
                "atol": 5e-4 if native else 1e-4,
                "mesh_diff": None if mesh_diff is None else max(m for _, _, m in ok),
                "stages": stages,
                "full_bytes": non_norm_bytes(ref),
                "n_layers": ref.args.n_layers,
                "tied": ref.args.tie_word_embeddings,
                "embedding_bytes": non_norm_bytes(ref.tok_embeddings),
            }
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
