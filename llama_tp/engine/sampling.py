"""Samplers and log-probabilities over vocabulary-sharded logits.

With a vocabulary-parallel head each rank holds the logits of its own
vocabulary range only, (B, V_local). These functions pick tokens and compute
log-probabilities without gathering the full logits wherever that is exact,
and every rank ends with the same result:

- greedy: local maximum, then one tiny exchange of (value, index);
- temperature: Gumbel-max, the noise drawn for the whole vocabulary from a key
  all ranks share (so the draw does not depend on the rank count);
- top-k / top-p / min-p: each rank sends its best candidates; the filters run
  on the union with the exact normalizer (a distributed log-sum-exp); when the
  candidates cannot decide the filter, the full logits are gathered instead.

Without vocabulary parallelism the samplers are mlx-lm's own (`make_sampler`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

Sampler = Callable[[mx.array], mx.array]
CANDIDATES = 64  # per rank, for top-p / min-p; more than enough for peaked distributions


class VocabShard:
    """Where this rank's logits sit in the vocabulary: columns [start, stop) of `size`."""

    def __init__(
        self,
        start: int,
        stop: int,
        size: int,
        group: mx.distributed.Group,
        embedding: nn.Module | None = None,
        ranges: tuple[tuple[int, int], ...] | None = None,
    ):
        self.start, self.stop, self.size, self.group = start, stop, size, group
        self.embedding = embedding  # the VocabParallelEmbedding of these rows, if any
        # Every rank's (start, stop), by rank: balanced, or weighted by --split.
        self._ranges = ranges or getattr(embedding, "ranges", None)

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """Every rank's (start, stop): from the plan, else gathered once (collective)."""
        if self._ranges is None:
            mine = mx.array([[self.start, self.stop]], dtype=mx.int32)
            rows = mx.distributed.all_gather(mine, group=self.group, stream=mx.cpu).tolist()
            self._ranges = tuple((a, b) for a, b in rows)
        return self._ranges

    def most_rows(self) -> int:
        """The largest rank's row count."""
        return max(b - a for a, b in self.ranges())

    def top_candidates(self, scores: mx.array, k: int) -> tuple[mx.array, mx.array, mx.array]:
        """Every rank's k best (B, V_local) scores and their global ids, gathered: (B, N * k)
        each; a rank with fewer rows (an uneven or weighted split) sends all of them, padded
        with -inf. Also this rank's best unsent score (B,): -inf when it sent every row."""
        B, local = scores.shape
        if k < local:
            idx = mx.argpartition(-scores, kth=k - 1, axis=-1)[:, :k]
            vals = mx.take_along_axis(scores, idx, axis=-1)
            unsent = mx.min(vals, axis=-1)
        else:
            idx = mx.broadcast_to(mx.arange(local), (B, local))
            vals, unsent = scores, mx.full((B,), -math.inf)
            if local < k:
                vals = mx.concatenate([vals, mx.full((B, k - local), -math.inf, vals.dtype)], 1)
                idx = mx.concatenate([idx, mx.zeros((B, k - local), idx.dtype)], axis=1)
        vals = self.gather_rows(vals.astype(mx.float32))
        return vals, self.gather_rows((idx + self.start).astype(mx.int32)), unsent

    def gather_rows(self, x: mx.array) -> mx.array:
        """(B, k) from every rank -> (B, N * k), rank-major."""
        n = self.group.size()
        g = mx.distributed.all_gather(x, group=self.group)  # (N * B, k)
        return g.reshape(n, x.shape[0], -1).transpose(1, 0, 2).reshape(x.shape[0], -1)

    def full_logits(self, logits: mx.array) -> mx.array:
        """Every rank's logits concatenated: (B, V). The fallback; costs V floats per row
        (padded to the largest rank's rows)."""
        parts = self.ranges()
        width = max(b - a for a, b in parts)
        pad = mx.full((logits.shape[0], width - logits.shape[1]), -math.inf, logits.dtype)
        rows = self.gather_rows(mx.concatenate([logits, pad], axis=1))  # (B, N * width)
        return mx.concatenate(
            [rows[:, i * width : i * width + b - a] for i, (a, b) in enumerate(parts)], axis=1
        )

    def logsumexp(self, logits: mx.array) -> mx.array:
        """Exact log-sum-exp over the whole vocabulary: all-max, then all-sum. (B, 1)."""
        m = mx.distributed.all_max(mx.max(logits, axis=-1, keepdims=True), group=self.group)
        s = mx.distributed.all_sum(mx.exp(logits - m).sum(axis=-1, keepdims=True), group=self.group)
        return m + mx.log(s)

    def argmax(self, scores: mx.array) -> mx.array:
        """Global argmax of (B, V_local) scores: one exchange of (value, index). (B,)."""
        local = mx.argmax(scores, axis=-1)
        value = mx.take_along_axis(scores, local[:, None], axis=-1)[:, 0]
        # Indices travel as float32: exact below 2**24, far above any vocabulary.
        pair = mx.stack([value.astype(mx.float32), (local + self.start).astype(mx.float32)])
        g = mx.distributed.all_gather(pair, group=self.group).reshape(-1, 2, scores.shape[0])
        best = mx.argmax(g[:, 0, :], axis=0)  # first maximum: the lowest index, as argmax
        return mx.take_along_axis(g[:, 1, :], best[None], axis=0)[0].astype(mx.int32)

    def argmax_rows(self, scores: mx.array, embedding) -> tuple[mx.array, mx.array]:
        """Global argmax of (B, V_local) scores and the winner's embedding row, in one
        exchange: each rank sends (value, index, its candidate's row). -> (B,), (B, dim).

        The row is what the vocabulary-parallel embedding would otherwise complete
        with an all-reduce at the next step; here it rides along with the candidate.
        """
        B = scores.shape[0]
        local = mx.argmax(scores, axis=-1)  # (B,)
        value = mx.take_along_axis(scores, local[:, None], axis=-1)  # (B, 1)
        rows = embedding.local_rows(local)  # (B, dim), exact in float32
        packed = mx.concatenate(
            [
                value.astype(mx.float32),
                (local + self.start)[:, None].astype(mx.float32),
                rows.astype(mx.float32),
            ],
            axis=1,
        )  # (B, 2 + dim)
        g = mx.distributed.all_gather(packed, group=self.group).reshape(-1, B, packed.shape[1])
        best = mx.argmax(g[:, :, 0], axis=0)  # (B,): first maximum, the lowest index
        win = mx.take_along_axis(g, best[None, :, None], axis=0)[0]  # (B, 2 + dim)
        return win[:, 1].astype(mx.int32), win[:, 2:].astype(rows.dtype)

    def local_gumbel(self, key: mx.array, rows: int) -> mx.array:
        """This rank's columns of Gumbel noise drawn for the whole vocabulary."""
        return mx.random.gumbel(shape=(rows, self.size), key=key)[:, self.start : self.stop]


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
        seed: the key of the distributed sampler's noise (every rank must pass the same).
    """
    if shard is None:
        mlx_sampler = mlx_lm_make_sampler(temp=temp, top_p=top_p, min_p=min_p, top_k=top_k)
        return lambda logits: mlx_sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    key = [mx.random.key(seed)]

    def next_key() -> mx.array:
        key[0], sub = mx.random.split(key[0])
        return sub

    if top_p >= 1.0 and min_p == 0.0 and top_k == 0:
        if temp == 0:
            return FoldedSampler(shard, lambda logits: logits)
        return FoldedSampler(
            shard, lambda logits: logits / temp + shard.local_gumbel(next_key(), logits.shape[0])
        )
    filters = dict(top_p=top_p, min_p=min_p, top_k=top_k)
    return lambda logits: _filtered_sample(logits, shard, temp, next_key(), **filters)


class FoldedSampler:
    """Greedy or Gumbel-max on vocabulary shards: an argmax of `scores(logits)`.

    Called as a sampler it returns tokens (B,). `sample_with_rows` also returns the
    tokens' embedding rows (B, dim) from the same exchange, so that the next decode
    step skips the embedding's all-reduce (when the shard knows its embedding).
    """

    def __init__(self, shard: VocabShard, scores: Callable[[mx.array], mx.array]):
        self.shard, self.scores = shard, scores

    def __call__(self, logits: mx.array) -> mx.array:
        return self.shard.argmax(self.scores(logits))

    def sample_with_rows(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        if self.shard.embedding is None:
            return self(logits), None
        return self.shard.argmax_rows(self.scores(logits), self.shard.embedding)


def _filtered_sample(logits, shard, temp, key, top_p, min_p, top_k) -> mx.array:
    """top-p -> min-p -> top-k (mlx-lm's order), then a temperature draw, on candidates."""
    m = min(shard.most_rows(), max(CANDIDATES, top_k))  # the same count from every rank
    lse = shard.logsumexp(logits)  # (B, 1)
    cand, cand_ids, unsent = shard.top_candidates(logits, m)
    cand = cand - lse  # (B, C) exact log-probabilities
    # The best log-probability a token that was not sent could have (per rank: its m-th value).
    bound = mx.max(shard.gather_rows(unsent[:, None].astype(mx.float32)), axis=-1) - lse[:, 0]
    kept = cand
    if top_p < 1.0:
        kept = _top_p(kept, top_p)
    if min_p > 0.0:
        kept = apply_min_p(kept, min_p)
    if top_k > 0 and top_k < kept.shape[-1]:
        kept = apply_top_k(kept, top_k)
    survivors = mx.where(kept > -math.inf, kept, math.inf).min(axis=-1)
    decided = bound < survivors
    if top_p < 1.0:  # the candidates must also hold the nucleus mass themselves
        decided = decided & (mx.exp(kept).sum(axis=-1) >= top_p - 1e-6)
    if not (top_p < 1.0 or min_p > 0.0) or mx.all(decided).item():
        g = mx.random.gumbel(shape=kept.shape, key=key)
        pick = mx.argmax(kept / temp + g, axis=-1)
        return mx.take_along_axis(cand_ids, pick[:, None], axis=-1)[:, 0]
    # Undecidable from the candidates: gather everything and filter as mlx-lm does.
    full = shard.full_logits(logits) - lse
    if top_p < 1.0:
        full = apply_top_p(full, top_p)
    if min_p > 0.0:
        full = apply_min_p(full, min_p)
    if top_k > 0:
        full = apply_top_k(full, top_k)
    g = mx.random.gumbel(shape=full.shape, key=key)
    return mx.argmax(full / temp + g, axis=-1).astype(mx.int32)


def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """mlx-lm's nucleus rule on exact log-probabilities of a subset of the vocabulary:
    the mass is measured against the true total (1), not the subset's."""
    s = mx.sort(logprobs, axis=-1)
    mass_above = mx.cumsum(mx.exp(s), axis=-1, reverse=True, inclusive=False)
    dropped = (mass_above >= top_p).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(s, dropped, axis=-1)
    return mx.where(logprobs < threshold, -math.inf, logprobs)


def token_logprobs(
    logits: mx.array, tokens: mx.array, shard: VocabShard | None, top: int = 0
) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """Log-probabilities of `tokens` (B,) under logits (B, V or V_local), exactly.

    Returns (logprob (B,), top_ids (B, top), top_logprobs (B, top)); the last two
    are None when `top` is 0. With `shard`, no rank ever holds the full logits.
    """
    if shard is None:
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        if not top:
            return chosen, None, None
        ids = mx.argsort(-lp, axis=-1)[:, :top]
        return chosen, ids, mx.take_along_axis(lp, ids, axis=-1)
    lse = shard.logsumexp(logits)
    local = tokens - shard.start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = mx.take_along_axis(logits, mx.where(mine, local, 0)[:, None], axis=-1)[:, 0]
    chosen = mx.distributed.all_sum(mx.where(mine, picked, 0.0), group=shard.group) - lse[:, 0]
    if not top:
        return chosen, None, None
    vals, ids, _ = shard.top_candidates(logits, min(top, shard.most_rows()))
    order = mx.argsort(-vals, axis=-1)[:, :top]
    return (
        chosen,
        mx.take_along_axis(ids, order, axis=-1),
        mx.take_along_axis(vals, order, axis=-1) - lse,
    )


def vocab_shard(model) -> VocabShard | None:
    """The vocabulary range of `model`'s logits on this rank; None when they are whole."""
    from ..parallel.vocab import VocabParallelEmbedding

    if hasattr(model, "vocab_shard"):  # a pipeline stage (engine/pipeline.py) knows its own
        return model.vocab_shard()
    emb = model.tok_embeddings
    if not isinstance(emb, VocabParallelEmbedding):
        return None
    return VocabShard(emb.start, emb.stop, emb.vocab_size, emb.group, emb)
