"""The sampler family and its key schedule, on vocabulary shards.

Every random draw of a request comes from its seed and the index of the token
being drawn, never from a global random state, the batch or the rank count:

- `token_key(seed, n)` is the key of the n-th generated token (n from 0);
- `gumbel(keys, ids)` is Gumbel noise for token ids under those keys, a pure
  function of (key, token id): each rank computes the noise of its own columns,
  a batch row its own, a speculative step the noise of the positions it checks;
- a sampled token is the argmax of `logits / T + noise` (Gumbel-max): greedy is
  the same argmax without noise (and without drawing any).

`sample` picks tokens for rows (B, V_local) each with its own settings
(`Draw`): greedy and temperature rows in one (value, index) exchange; top-p,
min-p and top-k rows on candidates: every rank sends its best values, the
filters (mlx-lm's rules, in mlx-lm's order: top-p, min-p, top-k) run on the
global top candidates with the exact normalizer, and when the candidates
cannot decide the filter the row's full logits are gathered instead. Either
way the kept tokens are the same, so the token is too. A whole vocabulary is
the one-shard case of the same code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ..parallel.vocab_shards import VocabShard, vocab_shard
from .settings import SamplingParams

__all__ = ["Draw", "Sampler", "VocabShard", "make_sampler", "sample", "token_key"]
__all__ += ["draw_arrays", "sample_arrays", "token_logprobs", "vocab_shard"]

CANDIDATES = 64  # per row, for top-p / min-p; more than enough for peaked distributions
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_key(seed: int, n: int) -> tuple[int, int]:
    """The key of the n-th generated token (n from 0) of a request seeded `seed`:
    two 32-bit words, the same alone, in a batch, on any rank, in speculative decoding."""
    x = _splitmix64((_splitmix64(seed & _MASK64) + n) & _MASK64)
    return x >> 32, x & 0xFFFFFFFF


def _fmix32(h: mx.array) -> mx.array:
    # murmur3's finalizer: a bijection of uint32 in which every input bit flips
    # each output bit with probability about 1/2
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@mx.compile
def _gumbel(k0: mx.array, k1: mx.array, ids: mx.array) -> mx.array:
    h = _fmix32(_fmix32((ids * 0x9E3779B1) ^ k0) ^ k1)
    u = ((h >> 8).astype(mx.float32) + 0.5) * 2.0**-24  # 24 bits, in (0, 1)
    return -mx.log(-mx.log(u))


def gumbel(keys: mx.array, ids: mx.array) -> mx.array:
    """Standard Gumbel noise for token ids (R or 1, C) uint32 under keys (R, 2) uint32:
    (R, C) float32, a function of each (key, id) pair alone."""
    return _gumbel(keys[:, :1], keys[:, 1:], ids.astype(mx.uint32))


@dataclass(frozen=True)
class Draw:
    """One row to sample: its settings and which token of its reply it picks."""

    params: SamplingParams
    index: int  # 0: the first generated token

    @property
    def key(self) -> tuple[int, int]:
        return token_key(self.params.seed, self.index)


def _keys(draws: Sequence[Draw]) -> mx.array:
    return mx.array([d.key for d in draws], dtype=mx.uint32)  # (R, 2)


def sample(
    logits: mx.array, draws: Sequence[Draw], shard: VocabShard, fold: bool = False
) -> tuple[mx.array, mx.array | None]:
    """Tokens (R,) for logits (R, V_local), row r drawn as `draws[r]` says.

    With `fold` and a vocabulary-parallel embedding, greedy and temperature rows also
    return the tokens' embedding rows (R, dim) from the same exchange (else None),
    so that the next forward skips the embedding's all-reduce.
    """
    logits = logits.astype(mx.float32)
    R = len(draws)
    filtered = [i for i, d in enumerate(draws) if d.params.filtered]
    noisy = [i for i, d in enumerate(draws) if not d.params.greedy and not d.params.filtered]
    scores = logits
    if noisy:
        temps = [1.0] * R
        for i in noisy:
            temps[i] = draws[i].params.temperature
        scores = logits / mx.array(temps)[:, None]
        noise = gumbel(_keys([draws[i] for i in noisy]), shard.columns())  # (P, V_local)
        scores = scores + noise if len(noisy) == R else scores.at[mx.array(noisy)].add(noise)
    if not filtered:
        return shard.argmax_rows(scores) if fold else (shard.argmax(scores), None)
    picked = _filtered(logits[mx.array(filtered)], [draws[i] for i in filtered], shard)
    if len(filtered) == R:
        return picked, None
    tokens = shard.argmax(scores)
    tokens[mx.array(filtered)] = picked
    return tokens, None


def sample_arrays(
    logits: mx.array,
    shard: VocabShard,
    temps: mx.array | None = None,
    keys: mx.array | None = None,
    noisy: mx.array | None = None,
) -> tuple[mx.array, mx.array | None]:
    """`sample(logits, draws, shard, fold=True)` for greedy and temperature rows, from
    arrays alone (what a compiled step takes): temps (R,) (1 where greedy), keys (R, 2)
    uint32, noisy (R,) bool; all None: every row greedy. The same operations on each row
    as `sample`, so the same tokens. -> tokens (R,), their embedding rows or None."""
    scores = logits.astype(mx.float32)
    if temps is not None:
        noise = gumbel(keys, shard.columns())
        scores = mx.where(noisy[:, None], scores / temps[:, None] + noise, scores)
    return shard.argmax_rows(scores)


def draw_arrays(draws: Sequence[Draw]) -> tuple[mx.array, mx.array, mx.array] | None:
    """`sample_arrays`' temps, keys and noisy for unfiltered draws (None: all greedy)."""
    if all(d.params.greedy for d in draws):
        return None
    noisy = [not d.params.greedy for d in draws]
    temps = [d.params.temperature if n else 1.0 for d, n in zip(draws, noisy, strict=True)]
    keys = [d.key if n else (0, 0) for d, n in zip(draws, noisy, strict=True)]
    return mx.array(temps), mx.array(keys, dtype=mx.uint32), mx.array(noisy)


