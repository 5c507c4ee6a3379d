"""Speculative decoding under tensor parallelism: draft k tokens, verify them in one forward.

Each step the drafter (`engine/drafters.py`) proposes tokens d_1..d_n (n <= k);
the target model scores [y, d_1, ..., d_n] in one sharded forward, so the
collective round of its layers (2 all-reduces per layer) is paid once for up
to n + 1 tokens. Acceptance is exact and computed identically on every rank:

- greedy: the longest prefix of drafts equal to the target's argmax, then the
  target's own next token (one (value, index) exchange for all n + 1 rows);
- sampling (temperature T): d_i is kept with probability min(1, p_i(d_i) / q_i(d_i));
  at the first rejection the token is drawn from the residual max(0, p_i - q_i)
  (renormalized), after n acceptances from p_{n+1}. For prompt lookup q_i is a
  point mass, so the residual is p_i without d_i. This keeps the output
  distribution exactly the target's.

With a vocabulary-parallel head each rank holds logits (n + 1, V_local). The
rule needs only the drafts' log-probabilities (a distributed log-sum-exp and
the owner's logit, one all-sum) and residual draws, which are Gumbel-max on the
shards (noise for the whole vocabulary from the shared key, residual masked):
four small collectives per step, whatever n. Both caches are trimmed to the
accepted length with mlx-lm's `trim_prompt_cache`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from ..cluster.collectives import collectives
from .drafters import Drafter
from .pipeline import verify_logits
from .sampling import VocabShard


@dataclass
class SpecStats:
    """What speculative decoding did in one generation (`Response.speculative`)."""

    drafted: int = 0  # tokens proposed by the drafter
    accepted: int = 0  # of those, kept by the target
    target_forwards: int = 0  # verification forwards of the target (decode steps)
    generated: int = 0  # tokens produced by those forwards
    collectives: int = 0  # collective rounds made while decoding (draft, verify, accept)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.target_forwards if self.target_forwards else 0.0

    @property
    def collectives_per_token(self) -> float:
        return self.collectives / self.generated if self.generated else 0.0

    def summary(self) -> str:
        return (
            f"acceptance {100 * self.acceptance_rate:.1f}% ({self.accepted}/{self.drafted} "
            f"drafted), {self.tokens_per_forward:.2f} tokens per target forward, "
            f"{self.collectives_per_token:.1f} collective rounds per token"
        )

    def to_dict(self) -> dict[str, float]:
        d = dict(self.__dict__)
        d.update(
            acceptance_rate=self.acceptance_rate,
            tokens_per_forward=self.tokens_per_forward,
            collectives_per_token=self.collectives_per_token,
        )
        return d


class KeyStream:
    """Random keys from a seed every rank shares (as `make_sampler(seed=...)` draws them)."""

    def __init__(self, seed: int):
        self.key = mx.random.key(seed)

    def next(self) -> mx.array:
        self.key, sub = mx.random.split(self.key)
        return sub


def _lse(z: mx.array, shard: VocabShard | None) -> mx.array:
    """log-sum-exp over the whole vocabulary: (R, 1)."""
    return mx.logsumexp(z, axis=-1, keepdims=True) if shard is None else shard.logsumexp(z)


def _owned(x: mx.array, tokens: mx.array, shard: VocabShard | None) -> tuple[mx.array, mx.array]:
    """x[r, tokens[r]] where this rank holds the token (else 0), and whether it does."""
    local = tokens if shard is None else tokens - shard.start
    mine = (local >= 0) & (local < x.shape[-1])
    picked = mx.take_along_axis(x, mx.where(mine, local, 0)[:, None], axis=-1)[:, 0]
    return mx.where(mine, picked, 0.0), mine


def _argmax(scores: mx.array, shard: VocabShard | None) -> mx.array:
    return mx.argmax(scores, axis=-1).astype(mx.int32) if shard is None else shard.argmax(scores)


def accept(
    logits: mx.array,
    drafts: mx.array,
    q: mx.array | None,
    temp: float,
    shard: VocabShard | None,
    keys: KeyStream | None,
) -> tuple[mx.array, mx.array]:
    """The exact acceptance rule, batched: -> (accepted count (B,), next token (B,)).

    logits: (B, n + 1, V or V_local), the target's scores of [y, d_1..d_n];
    drafts: (B, n) int; q: the drafts' log-probabilities (B, n, V or V_local) in
    the same columns, or None for point masses; `keys` is required when temp > 0.
    The next token is the target's correction at the first rejection, or its
    bonus token after n acceptances. Every rank gets the same result.
    """
    B, n1, width = logits.shape
    n = n1 - 1
    z = logits.reshape(B * n1, width).astype(mx.float32)
    d = drafts.astype(mx.int32)
    if temp == 0:
        best = _argmax(z, shard).reshape(B, n1)
        ok = best[:, :n] == d
    else:
        z = z / temp
        logp = (z - _lse(z, shard)).reshape(B, n1, width)
        flat_d = d.reshape(-1)
        p_d, mine = _owned(logp[:, :n].reshape(B * n, width), flat_d, shard)
        if q is None:
            q_d = mx.zeros_like(p_d)
        else:
            q_d, _ = _owned(q.reshape(B * n, width).astype(mx.float32), flat_d, shard)
        pair = mx.stack([p_d, q_d])
        if shard is not None:
            pair = mx.distributed.all_sum(pair, group=shard.group)
        ratio = (pair[0] - pair[1]).reshape(B, n)  # log(p(d) / q(d))
        u = mx.random.uniform(shape=(B, n), key=keys.next())
        ok = mx.log(u) < ratio
        # Residual rows: max(0, p - q); the bonus row: p. Log-space, -inf where empty.
        resid = logp[:, :n]
        if q is None:
            cols = mx.arange(width)[None, None] + (0 if shard is None else shard.start)
            resid = mx.where(cols == d[..., None], -math.inf, resid)
        else:
            diff = mx.maximum(mx.exp(resid) - mx.exp(q.astype(mx.float32)), 0.0)
            resid = mx.log(diff)
        scores = mx.concatenate([resid, logp[:, n:]], axis=1).reshape(B * n1, width)
        size = width if shard is None else shard.size
        g = mx.random.gumbel(shape=(B * n1, size), key=keys.next())
        if shard is not None:
            g = g[:, shard.start : shard.stop]
        best = _argmax(scores + g, shard).reshape(B, n1)
    # accepted = length of the leading run of True
    n_ok = mx.cumprod(ok.astype(mx.int32), axis=1).sum(axis=1) if n else mx.zeros((B,), mx.int32)
    nxt = mx.take_along_axis(best, n_ok[:, None], axis=1)[:, 0]
    return n_ok, nxt


def speculative_generate_step(
    model: nn.Module,
    prompt: list[int],
    drafter: Drafter,
    num_draft_tokens: int,
    max_tokens: int,
    temp: float,
    shard: VocabShard | None,
    seed: int,
    cache: list[Any] | None = None,
    stats: SpecStats | None = None,
    prefill_step_size: int = 512,
) -> Iterator[tuple[int, mx.array, bool]]:
    """Yield up to `max_tokens` (token, its logits (1, V[_local]), last of its step).

    `drafter.history` must end with what `cache` holds (a chat's earlier turns);
    `prompt` is added to it. When the generator is closed, the target's cache
    holds the prompt and every yielded token but the last (as after plain
    decoding), and the drafter's history the same.
    """
    cache = cache if cache is not None else make_prompt_cache(model)
    stats = stats if stats is not None else SpecStats()
    keys = KeyStream(seed) if temp > 0 else None
    start = cache[0].offset if cache else 0
    if len(drafter.history) != start:
        drafter.reset()  # unknown context: the drafter starts from the prompt alone
    drafter.extend(prompt)
    tokens = mx.array(prompt, dtype=mx.int32)
    while tokens.size > 1:  # all but the last prompt token only fill the caches
        n = min(prefill_step_size, tokens.size - 1)
        model(tokens[None, :n], cache=cache)
        mx.eval([c.state for c in cache])
        tokens = tokens[n:]
    drafter.prefill(prefill_step_size)
    y, emitted = prompt[-1], 0
    try:
        while emitted < max_tokens:
            k = min(num_draft_tokens, max_tokens - emitted - 1)
            with collectives() as calls:
                drafts, q = drafter.propose(k, temp, keys.next() if keys else None)
                x = mx.array([y] + drafts, dtype=mx.int32)[None]
                logits = verify_logits(model, x, cache)  # (1, n + 1, V[_local])
                q_b = None if q is None else q[None]
                n_ok, nxt = accept(logits, mx.array([drafts], mx.int32), q_b, temp, shard, keys)
                mx.eval(n_ok, nxt)
            n_acc, token = n_ok.item(), nxt.item()
            stats.collectives += len(calls)
            stats.target_forwards += 1
            stats.drafted += len(drafts)
            stats.accepted += n_acc
            trim_prompt_cache(cache, len(drafts) - n_acc)
            base = len(drafter.history)
            new = drafts[:n_acc] + [token]
            drafter.extend(new)
            drafter.accepted(base, n_acc)
            stats.generated += len(new)
            for i, t in enumerate(new):
                emitted += 1
                yield t, logits[:, i, :], i == len(new) - 1
            y = token
    finally:
        # Hold the prompt and every token yielded but the last, as plain decoding does.
        extra = (cache[0].offset if cache else 0) - (start + len(prompt) + max(emitted - 1, 0))
        if extra > 0:
            trim_prompt_cache(cache, extra)
        drafter.trim(start + len(prompt) + max(emitted - 1, 0))
