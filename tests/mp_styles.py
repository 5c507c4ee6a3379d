"""Run under mlx.launch: parallel styles and sequence parallelism on real ranks.

    mlx.launch -n 2 -- python tests/mp_styles.py --builtin DIR... --custom DIR --sp DIR...
        [--einshard]

Rank 0 prints one JSON line: per model the max |difference| of the logits
- builtin: the built-in plan passed explicitly (`plan=llama_plan(...)`) vs the default
  load (must be 0) and vs the whole model, and whether the default load's layers are
  the ones `Attention.shard` and `FeedForward.shard` made (the loader's path);
- custom: attention sharded, feed-forward replicated (whole tensors read) vs whole;
- sp: --sequence-parallel vs the plain tensor-parallel load, prefill logits of prompt
  lengths N does and does not divide (also after a first prefill: a cache offset),
  the query blocks attention runs in, and greedy tokens;
and, with --einshard, what tests/mp_einshard.py checks.
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model
from llama_tp.engine.generation import generate_step
from llama_tp.engine.sampling import make_sampler, vocab_shard
from llama_tp.kernels import status as kernel_status
from llama_tp.kernels.layers import use_native
from llama_tp.loading.loader import load_model
from llama_tp.parallel.llama_plan import llama_plan
from llama_tp.parallel.styles import ColwiseParallel, Replicate, RowwiseParallel

sys.path.insert(0, "tests")
from mp_check_logits import logits_of  # noqa: E402


def prefill_logits(model, x: mx.array) -> np.ndarray:
    """Logits of every position of one prefill, (L, V), gathered when vocabulary-sharded."""
    shard = vocab_shard(model)
    out = model(x, cache=make_prompt_cache(model))[0].astype(mx.float32)
    out = shard.full_logits(out)
    mx.eval(out)
    return np.array(out)


def prefill_after(model, first: mx.array, x: mx.array) -> np.ndarray:
    """Logits of a prefill of `x` after one of `first` on the same cache (offset > 0)."""
    cache = make_prompt_cache(model)
    mx.eval(model(first, cache=cache))
    shard = vocab_shard(model)
    out = model(x, cache=cache)[0].astype(mx.float32)
    out = shard.full_logits(out)
    mx.eval(out)
    return np.array(out)


def query_lengths(model, x: mx.array) -> tuple[list[int], list]:
    """The query lengths of every attention call of one prefill of `x` (all layers),
    and each attention's `query_chunk` afterwards."""
    import llama_tp.models.attention as llama_model

    seen, attend = [], llama_model.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append(q.shape[2])
        return attend(q, k, v, **kwargs)

    llama_model.scaled_dot_product_attention = spy
    try:
        mx.eval(model(x, cache=make_prompt_cache(model)))
    finally:
        llama_model.scaled_dot_product_attention = attend
    return seen, [layer.attention.query_chunk for layer in model.layers]


def greedy(model, prompt: list[int], n: int = 8) -> list[int]:
    sampler = make_sampler(shard=vocab_shard(model))
    return [t for t, _ in generate_step(model, prompt, sampler, n, prefill_step_size=7)]


def diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


def spy_on_shard() -> tuple[dict[int, list[int]], object]:
    """Record what every `Attention.shard` / `FeedForward.shard` call makes: the mixer's
    id -> the ids of the projections it holds afterwards; and a function undoing the spy."""
    from llama_tp.models.attention import Attention
    from llama_tp.models.feed_forward import FeedForward

    made: dict[int, list[int]] = {}
    saved = {Attention: Attention.shard, FeedForward: FeedForward.shard}
    for kind, names in ((Attention, ("wq", "wk", "wv", "wo")), (FeedForward, ("w1", "w2", "w3"))):

        def spy(self, group, part=None, real=saved[kind], names=names):
            real(self, group, part)
            made[id(self)] = [id(self[k]) for k in names]

        kind.shard = spy

    def undo() -> None:
        for kind, real in saved.items():
            kind.shard = real

    return made, undo


