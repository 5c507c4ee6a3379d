"""Run under mlx.launch (or alone): greedy tokens and first-step logits of a chat prompt.

    mlx.launch -n 2 -- python tests/mp_greedy.py --model M --prompt P --tokens 16 --out F.npz

Ignores end-of-sequence so that every run yields exactly --tokens ids. Rank 0
writes the token ids and the last-position logits of the prompt to --out. With
--mlx-kernel everything runs as without llama_tp's native kernels (`kernels.off`).
"""

from __future__ import annotations

import argparse
import contextlib

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from llama_tp import kernels, load
from llama_tp.checkpoints.tokenizer import encode_prompt
from llama_tp.engine.sampling import make_sampler, vocab_shard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--out", required=True)
    p.add_argument("--no-vocab-parallel", action="store_true")
    p.add_argument("--mlx-kernel", action="store_true", help="without the native kernels")
    args = p.parse_args()
    world = mx.distributed.init()
    with kernels.off() if args.mlx_kernel else contextlib.nullcontext():
        run(args, world)


def run(args: argparse.Namespace, world: mx.distributed.Group) -> None:
    model, tokenizer = load(args.model, world, vocab_parallel=not args.no_vocab_parallel)
    ids = encode_prompt(tokenizer, args.prompt)
    cache = make_prompt_cache(model)
    shard = vocab_shard(model)
    sampler = make_sampler(shard=shard)  # greedy: a local maximum and one exchange

    def last(logits: mx.array) -> mx.array:  # (1, L, V or V_local) -> (1, V or V_local)
        return logits[:, -1].astype(mx.float32)

    logits = last(model(mx.array([ids]), cache=cache))
    first = np.array(shard.full_logits(logits)[0])
    tokens = [int(sampler(logits).item())]
    for _ in range(args.tokens - 1):
        tokens.append(int(sampler(last(model(mx.array([[tokens[-1]]]), cache=cache))).item()))
    if world.rank() == 0:
        np.savez(args.out, tokens=np.array(tokens), logits=first, prompt=np.array(ids))


if __name__ == "__main__":
    main()