def _filtered(logits: mx.array, draws: list[Draw], shard: VocabShard) -> mx.array:
    """Top-p / min-p / top-k rows: tokens (F,). Rows are grouped by their candidate count
    (at least CANDIDATES, at least top_k), which depends on the row's settings alone."""
    sizes = [min(shard.size, max(CANDIDATES, d.params.top_k)) for d in draws]
    if len(set(sizes)) == 1:
        return _on_candidates(logits, draws, shard, sizes[0])
    out = [0] * len(draws)
    for m in sorted(set(sizes)):
        rows = [i for i, s in enumerate(sizes) if s == m]
        picks = _on_candidates(logits[mx.array(rows)], [draws[i] for i in rows], shard, m)
        for i, t in zip(rows, picks.tolist(), strict=True):
            out[i] = t
    return mx.array(out, dtype=mx.int32)


def _on_candidates(logits: mx.array, draws: list[Draw], shard: VocabShard, M: int):
    """The filtered draw of each row from the global top-M tokens, or from the whole
    vocabulary for rows whose filter the candidates cannot decide. (F,)"""
    F, width = logits.shape
    m = min(M, shard.min_width)  # sent by every rank
    idx = mx.argpartition(-logits, kth=m - 1, axis=-1)[:, :m] if m < width else None
    idx = mx.broadcast_to(mx.arange(m), (F, m)) if idx is None else idx
    vals = mx.take_along_axis(logits, idx, axis=-1)
    top = mx.max(logits, axis=-1, keepdims=True)
    mass = mx.exp(logits - top).sum(axis=-1, keepdims=True)
    unsent = mx.min(vals, axis=-1, keepdims=True) if m < width else mx.full((F, 1), -math.inf)
    ids = (idx + shard.start).astype(mx.float32)  # exact below 2**24
    g = shard.all_gather(mx.concatenate([vals, ids, top, mass, unsent], axis=1))  # (N, F, 2m+3)
    high = g[:, :, 2 * m].max(axis=0)[:, None]  # (F, 1)
    lse = high + mx.log((g[:, :, 2 * m + 1] * mx.exp(g[:, :, 2 * m] - high[:, 0])).sum(0))[:, None]
    cand = g[:, :, :m].transpose(1, 0, 2).reshape(F, -1)  # (F, N * m)
    cand_ids = g[:, :, m : 2 * m].transpose(1, 0, 2).reshape(F, -1)
    order = mx.argsort(-cand, axis=-1)
    cand = mx.take_along_axis(cand, order, axis=-1)
    cand_ids = mx.take_along_axis(cand_ids, order, axis=-1).astype(mx.uint32)
    # The largest value a token that is not among the top M candidates can have.
    bound = g[:, :, 2 * m + 2].max(axis=0)[:, None]
    if cand.shape[1] > M:
        bound = mx.maximum(bound, cand[:, M : M + 1])
    cand, cand_ids = cand[:, :M], cand_ids[:, :M]
    # Candidates below the bound are not certainly above every unsent token: stop there,
    # and stand for every unsent token by one at the bound.
    pos = mx.arange(cand.shape[1] + 1)[None]
    certain = (cand >= bound).sum(axis=1, keepdims=True)  # a prefix: cand is sorted
    ext = mx.concatenate([cand, bound], axis=1)
    ext = mx.where(pos < certain, ext, mx.where(pos == certain, bound, -math.inf)) - lse
    kept = _kept(ext, draws)  # (F,)
    picks = _pick(ext[:, :-1], cand_ids, kept, draws)
    decided = kept <= certain[:, 0]
    if mx.all(decided).item():
        return picks
    # Undecidable from the candidates: the whole vocabulary of those rows (every rank
    # reached the same verdict from the same gathered numbers).
    undecided = [i for i, ok in enumerate(decided.tolist()) if not ok]
    rows = mx.array(undecided)
    full = shard.full_logits(logits[rows]) - lse[rows]  # (U, V)
    order = mx.argsort(-full, axis=-1)
    full = mx.take_along_axis(full, order, axis=-1)
    sub = [draws[i] for i in undecided]
    picks[rows] = _pick(full, order.astype(mx.uint32), _kept(full, sub), sub)
    return picks


