"""Perplexity with vocabulary-sharded logits.

With a vocabulary-parallel head no rank holds the full logits: the cross-entropy
of each position is a distributed log-sum-exp (all-max, all-sum) minus the
target's logit (all-sum from the rank that owns it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..cluster.progress import progress
from .sampling import token_logprobs, vocab_shard


@dataclass
class PerplexityResult:
    perplexity: float
    tokens: int  # tokens scored
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def windows(n: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """Sliding windows (begin, end, first scored index) over n tokens.

    Windows of `context_length` tokens start every `stride` tokens; each scores
    the tokens not scored yet, so every token from index 1 on is scored exactly
    once. stride < context_length keeps a token of overlap: the first token of a
    window has no context inside it and cannot be scored there.
    """
    out, scored = [], 1
    for begin in range(0, n - 1, stride):
        end = min(begin + context_length, n)
        if end > scored:
            out.append((begin, end, scored))
            scored = end
        if end == n:
            break
    return out


def perplexity(
    model: nn.Module, tokens: list[int], context_length: int = 512, stride: int = 256
) -> PerplexityResult:
    """exp(mean negative log-likelihood) of `tokens` (every rank gets the same result)."""
    if len(tokens) < 2:
        raise ValueError(f"need at least 2 tokens to score, got {len(tokens)}")
    if not 0 < stride < context_length:
        raise ValueError(f"stride must be in 1..{context_length - 1}, got {stride}")
    shard = vocab_shard(model)
    ids = mx.array(tokens, dtype=mx.int32)
    nll, count = 0.0, 0
    tic = time.perf_counter()
    spans = windows(len(tokens), context_length, stride)
    for begin, end, first in progress(spans, "perplexity", unit="window"):
        logits = model(ids[None, begin : end - 1])[0]  # (L-1, V or V_local)
        logits = logits[first - 1 - begin :].astype(mx.float32)  # predicting first..end-1
        logprobs, _, _ = token_logprobs(logits, ids[first:end], shard)
        nll -= mx.sum(logprobs).item()  # evaluated per window: collectives stay in order
        count += end - first
    return PerplexityResult(math.exp(nll / count), count, time.perf_counter() - tic)
