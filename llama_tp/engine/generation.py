"""Generating one sequence: `stream_generate` (the driver of `generate` and `Chat`), and
the lower-level `generate_step` for a sampler of one's own.

Every rank runs the same loop on the same tokens; the sharded layers' all-reduces
keep their logits identical, and the shared seed keeps their samples identical.
`stream_generate` runs the core (`decoder.Decoder`) on one row: the same prefill,
step, sampler and per-token rule as the batch engine behind the server, so the
same request gives the same tokens there (docs/determinism.md).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..checkpoints.chat_template import renderer_for
from ..cluster import watchdog
from ..cluster.distributed import broadcast_object, world
from ..loading.agreement import TokenCheck
from . import caches
from .decoder import Decoder, decode_step
from .drafters import make_drafter
from .prefill import prefill
from .sequence import LogitsProcessor, Sequence
from .settings import SamplingParams, driver_keywords, request_params
from .speculative import SpecStats


def agree_seed(seed: int | None, group: mx.distributed.Group | None = None) -> int:
    """The seed every rank samples with: `seed`, or rank 0's random choice when None.

    Ranks that sampled differently would feed different tokens into their
    caches and silently compute garbage from then on.
    """
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    return broadcast_object(seed, group)


def generate_step(
    model: nn.Module,
    prompt: list[int],
    sampler: Callable[[mx.array], mx.array],
    max_tokens: int,
    cache: list[Any] | None = None,
    prefill_step_size: int = 512,
) -> Iterator[tuple[int, mx.array]]:
    """Yield up to `max_tokens` (token id, logits) after `prompt` (a generator, as in mlx-lm).

    `sampler` maps logits (1, V) to a token (1,) (e.g. `sampling.make_sampler`);
    with a vocabulary-parallel head the logits are this rank's (1, V_local). Each
    step builds the next token's graph before waiting for the current one.
    """
    cache = cache if cache is not None else caches.new(model)
    prefill(model, prompt[:-1], cache, prefill_step_size)
    y, logits, rows = decode_step(model, sampler, cache, mx.array(prompt[-1:], dtype=mx.int32))
    mx.async_eval(y)
    for n in range(max_tokens):
        nxt = decode_step(model, sampler, cache, y, rows) if n + 1 < max_tokens else None
        if nxt is not None:
            mx.async_eval(nxt[0])
        yield y.item(), logits
        if nxt is not None:
            y, logits, rows = nxt


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
    finish_reason: str | None  # "stop", "length", "interrupted" or None
    speculative: SpecStats | None = None  # with a drafter: the counts so far
    eos: bool = False  # `token` ends the sequence (its text is not part of the reply)
    stop_string: str | None = None  # the stop string that ended the reply, if one did


def stream_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompt: list[int],
    params: SamplingParams | None = None,
    *,
    max_tokens: int | None = None,
    temp: float | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: tuple[str, ...] | list[str] | None = None,
    cache: list[Any] | None = None,
    history: list[int] | None = None,
    should_stop: Callable[[], bool] | None = None,
    logprobs: int | None = None,
    eos_token_ids: set[int] | None = None,
    group: mx.distributed.Group | None = None,
    draft: Any = None,
    num_draft_tokens: int | None = None,
    logits_processors: list[LogitsProcessor] | None = None,
    prefill_step_size: int = 512,
    marks: tuple[int, ...] = (),
    on_mark: Callable[[int, Any], None] | None = None,
) -> Iterator[Response]:
    """Generate from token ids `prompt`, yielding text pieces as they are decoded.

    `params`: the sampling settings (`SamplingParams`: max_tokens, temperature, top-p,
    min-p, top-k, seed, stop strings, log-probabilities, draft tokens), used as given,
    its seed included. Without it, the keywords of the same names say them (mlx-lm's:
    `temp` is the temperature; defaults: 256 tokens, greedy, and `seed` None: rank 0's
    random choice, agreed by every rank); giving both is a TypeError.

    `cache` (from `caches.new`, or mlx-lm's `make_prompt_cache`) already holding earlier
    tokens continues from them: `prompt` is then only the new tokens, and `history` the
    tokens the cache holds (for drafters and logits processors). `stop` strings end the reply
    (not shown; text that may start one is held back). `should_stop` is asked on
    every rank after every step; when any rank answers True, all ranks stop at the
    same token (finish_reason "interrupted"), so their caches stay alike.
    `logprobs=k` adds each token's log-probability and the k most likely
    alternatives (0: the token's only), exact also with a sharded vocabulary.
    `eos_token_ids` replaces the end-of-sequence set (default: the tokenizer's
    end-of-sequence ids and its chat template's end-of-turn token).

    `draft` turns on speculative decoding (`engine/speculative.py`): "ngram"
    (prompt lookup), a draft model sharing the tokenizer, or a `Drafter`; each
    step drafts up to `num_draft_tokens` tokens and checks them in one target
    forward. The output is the plain output, token for token, with any settings.
    `logits_processors`: callables (tokens, logits (1, V_local), shard) -> logits
    applied before sampling, on every rank to its own columns. `marks`: counts of
    `prompt`'s tokens after which the prefill hands the cache to `on_mark(count, cache)`
    to checkpoint (a recurrent state's segment ends, `Chat`).
    """
    given = driver_keywords(locals())  # before any other local: the keywords it was given
    if not prompt:
        raise ValueError("the prompt is empty")
    params = request_params("stream_generate", params, draft is not None, given)
    group = group or world()
    # Armed only under the commands (llama_tp.watchdog.install): a peer that stops
    # would otherwise leave this rank waiting in a collective forever.
    with watchdog.stage(f"prompt processing ({len(prompt)} tokens)", "load"), wired_limit(model):
        if params.seed is None:
            params = params.but(seed=agree_seed(None, group))
        eos = renderer_for(tokenizer).eos if eos_token_ids is None else frozenset(eos_token_ids)
        seq = Sequence(0, prompt, params, tokenizer.detokenizer, eos)
        seq.context = list(history or [])
        seq.processors = list(logits_processors or [])
        seq.marks, seq.on_mark = tuple(marks), on_mark
        decoder = Decoder(
            model, drafter=make_drafter(draft, model), prefill_step_size=prefill_step_size
        )
        tic = time.perf_counter()
        decoder.start(seq, cache if cache is not None else caches.new(model))
        if decoder.drafter is not None:
            decoder.drafter.prefill(seq.history, prefill_step_size)
        yield from _responses(decoder, seq, TokenCheck(prompt, group, eos), should_stop, tic)


def _responses(
    decoder: Decoder,
    seq: Sequence,
    check: TokenCheck,
    should_stop: Callable[[], bool] | None,
    tic: float,
) -> Iterator[Response]:
    """stream_generate's loop: the decoder's steps as Responses, with the ranks' checks."""
    prompt_tps, start = 0.0, None
    group = check.group
    while True:
        events = decoder.step()
        if start is None:
            start = time.perf_counter()
            prompt_tps = len(seq.prompt) / (start - tic)
        for i, e in enumerate(events):
            n = e.completion_tokens
            if (
                e.finish_reason is None
                and i == len(events) - 1
                and should_stop is not None
                and _any_rank(should_stop(), group)
            ):
                e.text += seq.end("interrupted")
                e.finish_reason = "interrupted"
            check.add(n, check.fault(n, e.token), final=e.finish_reason is not None)
            gen_tps = (n - 1) / (time.perf_counter() - start) if n > 1 else 0.0
            spec = seq.spec if decoder.drafter is not None else None
            yield Response(
                e.text, e.token, e.logprob, e.top_logprobs, len(seq.prompt), prompt_tps, n,
                gen_tps, e.finish_reason, spec, e.eos, e.stop_string,
            )  # fmt: skip
            if e.finish_reason:
                return
        watchdog.progress(f"generation step {seq.n + 1}")


def _any_rank(flag: bool, group: mx.distributed.Group) -> bool:
    """True on every rank when `flag` is True on any rank (one tiny all-reduce)."""
    if group.size() == 1:
        return flag
    return mx.distributed.all_sum(mx.array(int(flag)), group=group, stream=mx.cpu).item() > 0


def vocab_bytes(model: nn.Module) -> int:
    """Bytes of the embedding and output head this rank holds (shared once when tied)."""
    from mlx.utils import tree_flatten

    # (a pipeline stage may hold neither: loading/pipeline.py)
    parts = [model[k] for k in ("tok_embeddings", "output") if k in model]
    if hasattr(model, "structure"):  # mlx-lm's classes (generic/model.py)
        from ..parallel.module_swap import module_at

        ends = (model.structure.embedding, model.structure.head)
        parts = [module_at(model.inner, p) for p in ends if p]
    return sum(v.nbytes for m in parts for _, v in tree_flatten(m.parameters()))
