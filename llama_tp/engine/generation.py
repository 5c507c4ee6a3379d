"""The generation step and loop: `generate_step` and `stream_generate`.

Every rank runs the same loop on the same tokens; the sharded layers' all-reduces
keep their logits identical, and a shared seed keeps their samples identical.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..cluster import watchdog
from ..cluster.distributed import broadcast_object, world
from .agreement import TokenCheck
from .drafters import check_num_draft_tokens, make_drafter
from .sampling import make_sampler, token_logprobs, vocab_shard
from .speculative import SpecStats, speculative_generate_step


def agree_seed(seed: int | None, group: mx.distributed.Group | None = None) -> int:
    """Seed every rank's RNG with the same value (rank 0's choice when `seed` is None).

    Ranks that sampled differently would feed different tokens into their
    caches and silently compute garbage from then on.
    """
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    seed = broadcast_object(seed, group)
    mx.random.seed(seed)
    return seed


def generate_step(
    model: nn.Module,
    prompt: list[int],
    sampler: Callable[[mx.array], mx.array],
    max_tokens: int,
    cache: list[Any] | None = None,
    prefill_step_size: int = 512,
) -> Iterator[tuple[int, mx.array]]:
    """Yield up to `max_tokens` (token id, logits) after `prompt` (a generator, as in mlx-lm).

    `sampler` maps logits (1, V) to a token (1,); with a vocabulary-parallel head
    the logits are this rank's (1, V_local). The prompt is prefilled in chunks;
    then each step builds the next token's graph before waiting for the current
    one (`mx.async_eval`), so Python work overlaps computation.
    """
    cache = cache if cache is not None else make_prompt_cache(model)
    tokens = mx.array(prompt, dtype=mx.int32)
    rows = None  # the next token's embedding row, when the sampler's exchange brought it

    def step(x: mx.array) -> tuple[mx.array, mx.array]:
        nonlocal rows
        y, logits, rows = decode_step(model, sampler, cache, x, rows)
        return y, logits

    # All but the last prompt token only fill the cache: their logits are never
    # evaluated, so the output head runs for the last position alone (as in mlx-lm).
    while tokens.size > 1:
        n = min(prefill_step_size, tokens.size - 1)
        model(tokens[None, :n], cache=cache)
        mx.eval([c.state for c in cache])
        tokens = tokens[n:]
    y, logits = step(tokens)
    mx.async_eval(y)
    for n in range(max_tokens):
        nxt = step(y) if n + 1 < max_tokens else None
        if nxt is not None:
            mx.async_eval(nxt[0])
        yield y.item(), logits
        if nxt is not None:
            y, logits = nxt


def decode_step(
    model: nn.Module,
    sampler: Callable[[mx.array], mx.array],
    cache: list[Any],
    tokens: mx.array,
    rows: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """One step's graph: tokens (L,) -> (next token (1,), logits (1, V[_local]), its row).

    `rows` (1, dim), the embedding of a one-token `tokens` that the previous step's
    sampling exchange brought along, replaces the embedding lookup and its
    all-reduce: with a vocabulary-parallel head a decode step then makes 2
    all-reduces per layer and one sampling exchange, nothing else. The returned
    row is None when the sampler cannot fold it (filtered samplers, whole vocabulary).
    """
    h = None if rows is None else rows[None]  # (1, 1, dim)
    logits = model(tokens[None], cache=cache, input_embeddings=h)[:, -1, :]
    fold = getattr(sampler, "sample_with_rows", None)
    if fold is None:
        return sampler(logits).reshape(-1), logits, None
    y, new_rows = fold(logits)
    return y.reshape(-1), logits, new_rows


@dataclass
class Response:
    text: str  # the new piece of text (may be empty while a character is incomplete)
    token: int
    logprob: float | None  # with stream_generate(logprobs=...): of `token`
    top_logprobs: list[tuple[int, float]] | None  # the `logprobs` most likely (id, logprob)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    finish_reason: str | None  # "stop", "length" or None
    speculative: SpecStats | None = None  # with a drafter: the counts so far


def stream_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: list[int],
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    cache: list[Any] | None = None,
    should_stop: Callable[[], bool] | None = None,
    logprobs: int | None = None,
    eos_token_ids: set[int] | None = None,
    group: mx.distributed.Group | None = None,
    draft: Any = None,
    num_draft_tokens: int = 4,
) -> Iterator[Response]:
    """Generate from token ids `prompt`, yielding text pieces as they are decoded.

    `cache` (from `make_prompt_cache`) already holding earlier tokens continues
    from them: `prompt` is then only the new tokens. `should_stop` is asked on
    every rank after every token; when any rank answers True, all ranks stop at
    the same token (finish_reason "interrupted"), so their caches stay alike.
    `logprobs=k` adds each token's log-probability and the k most likely
    alternatives (0: the token's only), exact also with a sharded vocabulary.
    `eos_token_ids` replaces the tokenizer's end-of-sequence ids (e.g. a chat
    template's end-of-turn token as well).

    `draft` turns on speculative decoding (`engine/speculative.py`): "ngram"
    (prompt lookup), a draft model sharing the tokenizer, or a `Drafter`; each
    step drafts up to `num_draft_tokens` tokens and verifies them in one target
    forward. Greedy output is the plain output; sampled output has the same
    distribution (temperature only: no top-p, min-p or top-k). `should_stop` is
    then asked once per step, at its last token.
    """
    if not prompt:
        raise ValueError("the prompt is empty")
    if draft is not None:
        check_num_draft_tokens(num_draft_tokens)
        if top_p < 1.0 or min_p > 0.0 or top_k > 0:
            raise ValueError(
                "speculative decoding samples with a temperature only: "
                "top_p, min_p and top_k must stay off with a drafter"
            )
    group = group or world()
    # Armed only under the commands (llama_tp.watchdog.install): a peer that stops
    # would otherwise leave this rank waiting in a collective forever.
    with watchdog.stage(f"prompt processing ({len(prompt)} tokens)", "load"):
        seed = agree_seed(seed, group)
        shard = vocab_shard(model)
        drafter = make_drafter(draft, model)
        tokenizer.detokenizer.reset()
        eos = set(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
        check = TokenCheck(prompt, group, eos)
        tic = time.perf_counter()
        stats = SpecStats() if drafter is not None else None
        if drafter is not None:
            steps = speculative_generate_step(
                model,
                prompt,
                drafter,
                num_draft_tokens,
                max_tokens,
                temp,
                shard,
                seed,
                cache,
                stats,
            )
        else:
            sampler = make_sampler(temp, top_p, min_p, top_k, shard=shard, seed=seed)
            steps = (
                (t, lg, True) for t, lg in generate_step(model, prompt, sampler, max_tokens, cache)
            )
        try:
            yield from _responses(
                steps,
                tokenizer,
                prompt,
                check,
                eos,
                max_tokens,
                should_stop,
                group,
                logprobs,
                shard,
                stats,
                tic,
            )
        finally:
            steps.close()


def _responses(
    steps: Iterator[tuple[int, mx.array, bool]],
    tokenizer: TokenizerWrapper,
    prompt: list[int],
    check: TokenCheck,
    eos: set[int],
    max_tokens: int,
    should_stop: Callable[[], bool] | None,
    group: mx.distributed.Group,
    logprobs: int | None,
    shard: Any,
    stats: SpecStats | None,
    tic: float,
) -> Iterator[Response]:
    """stream_generate's loop over (token, logits, last of its step) from either generator."""
    detok = tokenizer.detokenizer
    prompt_tps = 0.0
    for n, (token, logits, last) in enumerate(steps, start=1):
        if n == 1:
            prompt_tps = len(prompt) / (time.perf_counter() - tic)
            tic = time.perf_counter()
        gen_tps = (n - 1) / (time.perf_counter() - tic) if n > 1 else 0.0
        token = check.fault(n, token)
        finish = None
        if token in eos:
            finish = "stop"
        else:
            detok.add_token(token)
            if n == max_tokens:
                finish = "length"
            elif last and should_stop is not None and _any_rank(should_stop(), group):
                finish = "interrupted"
        check.add(n, token, final=finish is not None)
        if finish:
            detok.finalize()
        lp = top = None
        if logprobs is not None:
            chosen, ids, vals = token_logprobs(logits, mx.array([token]), shard, logprobs)
            lp = chosen.item()
            if ids is not None:
                top = list(zip(ids[0].tolist(), vals[0].tolist(), strict=True))
        yield Response(
            detok.last_segment,
            token,
            lp,
            top,
            len(prompt),
            prompt_tps,
            n,
            gen_tps,
            finish,
            stats,
        )
        if finish:
            return
        watchdog.progress(f"generation step {n + 1}")


def _any_rank(flag: bool, group: mx.distributed.Group) -> bool:
    """True on every rank when `flag` is True on any rank (one tiny all-reduce)."""
    if group.size() == 1:
        return flag
    return mx.distributed.all_sum(mx.array(int(flag)), group=group, stream=mx.cpu).item() > 0


def vocab_bytes(model: nn.Module) -> int:
    """Bytes of the embedding and output head this rank holds (shared once when tied)."""
    from mlx.utils import tree_flatten

    # (a pipeline stage may hold neither: engine/pipeline.py)
    parts = [model[k] for k in ("tok_embeddings", "output") if k in model]
    return sum(v.nbytes for m in parts for _, v in tree_flatten(m.parameters()))
