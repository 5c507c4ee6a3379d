"""Run under mlx.launch: vocabulary-parallel embedding, head, samplers and log-probabilities.

    mlx.launch -n 3 -- python tests/mp_vocab_check.py MODEL_DIR [MODEL_DIR ...]

1. For each model: the vocabulary-parallel embedding equals the whole one exactly, and
   the gathered head logits equal the whole head's (fp32, 1e-5).
2. On fixed logits (vocabulary 389, which no N in 2..8 divides): many draws (one
   request's keys, token_key(123, i)) of the distributed temperature, top-k, top-p and
   min-p samplers follow the exact target distribution (chi-square, significance
   0.001), and every rank drew the same tokens.
3. Exact log-probabilities (chosen and top-k) without gathering the logits.
Rank 0 prints one `OK ...` line per check; any failure exits 1 on every rank.
"""

from __future__ import annotations

import math
import sys

import mlx.core as mx
import numpy as np

from llama_tp import kernels
from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model
from llama_tp.engine.sampling import Draw, VocabShard, sample, token_logprobs
from llama_tp.engine.settings import SamplingParams
from llama_tp.kernels.layers import use_native
from llama_tp.parallel.partition import vocab_ranges
from llama_tp.parallel.shard import shard_vocab

WORLD = mx.distributed.init()
FAILED = []


def report(name: str, ok: bool, detail: str = "") -> None:
    ok = bool(mx.distributed.all_sum(mx.array(int(not ok))).item() == 0)  # all ranks agree
    if not ok:
        FAILED.append(name)
    if WORLD.rank() == 0:
        print(f"{'OK' if ok else 'FAIL'} n={WORLD.size()} {name} {detail}", flush=True)


def check_model(path: str) -> None:
    whole = build_model(open_checkpoint(path))
    sharded = build_model(open_checkpoint(path))
    if kernels.status().native:  # the products the loader gives both
        use_native(whole), use_native(sharded)
    V = whole.args.vocab_size
    r = vocab_ranges(V, WORLD.size())[WORLD.rank()]
    shard_vocab(sharded, WORLD, r.start, r.stop)
    shard = VocabShard(r.start, r.stop, V, WORLD)
    ids = mx.array(np.random.default_rng(0).integers(0, V, (2, 7)), mx.int32)
    emb_ok = mx.array_equal(sharded.tok_embeddings(ids), whole.tok_embeddings(ids)).item()
    x = mx.random.normal((5, whole.args.dim), key=mx.random.key(1))
    head = whole.tok_embeddings.as_linear if whole.args.tie_word_embeddings else whole.output
    head_s = sharded.tok_embeddings.as_linear if whole.args.tie_word_embeddings else sharded.output
    diff = mx.abs(shard.full_logits(head_s(x)) - head(x)).max().item()
    report(f"embedding+head {path}", emb_ok and diff <= 1e-5, f"max_abs_diff={diff:.2g}")


def chi_square_ok(tokens: np.ndarray, probs: np.ndarray, alpha_z: float = 3.09) -> tuple:
    """Pearson chi-square against `probs`; bins with expected count < 5 are pooled.
    Critical value by the Wilson-Hilferty approximation at z=3.09 (alpha = 0.001)."""
    n = len(tokens)
    observed = np.bincount(tokens, minlength=len(probs)).astype(float)
    expected = probs * n
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    crit = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    outside = observed[probs == 0].sum()  # tokens the filter must never produce
    return stat <= crit and outside == 0, f"chi2={stat:.1f} crit={crit:.1f} df={df}"


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def check_samplers() -> None:
    V, draws = 389, 20000
    rng = np.random.default_rng(7)
    peaked = rng.normal(0, 2.0, V).astype(np.float32)
    flat = rng.normal(0, 0.05, V).astype(np.float32)  # top-p candidates cannot decide: fallback
    r = vocab_ranges(V, WORLD.size())[WORLD.rank()]
    shard = VocabShard(r.start, r.stop, V, WORLD)
    for name, logits, kw, target in [
        ("temperature", peaked, dict(temperature=0.8), softmax(peaked / 0.8)),
        ("top_k", peaked, dict(temperature=1.0, top_k=10), None),
        ("top_p", peaked, dict(temperature=0.7, top_p=0.9), None),
        ("min_p", peaked, dict(temperature=1.0, min_p=0.05), None),
        ("top_p_fallback", flat, dict(temperature=1.0, top_p=0.9), None),
    ]:
        if target is None:  # mlx-lm's filters on the whole vector define the target
            from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

            lp = mx.array(logits)[None] - mx.logsumexp(mx.array(logits))
            if "top_p" in kw:
                lp = apply_top_p(lp, kw["top_p"])
            if "min_p" in kw:
                lp = apply_min_p(lp, kw["min_p"])
            if "top_k" in kw:
                lp = apply_top_k(lp, kw["top_k"])
            target = softmax(np.array(lp[0]) / kw["temperature"])
        # Each row its own draw of one request's key schedule: token_key(123, i).
        rows = [Draw(SamplingParams(seed=123, **kw), i) for i in range(draws)]
        local = mx.broadcast_to(mx.array(logits[r.start : r.stop]), (draws, len(r)))
        tokens = np.array(sample(local, rows, shard)[0])
        agree = mx.distributed.all_gather(mx.array(tokens)[None]).reshape(WORLD.size(), -1)
        same = bool(mx.all(agree == agree[0]).item())
        ok, detail = chi_square_ok(tokens, target)
        report(f"sampler {name}", ok and same, f"{detail} same_on_all_ranks={same}")


def check_logprobs() -> None:
    V = 389
    logits = np.random.default_rng(3).normal(0, 3, (4, V)).astype(np.float32)
    r = vocab_ranges(V, WORLD.size())[WORLD.rank()]
    shard = VocabShard(r.start, r.stop, V, WORLD)
    tokens = mx.array([0, 100, 200, V - 1], mx.int32)
    got, ids, vals = token_logprobs(mx.array(logits[:, r.start : r.stop]), tokens, shard, top=5)
    ref, ref_ids, ref_vals = token_logprobs(mx.array(logits), tokens, VocabShard.whole(V), 5)
    ok = (
        mx.abs(got - ref).max().item() < 1e-5
        and mx.array_equal(ids, ref_ids).item()
        and mx.abs(vals - ref_vals).max().item() < 1e-5
    )
    report("logprobs", ok)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        check_model(path)
    check_samplers()
    check_logprobs()
    sys.exit(1 if FAILED else 0)
