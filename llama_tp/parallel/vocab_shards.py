"""Where this rank's logits sit in the vocabulary, and the exchanges over them.

With a vocabulary-parallel head each rank holds the logits of columns
[start, stop) only, (B, V_local); a whole vocabulary is the one-shard case
(start 0, stop = size, no group): every method then works on the local columns
and makes no exchange. The samplers, log-probabilities, speculative decoding
and perplexity take a `VocabShard` and never ask which case they are in.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn


class VocabShard:
    """Columns [start, stop) of a `size`-token vocabulary, spread over `group`."""

    def __init__(
        self,
        start: int,
        stop: int,
        size: int,
        group: mx.distributed.Group | None = None,
        embedding: nn.Module | None = None,
        ranges: tuple[tuple[int, int], ...] | None = None,
    ):
        self.start, self.stop, self.size, self.group = start, stop, size, group
        self.embedding = embedding  # the VocabParallelEmbedding of these rows, if any
        self.ranks = 1 if group is None else group.size()
        # Every rank's (start, stop), by rank: balanced, or weighted by --split.
        self._ranges = ranges or getattr(embedding, "ranges", None)
        if self.ranks == 1:
            self._ranges = ((start, stop),)

    @classmethod
    def whole(cls, size: int) -> VocabShard:
        """The whole vocabulary on this rank."""
        return cls(0, size, size)

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """Every rank's (start, stop): from the plan, else gathered once (collective)."""
        if self._ranges is None:
            mine = mx.array([[self.start, self.stop]], dtype=mx.int32)
            rows = mx.distributed.all_gather(mine, group=self.group, stream=mx.cpu).tolist()
            self._ranges = tuple((a, b) for a, b in rows)
        return self._ranges

    @property
    def min_width(self) -> int:
        """The fewest columns any rank holds (a weighted --split makes them unequal)."""
        return min(b - a for a, b in self.ranges())

    @property
    def max_width(self) -> int:
        """The most columns any rank holds."""
        return max(b - a for a, b in self.ranges())

    def columns(self) -> mx.array:
        """This rank's token ids: (1, V_local) uint32."""
        return mx.arange(self.start, self.stop, dtype=mx.uint32)[None]

    def all_gather(self, x: mx.array) -> mx.array:
        """Every rank's x (rows, k) stacked: (ranks, rows, k)."""
        if self.ranks == 1:
            return x[None]
        return mx.distributed.all_gather(x, group=self.group).reshape(self.ranks, *x.shape)

    def all_sum(self, x: mx.array) -> mx.array:
        return x if self.ranks == 1 else mx.distributed.all_sum(x, group=self.group)

    def full_logits(self, logits: mx.array) -> mx.array:
        """Every rank's logits concatenated: (B, V). The fallback; costs V floats per row."""
        if self.ranks == 1:
            return logits
        parts = self.ranges()
        width = max(b - a for a, b in parts)  # padded to the largest rank's columns
        pad = mx.full((logits.shape[0], width - logits.shape[1]), -math.inf, logits.dtype)
        rows = self.all_gather(mx.concatenate([logits, pad], axis=1))  # (N, B, width)
        return mx.concatenate([rows[i, :, : b - a] for i, (a, b) in enumerate(parts)], axis=1)

    def logsumexp(self, logits: mx.array) -> mx.array:
        """Exact log-sum-exp over the whole vocabulary: all-max, then all-sum. (B, 1)."""
        if self.ranks == 1:
            return mx.logsumexp(logits, axis=-1, keepdims=True)
        m = mx.distributed.all_max(mx.max(logits, axis=-1, keepdims=True), group=self.group)
        return m + mx.log(self.all_sum(mx.exp(logits - m).sum(axis=-1, keepdims=True)))

    def pick(self, x: mx.array, tokens: mx.array) -> mx.array:
        """x[b, tokens[b]] for (B, V_local) x and global ids (B,): one all-sum. (B,)."""
        local = tokens - self.start
        mine = (local >= 0) & (local < x.shape[-1])
        picked = mx.take_along_axis(x, mx.where(mine, local, 0)[:, None], axis=-1)[:, 0]
        return self.all_sum(mx.where(mine, picked, 0.0))

    def top(self, x: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """The k largest values of (B, V_local) x over the whole vocabulary, descending,
        and their ids: ((B, k) float32, (B, k) int32). One exchange."""
        (B, local), m = x.shape, min(k, self.max_width)  # the same count from every rank
        idx = mx.argpartition(-x, kth=m - 1, axis=-1)[:, :m] if m < local else None
        idx = mx.broadcast_to(mx.arange(min(m, local)), (B, min(m, local))) if idx is None else idx
        vals = mx.take_along_axis(x, idx, axis=-1).astype(mx.float32)
        if local < m:  # a rank with fewer rows (a weighted --split) sends all, padded
            vals = mx.concatenate([vals, mx.full((B, m - local), -math.inf, mx.float32)], 1)
            idx = mx.concatenate([idx, mx.zeros((B, m - local), idx.dtype)], axis=1)
        # ids travel as float32: exact below 2**24, far above any vocabulary
        both = self.all_gather(mx.concatenate([vals, (idx + self.start).astype(mx.float32)], 1))
        both = both.transpose(1, 0, 2)  # (B, N, 2m)
        vals, ids = both[:, :, :m].reshape(B, -1), both[:, :, m:].reshape(B, -1)
        order = mx.argsort(-vals, axis=-1)[:, :k]
        ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
        return mx.take_along_axis(vals, order, axis=-1), ids

    def argmax(self, scores: mx.array) -> mx.array:
        """Global argmax of (B, V_local) scores: one exchange of (value, index). (B,)."""
        return self._argmax(scores, None)[0]

    def argmax_rows(self, scores: mx.array) -> tuple[mx.array, mx.array | None]:
        """Global argmax of (B, V_local) scores and the winner's embedding row, in one
        exchange: each rank sends (value, index, its candidate's row). -> (B,), (B, dim).

        The row is what the vocabulary-parallel embedding would otherwise complete
        with an all-reduce at the next step; here it rides along with the candidate.
        Without a vocabulary-parallel embedding the row is None.
        """
        return self._argmax(scores, self.embedding)

    def _argmax(self, scores: mx.array, embedding) -> tuple[mx.array, mx.array | None]:
        local = mx.argmax(scores, axis=-1)  # (B,)
        if self.ranks == 1:
            return (local + self.start).astype(mx.int32), None
        value = mx.take_along_axis(scores, local[:, None], axis=-1)  # (B, 1)
        parts = [value.astype(mx.float32), (local + self.start)[:, None].astype(mx.float32)]
        rows = None
        if embedding is not None:
            rows = embedding.local_rows(local)  # (B, dim), exact in float32
            parts.append(rows.astype(mx.float32))
        g = self.all_gather(mx.concatenate(parts, axis=1))  # (N, B, 2 [+ dim])
        best = mx.argmax(g[:, :, 0], axis=0)  # (B,): the first maximum, the lowest index
        win = mx.take_along_axis(g, best[None, :, None], axis=0)[0]
        tokens = win[:, 1].astype(mx.int32)
        return tokens, None if rows is None else win[:, 2:].astype(rows.dtype)


def vocab_shard(model: nn.Module) -> VocabShard:
    """The vocabulary columns of `model`'s logits on this rank (the whole vocabulary, as
    one shard, when the head is not vocabulary-parallel)."""
    from .vocab import VocabParallelEmbedding

    if hasattr(model, "vocab_shard"):  # a pipeline stage (loading/pipeline.py) knows its own
        shard = model.vocab_shard()
        return shard if shard is not None else VocabShard.whole(model.args.vocab_size)
    emb = model.tok_embeddings
    if not isinstance(emb, VocabParallelEmbedding):
        return VocabShard.whole(model.args.vocab_size)
    return VocabShard(emb.start, emb.stop, emb.vocab_size, emb.group, emb)