def _kept(lp: mx.array, draws: list[Draw]) -> mx.array:
    """How many of the descending log-probabilities lp (F, C) the filters keep: (F,).

    top-p keeps a token while the mass of the tokens above it is below top_p, min-p
    while its probability is at least min_p times the largest, top-k the first k:
    each keeps a prefix, so together they keep the shortest of the three."""
    top_p = mx.array([d.params.top_p for d in draws])[:, None]
    min_p = mx.array([d.params.min_p for d in draws])[:, None]
    top_k = mx.array([d.params.top_k or lp.shape[1] for d in draws])[:, None]
    above = mx.cumsum(mx.exp(lp), axis=1, inclusive=False)
    keep = ((above < top_p) | (top_p >= 1.0)) & (lp >= lp[:, :1] + mx.log(min_p))
    keep = keep & (mx.arange(lp.shape[1])[None] < top_k)
    return mx.cumprod(keep.astype(mx.int32), axis=1).sum(axis=1)


def _pick(lp: mx.array, ids: mx.array, kept: mx.array, draws: list[Draw]) -> mx.array:
    """Gumbel-max over the first `kept` of each row's tokens: their ids (F,)."""
    temps = mx.array([d.params.temperature for d in draws])[:, None]
    scores = lp / temps + gumbel(_keys(draws), ids)
    scores = mx.where(mx.arange(lp.shape[1])[None] < kept[:, None], scores, -math.inf)
    best = mx.argmax(scores, axis=-1)
    return mx.take_along_axis(ids, best[:, None], axis=-1)[:, 0].astype(mx.int32)


def token_logprobs(
    logits: mx.array, tokens: mx.array, shard: VocabShard, top: int = 0
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """Log-probabilities of `tokens` (B,) under logits (B, V_local), exactly.

    Returns (logprob (B,), top_ids (B, top), top_logprobs (B, top)); the last two
    are None when `top` is 0. No rank ever holds the full logits.
    """
    logits = logits.astype(mx.float32)
    lse = shard.logsumexp(logits)
    chosen = shard.pick(logits, tokens) - lse[:, 0]
    if not top:
        return chosen, None, None
    vals, ids = shard.top(logits, top)
    return chosen, ids, vals - lse


class Sampler:
    """mlx-lm's sampler shape, logits (B, V_local) -> tokens (B,), on the key schedule:
    the n-th call draws token n of one sequence (every row with the same key)."""

    def __init__(self, params: SamplingParams, shard: VocabShard | None = None):
        self.params, self.shard, self.n = params, shard, 0

    def __call__(self, logits: mx.array) -> mx.array:
        return self.sample_with_rows(logits, fold=False)[0]

    def sample_with_rows(self, logits: mx.array, fold: bool = True):
        """(tokens (B,), their embedding rows (B, dim) or None): see `sample`."""
        shard = self.shard or VocabShard.whole(logits.shape[-1])
        draws = [Draw(self.params, self.n)] * logits.shape[0]
        self.n += 1
        return sample(logits, draws, shard, fold)


def make_sampler(
    temp: float = 0.0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    top_k: int = 0,
    shard: VocabShard | None = None,
    seed: int = 0,
) -> Sampler:
    """A sampler from logits (B, V) — or (B, V_local) with `shard` — to tokens (B,).

    Args:
        temp: temperature; 0 is greedy.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        min_p: keep tokens with probability >= min_p * the largest; 0 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        shard: where this rank's logits sit when the vocabulary is sharded.
        seed: with the call count, the key of every draw (`token_key`).
    """
    params = SamplingParams(temperature=temp, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed)
    return Sampler(params, shard)
