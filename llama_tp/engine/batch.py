"""Continuous batching: many sequences decoded together, each with its own settings.

    from llama_tp.engine.batch import batch_generate
    results = batch_generate(model, tokenizer, ["Hi", "Tell me a joke"], max_tokens=64)

`BatchEngine` is the `Decoder` (engine/decoder.py) the server drives, over
mlx-lm's `BatchKVCache` (left padding; merge, extend, filter): `apply(decision)`
admits new sequences (each prefilled alone, so a row's prompt is processed
exactly as it would be alone) and drops cancelled ones. While other rows are
decoding, a long prompt is prefilled one chunk (`prefill_step_size` tokens) per
call of `apply`, at the chunk boundaries it would have alone: the rows already
decoding get a token between its chunks instead of waiting for all of it (a
request with a long prompt cannot starve the others); `step()` decodes one
token for every row at once, or, for a batch of one sequence that asked for
drafts, a speculative step with prompt lookup. Embedding requests (`Embed` in a
decision) take the same turns: one chunk of theirs per step, before the rows' token
(`engine/embeddings.py`), over caches of their own. Finished rows can leave their
cache in mlx-lm's `LRUPromptCache`, so that a later prompt sharing their prefix
(a chat's next turn) prefills only the rest. Under mlx.launch every rank runs
the same engine on the same decisions, so the ranks' batches, caches and
samples stay identical without any exchange beyond the model's own collectives
and the vocabulary-parallel sampler's.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import wired_limit
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..checkpoints.chat_template import renderer_for
from ..cluster.distributed import first_line, world
from . import caches
from .batch_messages import Decision, Embed, Embedded, Event, Join, SamplingParams
from .decoder import Decoder
from .drafters import NgramDrafter
from .embeddings import Embedder
from .logits_processors import processors_for
from .prefill import prefill
from .sequence import Sequence
from .settings import driver_keywords, keyword_params

__all__ = ["BatchEngine", "BatchResult", "Decision", "Embed", "Embedded", "Event", "Join"]
__all__ += ["SamplingParams"]
__all__ += ["batch_generate"]

_MODEL_KEY = "model"  # LRUPromptCache keys its trie by model; the engine serves one


class BatchEngine(Decoder):
    """The rows being decoded together, their batched KV cache and a prompt cache.

    Every rank must call `apply` and `step` in the same order with the same
    decisions; the returned events are the same on every rank. `eos_token_ids`
    replaces the tokenizer's end-of-sequence set (default: its end-of-sequence and
    end-of-turn tokens, `chat_template.PromptRenderer.eos`).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        *,
        eos_token_ids: set[int] | None = None,
        prompt_cache_size: int = 0,
        prefill_step_size: int = 512,
        overlap: bool = True,
    ):
        super().__init__(
            model, drafter=NgramDrafter(), prefill_step_size=prefill_step_size, overlap=overlap
        )
        self.tokenizer = tokenizer
        eos = renderer_for(tokenizer).eos if eos_token_ids is None else eos_token_ids
        self.eos = frozenset(eos)
        self.prompt_cache = (
            LRUPromptCache(max_size=prompt_cache_size) if prompt_cache_size else None
        )
        self.prefilled_tokens = 0  # prompt tokens run through the model (tests, logs)
        self._empty: list | None = None  # a cache of the model's kinds (`_kinds`)
        self._tail: list[int] | None = None  # the chat template's generation prompt
        self.batched = True  # the rows' caches are mlx-lm's batched ones (merged)
        # Admitted sequences whose prompts are still being prefilled, with their caches
        # (first in, first filled); they join the rows when their last token is fed.
        self.filling: deque[tuple[Sequence, list[Any]]] = deque()
        self._filled = False  # this step's chunk was prefilled (by `apply`)
        self.embedder = Embedder(model, prefill_step_size)  # embedding requests

    def __len__(self) -> int:
        return len(self.rows) + len(self.filling)

    @property
    def busy(self) -> bool:
        """Whether a step has work: rows, prompts being prefilled or embedding requests."""
        return bool(len(self) or len(self.embedder))

    def apply(self, decision: Decision) -> list[Event | Embedded]:
        """Drop the cancelled rows, admit the new ones and prefill: every admitted prompt
        when no row is decoding, else one chunk (the rest at the next calls); queue the
        embedding requests."""
        events: list[Event | Embedded] = []
        cancelled = set(decision.cancels)
        events += self.embedder.cancel(cancelled)
        for embed in decision.embeds:
            self.embedder.add(embed)
        for seq, cache in [f for f in self.filling if f[0].uid in cancelled]:
            self.filling.remove((seq, cache))
            seq.end("cancelled")
            events.append(seq.event("", None, None, None, "cancelled"))
        if cancelled & {r.uid for r in self.rows}:
            keep = []
            for i, r in enumerate(self.rows):
                if r.uid in cancelled:
                    r.end("cancelled")
                    events.append(r.event("", None, None, None, "cancelled"))
                else:
                    keep.append(i)
            self.ahead = self.ahead.select(keep) if keep else None
            self._release(keep, remember=False)
        for join in decision.joins:
            refused = self._admit(join)
            if refused is not None:
                events.append(refused)
        self._fill()
        return events

    def _fill(self) -> None:
        """Prefill the admitted prompts: all of them while no row is decoding; else one
        chunk of `prefill_step_size` tokens (a chunk alone would have had: the same
        boundaries, the same numbers). A prompt fed up to its last token joins the rows."""
        chunks, self._filled = 0, True
        while self.filling:
            seq, cache = self.filling[0]
            rest = len(seq.tokens) - 1 - seq.fed  # all but the last: no logits needed
            if rest > 0:
                if self.rows and chunks:
                    return  # the rows decode a token before the next chunk
                n = min(rest, self.prefill_step_size)
                # a chunk ends at a mark (a checkpoint of the recurrent state there)
                n = min([n, *(m - seq.fed for m in seq.marks if seq.fed < m < seq.fed + n)])
                prefill(self.model, seq.tokens[seq.fed : seq.fed + n], cache, n)
                seq.fed += n
                if seq.fed in seq.marks:
                    self._mark(seq, seq.fed, cache)
                chunks += 1
                continue
            self.filling.popleft()
            self._join(seq, cache)

    def step(self) -> list[Event | Embedded]:
        """One token for every row (Decoder.step), after the next chunk of a prompt being
        prefilled when `apply` did not run one since the last step, and the next chunk of
        an embedding request (the finished ones' vectors)."""
        if self.filling and not self._filled:
            self._fill()
        self._filled = False
        done = self.embedder.step()
        return [*done, *super().step()]

    def _admit(self, join: Join) -> Event | None:
        """Queue `join` for prefilling (`_fill`), from the prompt cache's nearest entry; or,
        when its own processing cannot start (its logits processors), the event that ends
        it with an error, the batch unchanged."""
        seq = Sequence(join.uid, join.prompt, join.params, self.tokenizer.detokenizer, self.eos)
        seq.guarded = True  # its own failures end it alone (sequence.py)
        if join.params.processed:  # logit bias, penalties, a grammar
            try:
                seq.processors = processors_for(
                    join.params, self.tokenizer, self.shard.size, self.eos
                )
            except Exception as e:
                seq.fault = ("grammar" if join.params.grammar else None, first_line(e))
                return seq.fail()
        cache, cached = None, 0
        if self.prompt_cache is not None:
            cache, rest = self._nearest(join.prompt)
            cached = len(join.prompt) - len(rest) if cache is not None else 0
            if caches.recurrent(cache or self._kinds()):
                # a recurrent state never steps back: keep the cache at the prompt's end
                # (and at its segments' ends) for a later prompt that shares them
                seq.marks = (*join.marks, *self._user_end(join.prompt), len(join.prompt))
                seq.on_mark = lambda held, c, seq=seq: self._remember(seq, held, c)
        cache = cache if cache is not None else caches.new(self.model)
        seq.cached = seq.fed = cached
        self.prefilled_tokens += len(join.prompt) - cached
        self.filling.append((seq, cache))
        return None

    def _join(self, seq: Sequence, cache: list[Any]) -> None:
        """`seq`'s last prompt token fed, alone (B = 1, as a single-sequence run does), and
        its cache merged into the batch."""
        ahead = self.prefill(seq, cache)
        # each cache's own batched kind (a sliding-window layer's RotatingKVCache merges into
        # a BatchRotatingKVCache); caches that cannot merge run alone, as they are (the
        # server then admits one sequence at a time: `caches.why_not_merge`)
        self.batched = caches.why_not_merge(cache) is None
        merged = caches.merge(cache) if self.batched else cache
        if self.cache is None:
            self.cache, self.ahead = merged, ahead
        else:
            caches.extend(self.cache, merged)
            self.ahead = self.ahead.extend(ahead)
        self.rows.append(seq)

    def _nearest(self, prompt: list[int]) -> tuple[list | None, list[int]]:
        """The prompt cache's nearest entry for `prompt` and the tokens it lacks (at least
        the last: it yields the first logits)."""
        cache, rest = self.prompt_cache.fetch_nearest_cache(_MODEL_KEY, prompt)
        if cache is not None and not rest:  # an exact hit: the last token is fed again
            if caches.can_rewind(cache, 1):
                caches.rewind(cache, 1)
                return cache, prompt[-1:]
            # a recurrent state (or a wrapped window) cannot step back: a shorter entry
            cache, rest = self.prompt_cache.fetch_nearest_cache(_MODEL_KEY, prompt[:-1])
            return (cache, [*rest, prompt[-1]]) if cache is not None else (None, prompt)
        return cache, rest

    def _user_end(self, prompt: list[int]) -> tuple[int, ...]:
        """Where a chat prompt ends before its generation prompt (the next turn renders the
        reply after it; a thinking template renders it differently from the generation
        prompt), when `prompt` ends with the template's generation prompt; else ()."""
        if self._tail is None:
            self._tail = []
            renderer = renderer_for(self.tokenizer)
            try:
                probe = [{"role": "user", "content": "Hi"}]
                whole = renderer.apply(probe, add_generation_prompt=True)
                bare = renderer.apply(probe, add_generation_prompt=False)
                if whole[: len(bare)] == bare:
                    self._tail = whole[len(bare) :]
            except Exception:
                pass
        n = len(self._tail)
        return (len(prompt) - n,) if 0 < n < len(prompt) and prompt[-n:] == self._tail else ()

    def _kinds(self) -> list:
        """A cache of the model's kinds (what its layers hold), made once."""
        if self._empty is None:
            self._empty = caches.new(self.model)
        return self._empty

    def _remember(self, seq: Sequence, held: int, cache: list) -> None:
        """Keep a copy of `cache`, holding the first `held` tokens of `seq` (being
        prefilled), in the prompt cache."""
        # At the prompt's end the cache is the batch's no more (`_join` merges a copy)
        kept = cache if held == len(seq.tokens) else copy.deepcopy(cache)
        self.prompt_cache.insert_cache(_MODEL_KEY, seq.tokens[:held], kept, cache_type="user")

    def _release(self, keep: list[int], remember: bool = True) -> None:
        """Free the cache rows of the rows not in `keep` (after putting the finished ones'
        in the prompt cache)."""
        if remember and self.prompt_cache is not None:
            for i in sorted(set(range(len(self.rows))) - set(keep)):
                r = self.rows[i]
                cache = caches.extract(self.cache, i) if self.batched else self.cache
                held = len(r.tokens) - 1  # all but the last token (see Decoder._release)
                if caches.can_rewind(cache, r.fed - held):
                    caches.rewind(cache, r.fed - held)
                elif caches.recurrent(cache):  # a recurrent state holds what it was fed
                    held = r.fed
                else:
                    continue  # a sliding window past its size cannot step back: not kept
                self.prompt_cache.insert_cache(_MODEL_KEY, r.tokens[:held], cache)
        if not keep:
            self.cache = None
        elif len(keep) < len(self.rows):
            caches.filter_rows(self.cache, keep)
        super()._release(keep)