def held_projections(model) -> dict[int, list[int]]:
    """`spy_on_shard`'s view of what `model` holds: every layer's mixers and projections."""
    out = {}
    for layer in model.layers:
        a, f = layer.attention, layer.feed_forward
        out[id(a)] = [id(a[k]) for k in ("wq", "wk", "wv", "wo")]
        out[id(f)] = [id(f[k]) for k in ("w1", "w2", "w3")]
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--builtin", nargs="*", default=[])
    p.add_argument("--custom", nargs="*", default=[])
    p.add_argument("--sp", nargs="*", default=[])
    p.add_argument("--einshard", action="store_true")
    args = p.parse_args()
    g = mx.distributed.init()
    n = g.size()
    out: dict = {"n": n, "builtin": {}, "custom": {}, "sp": {}}
    rng = np.random.default_rng(0)

    def tokens(vocab: int, length: int) -> mx.array:
        return mx.array(rng.integers(0, vocab, (1, length)), mx.int32)

    for path in args.builtin:
        ref = build_model(open_checkpoint(path))
        # the products the loader gives the sharded models; they round activations to
        # int16 per 32 values, hence 5e-4 for quantized models on them (as mp_moe.py)
        native = kernel_status().native and use_native(ref) > 0
        x = tokens(ref.args.vocab_size, 10)
        made, undo = spy_on_shard()
        try:
            default, _ = load_model(path, g)
        finally:
            undo()
        by_kinds = held_projections(default) == made
        explicit, _ = load_model(path, g, plan=llama_plan(ref, n))
        a, b, c = logits_of(ref, x), logits_of(default, x), logits_of(explicit, x)
        out["builtin"][path] = [diff(b, c), diff(a, c), 5e-4 if native else 1e-4, by_kinds]

    for path in args.custom:
        ref = build_model(open_checkpoint(path))
        x = tokens(ref.args.vocab_size, 10)
        plan = {
            "layers.*.attention.w[qkv]": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward": Replicate(),
        }
        model, _ = load_model(path, g, vocab_parallel=False, plan=plan)
        ffn = model.layers[0].feed_forward.w1.weight.shape
        wq = model.layers[0].attention.wq.weight.shape
        whole = (ffn == ref.layers[0].feed_forward.w1.weight.shape) and (
            wq[0] * n == ref.layers[0].attention.wq.weight.shape[0]
        )
        out["custom"][path] = [diff(logits_of(ref, x), logits_of(model, x)), whole]

    for path in args.sp:
        plain, _ = load_model(path, g)
        sp, _ = load_model(path, g, sequence_parallel=True)
        vocab = plain.args.vocab_size
        res = {}
        for length in (2, n + 1, 4 * n, 4 * n + 1, 7 * n - 1):
            x = tokens(vocab, length)
            res[f"L{length}"] = diff(prefill_logits(plain, x), prefill_logits(sp, x))
        first, x = tokens(vocab, 3 * n + 1), tokens(vocab, 4 * n + 1)
        res["offset"] = diff(prefill_after(plain, first, x), prefill_after(sp, first, x))
        # Attention takes its queries one sequence chunk (ceil(L / N)) at a time under
        # sequence parallelism, all at once on the plain path; nothing stays set.
        c, layers = -(-x.shape[1] // n), len(plain.layers)
        blocks = [min(c, x.shape[1] - a) for a in range(0, x.shape[1], c)]
        res["query_blocks"] = [
            [query_lengths(sp, x), [blocks * layers, [None] * layers]],
            [query_lengths(plain, x), [[x.shape[1]] * layers, [None] * layers]],
        ]
        x = tokens(vocab, 12)
        res["decode"] = diff(logits_of(plain, x), logits_of(sp, x))
        # Active: the embedding hands each rank its chunk, ceil(L / N) positions.
        res["chunk"] = sp.tok_embeddings(tokens(vocab, 4 * n + 1)).shape[1] == 5
        prompts = [tokens(vocab, length)[0].tolist() for length in (4 * n, 4 * n + 1)]
        res["greedy"] = all(greedy(plain, q) == greedy(sp, q) for q in prompts)
        out["sp"][path] = res

    if args.einshard:
        import mp_einshard

        out["einshard"] = mp_einshard.checks(g)
    if g.rank() == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
