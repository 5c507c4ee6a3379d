"""Continuous batching: many sequences decoded together, each with its own settings.

    from llama_tp.engine.batch import batch_generate
    results = batch_generate(model, tokenizer, ["Hi", "Tell me a joke"], max_tokens=64)

`BatchEngine` is the step machinery the server drives: `apply(decision)` admits
new sequences (prefilled one at a time, so a row's prompt is processed exactly as
it would be alone) and drops cancelled ones; `step()` decodes one token for every
row at once, with mlx-lm's `BatchKVCache` (left padding; merge, extend, filter)
holding the rows' keys and values. Under mlx.launch every rank runs the same
engine on the same decisions, so the ranks' batches, caches and samples stay
identical without any exchange beyond the model's own collectives and the
vocabulary-parallel sampler's.

Sampling works on vocabulary shards (as `llama_tp.sampling`): greedy and plain
temperature rows share one Gumbel-max exchange per step; rows with top-p / min-p
/ top-k run the shard-aware filtered sampler one row at a time. A row's random
key depends only on its seed and its own token index, so a seeded sequence
samples the same tokens alone or in any batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, LRUPromptCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..cluster.distributed import world
from .batch_messages import Decision, Event, Join, SamplingParams
from .drafters import lookup
from .pipeline import verify_logits
from .sampling import VocabShard, _filtered_sample, token_logprobs, vocab_shard

__all__ = ["BatchEngine", "BatchResult", "Decision", "Event", "Join", "SamplingParams"]
__all__ += ["batch_generate", "sample_rows"]

_MODEL_KEY = "model"  # LRUPromptCache keys its trie by model; the engine serves one


class _Row:
    def __init__(self, join: Join, tokenizer: TokenizerWrapper, cached: int):
        self.uid, self.params, self.prompt = join.uid, join.params, join.prompt
        self.cached = cached
        self.fed = list(join.prompt[:-1])  # tokens whose keys and values are in the cache
        self.pending = join.prompt[-1]  # the next input token
        self.n = 0  # tokens generated
        self.detok = tokenizer.detokenizer
        self.text = ""  # decoded, not yet sent (held back while it may start a stop string)
        self.drafted = self.accepted = 0  # speculative steps (Event.drafted, .accepted)

    def key(self) -> mx.array:
        # The row's own seed and token index, never its place in the batch.
        return mx.random.key((self.params.seed * 1_000_003 + self.n) % 2**63)


class _LocalShard(VocabShard):
    """The whole vocabulary on this rank: the shard-aware samplers without collectives."""

    def __init__(self, size: int):
        super().__init__(0, size, size, None, ranges=((0, size),))

    def gather_rows(self, x: mx.array) -> mx.array:
        return x

    def full_logits(self, logits: mx.array) -> mx.array:
        return logits

    def logsumexp(self, logits: mx.array) -> mx.array:
        return mx.logsumexp(logits, axis=-1, keepdims=True)

    def argmax(self, scores: mx.array) -> mx.array:
        return mx.argmax(scores, axis=-1).astype(mx.int32)


def sample_rows(logits: mx.array, rows: list[_Row], shard: VocabShard | None) -> mx.array:
    """Tokens (B,) for logits (B, V) or (B, V_local), each row with its own settings."""
    logits = logits.astype(mx.float32)
    local = shard or _LocalShard(logits.shape[-1])
    temps, noise, filtered = [], [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.temperature > 0 and (p.top_p < 1.0 or p.min_p > 0.0 or p.top_k > 0):
            filtered.append(i)
        if p.temperature > 0:
            temps.append(p.temperature)
            noise.append(local.local_gumbel(r.key(), 1))
        else:
            temps.append(1.0)
            noise.append(mx.zeros((1, logits.shape[-1])))
    scores = logits / mx.array(temps)[:, None] + mx.concatenate(noise, axis=0)
    tokens = local.argmax(scores)  # one exchange for the whole batch
    if filtered:
        picks = tokens.tolist()
        for i in filtered:
            p = rows[i].params
            t = _filtered_sample(
                logits[i : i + 1], local, p.temperature, rows[i].key(), p.top_p, p.min_p, p.top_k
            )
            picks[i] = t.item()
        tokens = mx.array(picks, dtype=mx.int32)
    return tokens


def _stop_hold(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could start a stop string (hold them back)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if s.startswith(text[-k:]):
                hold = k
                break
    return hold


class BatchEngine:
    """The rows being decoded together, their batched KV cache and a prompt cache.

    Every rank must call `apply` and `step` in the same order with the same
    decisions; the returned events are the same on every rank.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: TokenizerWrapper,
        *,
        eos_token_ids: set[int] | None = None,
        prompt_cache_size: int = 0,
        prefill_step_size: int = 512,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.eos = set(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.shard = vocab_shard(model)
        self.rows: list[_Row] = []
        self.cache: list[BatchKVCache] | None = None  # one per layer, B = len(rows)
        self.prompt_cache = (
            LRUPromptCache(max_size=prompt_cache_size) if prompt_cache_size else None
        )
        self.prefill_step_size = prefill_step_size
        self.prefilled_tokens = 0  # prompt tokens run through the model (tests, logs)

    def __len__(self) -> int:
        return len(self.rows)

    def apply(self, decision: Decision) -> list[Event]:
        """Drop the cancelled rows and admit (prefill) the new ones."""
        events = []
        cancelled = set(decision.cancels)
        if cancelled & {r.uid for r in self.rows}:
            for r in self.rows:
                if r.uid in cancelled:
                    events.append(self._event(r, "", None, None, None, "cancelled"))
            self._keep([i for i, r in enumerate(self.rows) if r.uid not in cancelled])
        for join in decision.joins:
            self._admit(join)
        return events

    def _admit(self, join: Join) -> None:
        cache, cached = None, 0
        if self.prompt_cache is not None:
            cache, rest = self.prompt_cache.fetch_nearest_cache(_MODEL_KEY, join.prompt)
            if cache is not None and not rest:  # an exact hit: the last token is fed again
                trim_prompt_cache(cache, 1)
                rest = join.prompt[-1:]
            cached = len(join.prompt) - len(rest) if cache is not None else 0
        cache = cache if cache is not None else make_prompt_cache(self.model)
        row = _Row(join, self.tokenizer, cached)
        # Prefill all but the last token alone (B = 1): the row's cache holds exactly
        # what a single-sequence run would; the last token is the row's first input.
        todo = mx.array(join.prompt[cached:-1], dtype=mx.int32)
        while todo.size:
            n = min(self.prefill_step_size, todo.size)
            self.model(todo[None, :n], cache=cache)
            mx.eval([c.state for c in cache])
            todo = todo[n:]
        self.prefilled_tokens += len(join.prompt) - cached - 1
        merged = [BatchKVCache.merge([c]) for c in cache]
        if self.cache is None:
            self.cache = merged
        else:
            for mine, new in zip(self.cache, merged, strict=True):
                mine.extend(new)
        self.rows.append(row)

    def _keep(self, keep: list[int]) -> None:
        if not keep:
            self.rows, self.cache = [], None
            return
        if len(keep) < len(self.rows):
            for c in self.cache:
                c.filter(mx.array(keep, dtype=mx.int32))
            self.rows = [self.rows[i] for i in keep]

    def step(self, draft: int = 0) -> list[Event]:
        """Decode one token for every row; finished rows leave the batch.

        `draft` (the decision's): when the batch holds one row, draft up to that many
        tokens by prompt lookup and verify them in the same forward (`_draft_step`).
        """
        if not self.rows:
            return []
        if draft > 0 and len(self.rows) == 1:
            return self._draft_step(draft)
        rows = self.rows
        inputs = mx.array([r.pending for r in rows], dtype=mx.int32)
        logits = self.model(inputs[:, None], cache=self.cache)[:, -1, :]  # (B, V or V_local)
        tokens = sample_rows(logits, rows, self.shard)
        lps = self._logprobs(logits, tokens, rows)
        tokens = tokens.tolist()
        events, keep = [], []
        for i, (r, t) in enumerate(zip(rows, tokens, strict=True)):
            r.fed.append(r.pending)
            events.append(self._advance(r, t, *lps[i]))
            if events[-1].finish_reason:
                self._remember(i, r)
            else:
                keep.append(i)
        self._keep(keep)
        return events

    def _logprobs(self, logits: mx.array, tokens: mx.array, rows: list[_Row]) -> list[tuple]:
        """(logprob, top) of each row's token, (None, None) for rows that did not ask."""
        top = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if not top:
            return [(None, None)] * len(rows)
        lp, ids, vals = token_logprobs(logits, tokens, self.shard, max(top))
        mx.eval(tokens, lp, *(x for x in (ids, vals) if x is not None))
        lp = lp.tolist()
        ids = ids.tolist() if ids is not None else None
        vals = vals.tolist() if vals is not None else None
        out = []
        for i, r in enumerate(rows):
            k = r.params.logprobs
            row_top = list(zip(ids[i][:k], vals[i][:k], strict=True)) if k and ids else None
            out.append((lp[i] if k is not None else None, row_top))
        return out

    def _advance(self, r: _Row, t: int, logprob, top) -> Event:
        """Row `r` generated token `t` (its input already in `r.fed`): the event, with
        finish_reason set when `t` ends the sequence (EOS, max_tokens or a stop string)."""
        r.pending, r.n = t, r.n + 1
        finish = None
        if t in self.eos:
            finish = "stop"
        else:
            r.detok.add_token(t)
            if r.n >= r.params.max_tokens:
                finish = "length"
        if finish:
            r.detok.finalize()
        r.text += r.detok.last_segment
        text = ""
        hit = [j for j in (r.text.find(s) for s in r.params.stop) if j >= 0]
        if hit:
            text, finish = r.text[: min(hit)], "stop"
        elif finish:
            text = r.text
        else:
            cut = len(r.text) - _stop_hold(r.text, r.params.stop)
            text, r.text = r.text[:cut], r.text[cut:]
        return self._event(r, text, t, logprob, top, finish)

    def _draft_step(self, k: int) -> list[Event]:
        """The one row's speculative step: up to `k` tokens drafted by prompt lookup over
        its prompt and reply, checked in one forward with the greedy rule of
        `speculative.accept`; the cache is trimmed back to the tokens kept.

        Every rank drafts the same tokens (same history) and accepts the same prefix.
        Tokens after the one that ends the sequence are dropped, cache included, so the
        row ends exactly as plain decoding would have left it.
        """
        from .speculative import accept

        (r,) = self.rows
        k = min(k, r.params.max_tokens - r.n - 1)  # never draft past max_tokens
        drafts = lookup([*r.fed, r.pending], k) if k > 0 else []
        x = mx.array([[r.pending, *drafts]], dtype=mx.int32)
        logits = verify_logits(self.model, x, self.cache)  # (1, n + 1, V or V_local)
        n_ok, nxt = accept(logits, mx.array([drafts], mx.int32), None, 0.0, self.shard, None)
        mx.eval(n_ok, nxt)
        n_acc = n_ok.item()
        new = [*drafts[:n_acc], nxt.item()]
        lps = self._logprobs(logits[0, : len(new)], mx.array(new, mx.int32), [r] * len(new))
        trim_prompt_cache(self.cache, len(drafts) - n_acc)  # holds fed, pending, kept drafts
        r.drafted += len(drafts)
        events = []
        for i, t in enumerate(new):
            r.fed.append(r.pending)
            r.accepted += 1 if i else 0  # a token without a forward of its own
            events.append(self._advance(r, t, *lps[i]))
            if events[-1].finish_reason:
                # the cache holds every fed token and the drafts after t: drop those
                trim_prompt_cache(self.cache, len(new) - 1 - i)
                self._remember(0, r)
                self._keep([])
                break
        return events

    def _remember(self, i: int, r: _Row) -> None:
        """Put a finished row's cache (prompt and reply so far) in the prompt cache."""
        if self.prompt_cache is None or not r.fed:
            return
        cache = [c.extract(i) for c in self.cache]
        self.prompt_cache.insert_cache(_MODEL_KEY, list(r.fed), cache)

    def _event(self, r: _Row, text, token, logprob, top, finish) -> Event:
        return Event(
            r.uid, text, token, logprob, top, finish, len(r.prompt), r.cached, r.n,
            r.drafted, r.accepted,
        )  # fmt: skip


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
    seeds: list[int] | None = None,
    stop: tuple[str, ...] = (),
    logprobs: bool = False,
    max_batch: int = 16,
    group: mx.distributed.Group | None = None,
) -> list[BatchResult]:
    """Complete every prompt (token ids, or strings wrapped in the chat template), at most
    `max_batch` at a time; a row that finishes makes room for the next prompt.

    Under mlx.launch every rank calls this with the same arguments (rank 0's seeds are
    shared when `seeds` is None) and gets the same results.
    """
    from ..checkpoints.tokenizer import encode_prompt
    from ..cluster.distributed import broadcast_object

    group = group or world()
    ids = [encode_prompt(tokenizer, p) if isinstance(p, str) else list(p) for p in prompts]
    if any(not p for p in ids):
        raise ValueError("a prompt is empty")
    if seeds is None:
        rng = random.SystemRandom()
        seeds = broadcast_object([rng.randrange(2**31) for _ in ids], group)
    engine = BatchEngine(model, tokenizer)
    todo = [
        Join(
            i,
            p,
            SamplingParams(
                max_tokens, temp, top_p, seed=s, stop=tuple(stop), logprobs=0 if logprobs else None
            ),
        )
        for i, (p, s) in enumerate(zip(ids, seeds, strict=True))
    ]
    todo.reverse()
    out: dict[int, BatchResult] = {}
    while todo or len(engine):
        joins = [todo.pop() for _ in range(min(len(todo), max_batch - len(engine)))]
        engine.apply(Decision(joins=joins))
        for e in engine.step():
            res = out.setdefault(e.uid, BatchResult("", [], "", e.prompt_tokens, None))
            res.text += e.text
            if e.token is not None and not (e.finish_reason == "stop" and e.token in engine.eos):
                res.tokens.append(e.token)
            if e.logprob is not None:
                res.logprobs = (res.logprobs or []) + [e.logprob]
            if e.finish_reason:
                res.finish_reason = e.finish_reason
    return [out[i] for i in range(len(ids))]