@dataclass
class BatchResult:
    """One prompt's completion from `batch_generate`."""

    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    logprobs: list[float] | None = None


def batch_generate(
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    prompts: list[list[int]] | list[str],
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    top_k: int = 0,
    seeds: list[int] | None = None,
    stop: tuple[str, ...] = (),
    logprobs: bool | int = False,
    max_batch: int = 16,
    group: mx.distributed.Group | None = None,
) -> list[BatchResult]:
    """Complete every prompt (token ids, or strings wrapped in the chat template), at most
    `max_batch` at a time; a row that finishes makes room for the next prompt.
    `logprobs`: True for each token's log-probability (an int k: also the k best).

    Under mlx.launch every rank calls this with the same arguments (rank 0's seeds are
    shared when `seeds` is None) and gets the same results.
    """
    given = driver_keywords(locals())  # before any other local: the keywords it was given
    from ..cluster.distributed import broadcast_object

    group = group or world()
    renderer = renderer_for(tokenizer)
    ids = [renderer.prompt(p) if isinstance(p, str) else list(p) for p in prompts]
    if any(not p for p in ids):
        raise ValueError("a prompt is empty")
    if seeds is None:
        rng = random.SystemRandom()
        seeds = broadcast_object([rng.randrange(2**31) for _ in ids], group)
    k = None if logprobs is False else 0 if logprobs is True else logprobs
    base = keyword_params({**given, "logprobs": k})
    todo = []
    for i, (p, s) in enumerate(zip(ids, seeds, strict=True)):
        extra = renderer.stops if isinstance(prompts[i], str) else ()
        todo.append(Join(i, p, base.but(seed=s, stop=(*stop, *extra))))
    todo.reverse()
    engine = BatchEngine(model, tokenizer)
    out: dict[int, BatchResult] = {}
    with wired_limit(model):
        while todo or len(engine):
            joins = [todo.pop() for _ in range(min(len(todo), max_batch - len(engine)))]
            engine.apply(Decision(joins=joins))
            for e in engine.step():
                res = out.setdefault(e.uid, BatchResult("", [], "", e.prompt_tokens, None))
                res.text += e.text
                if not e.eos:
                    res.tokens.append(e.token)
                if e.logprob is not None:
                    res.logprobs = (res.logprobs or []) + [e.logprob]
                if e.finish_reason:
                    res.finish_reason = e.finish_reason
    return [out[i] for i in range(len(ids))]
