"""The one generation core: prefill, the decode step over rows, the speculative step.

A `Decoder` holds the sequences being decoded together (its rows) and their KV
cache: the caller's own cache for one sequence (`stream_generate`, `Chat`), or
mlx-lm's `BatchKVCache` behind the server (`batch.BatchEngine`). Every driver
runs the same three pieces:

- `prefill`: a sequence's tokens the cache does not hold, all but the last in
  chunks, then the last one's forward, which samples its first token;
- `step`: one forward of every row's next token (B, 1), the sampler on this
  rank's logits (`sampling.sample`, each row with its own settings and key),
  log-probabilities for the rows that asked, and `Sequence.advance` for each
  row. The step is double-buffered as mlx-lm's `generate_step` is: the next
  forward is built and started (`mx.async_eval`) before the tokens of this
  one are read, so Python's work on them overlaps the computation;
- the speculative step (a batch of one row whose settings ask for drafts):
  the drafter proposes k tokens, one forward checks them, and a draft is kept
  while it equals the token the sampler draws at its position with that
  position's key. The tokens are therefore the plain step's, greedy or
  sampled, whatever the drafter proposes; the cache steps back to the kept ones
  (`caches.rewind`), or, a layer kind that cannot (a recurrent state), goes back to the
  checkpoint taken before the check and takes the kept tokens again.

Between steps each row has one token already sampled and not yet reported or
fed to the cache (`Ahead`): a step feeds it, reports it and samples the next.
Under mlx.launch every rank runs the same steps on the same rows; their
samples agree because the draws depend only on the rows' seeds and positions.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cluster.collectives import collectives
from ..loading.pipeline import verify_logits
from ..parallel.vocab_shards import VocabShard, vocab_shard
from . import caches
from .prefill import prefill
from .sampling import Draw, Sampler, draw_arrays, sample, token_logprobs
from .sequence import Event, Sequence
from .step import decode_step_for


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
    all-reduce (see `sampling.sample(fold=True)`). The returned row is None when the
    sampler cannot fold it.
    """
    step = decode_step_for(model)
    if (
        tokens.shape[0] == 1
        and isinstance(sampler, Sampler)
        and not sampler.params.filtered
        and step.supports(cache)
    ):  # the compiled step (engine/step.py), sampler included
        shard = sampler.shard or _whole(model)
        sampling = draw_arrays([Draw(sampler.params, sampler.n)])
        sampler.n += 1
        logits, y, new_rows = step(tokens, cache, rows, sampling, shard)
        return y, logits, new_rows
    h = None if rows is None else rows[None]  # (1, 1, dim)
    logits = model(tokens[None], cache=cache, input_embeddings=h)[:, -1, :]
    fold = getattr(sampler, "sample_with_rows", None)
    if fold is None:
        return sampler(logits).reshape(-1), logits, None
    y, new_rows = fold(logits)
    return y.reshape(-1), logits, new_rows


def _whole(model: nn.Module) -> VocabShard:
    """The whole-vocabulary shard of `model` (one per model, so that its compiled step
    is found again)."""
    shard = model.__dict__.get("_whole_shard")
    if shard is None:
        shard = VocabShard.whole(model.args.vocab_size)
        object.__setattr__(model, "_whole_shard", shard)
    return shard


@dataclass
class Ahead:
    """Each row's next token, sampled and not yet reported (lazy), with its extras."""

    tokens: mx.array  # (B,) int32
    logprob: mx.array | None = None  # (B,) when a row asked for log-probabilities
    top_ids: mx.array | None = None  # (B, K)
    top_vals: mx.array | None = None
    emb: mx.array | None = None  # (B, dim): the tokens' embedding rows (vocab-parallel)

    def arrays(self) -> list[mx.array]:
        return [a for a in self._fields() if a is not None]

    def select(self, keep: list[int]) -> Ahead:
        idx = mx.array(keep, dtype=mx.int32)
        return Ahead(*(None if a is None else a[idx] for a in self._fields()))

    def _fields(self) -> tuple:
        return self.tokens, self.logprob, self.top_ids, self.top_vals, self.emb

    def extend(self, other: Ahead) -> Ahead:
        """These rows, then `other`'s (log-probabilities padded where one side has none)."""
        a, b = self, other
        if (a.logprob is None) != (b.logprob is None) or _width(a) != _width(b):
            a, b = a._padded(max(_width(a), _width(b))), b._padded(max(_width(a), _width(b)))
        cat = [
            None if x is None or y is None else mx.concatenate([x, y])
            for x, y in zip(a._fields(), b._fields(), strict=True)
        ]
        return Ahead(*cat)

    def _padded(self, k: int) -> Ahead:
        n = self.tokens.shape[0]
        lp = self.logprob if self.logprob is not None else mx.zeros((n,), mx.float32)
        ids = self.top_ids if self.top_ids is not None else mx.zeros((n, 0), mx.int32)
        vals = self.top_vals if self.top_vals is not None else mx.zeros((n, 0), mx.float32)
        pad = k - ids.shape[1]
        ids = mx.concatenate([ids, mx.zeros((n, pad), ids.dtype)], axis=1)
        vals = mx.concatenate([vals, mx.zeros((n, pad), vals.dtype)], axis=1)
        return replace(self, logprob=lp, top_ids=ids, top_vals=vals)

    def resolve(self, rows: Seq[Sequence]) -> list[tuple[int, float | None, list | None]]:
        """(token, its log-probability, its top alternatives) of each row, as Python values."""
        mx.eval(*self.arrays())
        tokens = self.tokens.tolist()
        if self.logprob is None:
            return [(t, None, None) for t in tokens]
        lp = self.logprob.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        vals = self.top_vals.tolist() if self.top_vals is not None else None
        out = []
        for i, (r, t) in enumerate(zip(rows, tokens, strict=True)):
            k = r.params.logprobs
            top = list(zip(ids[i][:k], vals[i][:k], strict=True)) if k and ids else None
            out.append((t, lp[i] if k is not None else None, top))
        return out


def _width(a: Ahead) -> int:
    return 0 if a.top_ids is None else a.top_ids.shape[1]


class Decoder:
    """Rows decoded together over one KV cache (`cache`, batch = len(rows)).

    `drafter`: proposes tokens for a batch of one row whose settings ask for drafts
    (`num_draft_tokens`). `overlap=False` reads each step's tokens before the next
    forward starts (no double-buffering; for measuring what it brings).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        drafter: Any = None,
        prefill_step_size: int = 512,
        overlap: bool = True,
    ):
        self.model, self.drafter = model, drafter
        self.shard = vocab_shard(model)
        self.rows: list[Sequence] = []
        self.cache: list[Any] | None = None
        self.ahead: Ahead | None = None
        self.prefill_step_size, self.overlap = prefill_step_size, overlap

    def __len__(self) -> int:
        return len(self.rows)

    # -- a sequence's start ---------------------------------------------------

    def start(self, seq: Sequence, cache: list[Any]) -> None:
        """Decode `seq` alone over `cache` (which holds its first `seq.fed` tokens)."""
        self.ahead = self.prefill(seq, cache)
        self.rows, self.cache = [seq], cache

    def prefill(self, seq: Sequence, cache: list[Any]) -> Ahead:
        """Feed the tokens of `seq` that `cache` does not hold (seq.fed) into it: all but
        the last in chunks, then the last one's forward. Its first token, sampled (lazy).
        At each of `seq.marks` (a count of its tokens in the cache) the cache, evaluated,
        goes to `seq.on_mark(count, cache)` to keep a checkpoint of (a recurrent state
        cannot step back: a later prompt sharing that prefix starts from there)."""
        start, end = seq.fed, len(seq.tokens)
        for m in sorted(m for m in set(seq.marks) if start < m < end):
            prefill(self.model, seq.tokens[start:m], cache, self.prefill_step_size)
            self._mark(seq, m, cache)
            start = m
        prefill(self.model, seq.tokens[start:-1], cache, self.prefill_step_size)
        logits = self.model(mx.array(seq.tokens[-1:], dtype=mx.int32)[None], cache=cache)
        logits = logits[:, -1, :]
        seq.fed = end
        if end in seq.marks:
            self._mark(seq, end, cache)
        ahead = self._sample(logits, [seq], [seq.n])
        # Started now, before any later graph: every rank must run its collectives in the
        # same order, and on a pipeline the next forward's send waits for this token.
        mx.async_eval(*ahead.arrays())
        return ahead

    def _mark(self, seq: Sequence, held: int, cache: list[Any]) -> None:
        if seq.on_mark is not None:
            mx.eval(caches.arrays(cache))
            seq.on_mark(held, cache)

    # -- one step -------------------------------------------------------------

    def step(self) -> list[Event]:
        """One token for every row (several for a lone row that drafts); finished rows
        leave. The events are the same on every rank."""
        if not self.rows:
            return []
        r = self.rows[0]
        if len(self.rows) == 1 and r.params.num_draft_tokens and self.drafter is not None:
            return self._draft_step(r)
        rows, ahead = self.rows, self.ahead
        nxt = None
        if any(r.n + 1 < r.params.max_tokens for r in rows):  # else every row ends now
            index = [r.n + 1 for r in rows]
            logits, nxt = self._forward(rows, ahead, index)
            if nxt is None and any(r.processors for r in rows):
                # Processors read this step's fed tokens (a grammar's mask follows them):
                # start the forward first, so that their Python work overlaps it.
                mx.async_eval(logits)
            for r in rows:
                r.fed += 1
            fed = ahead.tokens  # each row's token, fed now and not yet in its tokens

            def history(b: int) -> mx.array:
                return mx.concatenate([mx.array(rows[b].history, mx.int32), fed[b : b + 1]])

            if nxt is None:
                nxt = self._sample(logits, rows, index, history)
            mx.async_eval(*nxt.arrays())
            if not self.overlap:
                mx.eval(*nxt.arrays())
        events = [r.advance(*x) for r, x in zip(rows, ahead.resolve(rows), strict=True)]
        keep = [i for i, r in enumerate(rows) if not r.finished]
        self.ahead = nxt.select(keep) if nxt is not None and keep else None
        self._release(keep)
        return events

    def _forward(
        self, rows: list[Sequence], ahead: Ahead, index: list[int]
    ) -> tuple[mx.array, Ahead | None]:
        """This step's logits (B, V_local) for the rows' pending tokens, and, where the
        decode step samples them itself (greedy and temperature rows without logits
        processors or log-probabilities), their next tokens: `engine/step.py`."""
        step = decode_step_for(self.model)
        if step.supports(self.cache):
            plain = all(
                not r.processors and r.params.logprobs is None and not r.params.filtered
                for r in rows
            )
            draws = [Draw(r.params, i) for r, i in zip(rows, index, strict=True)]
            sampling = draw_arrays(draws) if plain else False
            logits, y, emb = step(ahead.tokens, self.cache, ahead.emb, sampling, self.shard)
            return logits, (Ahead(y, emb=emb) if plain else None)
        h = None if ahead.emb is None else ahead.emb[:, None]
        logits = self.model(ahead.tokens[:, None], cache=self.cache, input_embeddings=h)
        return logits[:, -1, :], None

    def _draft_step(self, r: Sequence) -> list[Event]:
        """The lone row's speculative step: report its pending token, draft up to k more
        after it, check them in one forward, keep the ones the sampler agrees with."""
        ((y, lp, top),) = self.ahead.resolve([r])
        events = [r.advance(y, lp, top)]
        if r.finished:
            self.ahead = None
            self._release([])
            return events
        k = min(r.params.num_draft_tokens, r.params.max_tokens - r.n - 1)
        # A cache that cannot step back over rejected drafts (a recurrent state) is
        # checkpointed first, and the kept tokens fed again from there (`_trim`).
        snap = None if caches.can_rewind(self.cache, 1) else caches.checkpoint(self.cache)
        with collectives() as calls:
            drafts = self.drafter.propose(r.history, k, self._draft_sampler(r)) if k > 0 else []
            logits = verify_logits(self.model, mx.array([[y, *drafts]], mx.int32), self.cache)
            known = mx.array(r.history + drafts, mx.int32)  # position i follows drafts[:i]
            n, m = len(r.history), len(drafts) + 1
            out = self._sample(
                logits[0], [r] * m, [r.n + i for i in range(m)], lambda i: known[: n + i]
            )
            checked = out.resolve([r] * (len(drafts) + 1))
        r.fed += 1 + len(drafts)
        kept = 0
        while kept < len(drafts) and drafts[kept] == checked[kept][0]:
            kept += 1
        r.spec.record(len(drafts), kept, len(calls))
        fed = [y, *drafts]
        self._trim(r, len(drafts) - kept, snap, fed)
        for i in range(kept):
            events.append(r.advance(*checked[i]))
            if r.finished:
                self._trim(r, kept - 1 - i, snap, fed)  # the drafts after the one ending it
                self.ahead = None
                self._release([])
                return events
        self.ahead = out.select([kept])  # the target's own token after the kept drafts
        return events

    def _draft_sampler(self, r: Sequence) -> Callable[[mx.array, Any, int], mx.array]:
        """What a drafter samples its i-th draft with: the row's settings and the key of
        the position the draft stands at (so a good drafter proposes the target's draws)."""

        def draw(logits: mx.array, shard, i: int) -> mx.array:
            return sample(logits, [Draw(r.params, r.n + i)], shard)[0]

        return draw

    def _trim(
        self, r: Sequence, n: int, snap: caches.Checkpoint | None = None, fed: list[int] = ()
    ) -> None:
        """Step the cache back over the row's last `n` fed tokens (rejected drafts): a
        cache that cannot is brought back to `snap` (taken before `fed` went in) and the
        tokens of `fed` it keeps are fed again."""
        if n <= 0:
            return
        if caches.can_rewind(self.cache, n):
            caches.rewind(self.cache, n)
        elif snap is not None:
            caches.restore(self.cache, snap)
            keep = fed[: len(fed) - n]
            if keep:
                self.model(mx.array([keep], dtype=mx.int32), cache=self.cache)
                mx.eval(caches.arrays(self.cache))
        else:
            reason = caches.why_not_rewind(self.cache)
            raise caches.CacheError(f"speculative decoding: {reason}; run without a draft")
        r.fed -= n

    # -- sampling -------------------------------------------------------------

    def _sample(
        self,
        logits: mx.array,
        rows: list[Sequence],
        index: list[int],
        history: Callable[[int], mx.array] | None = None,
    ) -> Ahead:
        """Tokens for logits (B, V_local), row b drawn as token `index[b]` of rows[b], and
        the log-probabilities the rows asked for. `history(b)`: the tokens row b's logits
        follow, for its logits processors (default: its `tokens`)."""
        if any(r.processors for r in rows):
            logits = self._process(logits, rows, history)
        draws = [Draw(r.params, i) for r, i in zip(rows, index, strict=True)]
        tokens, emb = sample(logits, draws, self.shard, fold=True)
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if not asked:
            return Ahead(tokens, emb=emb)
        lp, ids, vals = token_logprobs(logits, tokens, self.shard, max(asked))
        return Ahead(tokens, lp, ids, vals, emb)

    def _process(self, logits: mx.array, rows: list[Sequence], history) -> mx.array:
        """Each row's logits processors on its row of logits (this rank's columns)."""
        out = []
        for b, r in enumerate(rows):
            row = logits[b : b + 1]
            if r.processors:
                tokens = history(b) if history else mx.array(r.history, mx.int32)
                row = r.process(tokens, row, self.shard)
            out.append(row)
        return mx.concatenate(out, axis=0)

    def _release(self, keep: list[int]) -> None:
        """The rows at `keep` stay, the others have finished (the batch engine frees their
        cache rows, and may remember them). A finished sequence's cache holds its tokens
        but the last, whichever step ended it: a plain step may have fed the last one,
        which is stepped back over where the layers' kinds can (`caches.held` says what a
        cache that cannot holds)."""
        if not keep and len(self.rows) == 1 and self.cache is not None:
            r = self.rows[0]
            extra = r.fed - (len(r.tokens) - 1)
            if caches.can_rewind(self.cache, extra):
                self._trim(r, extra)
        self.rows = [self.rows[i] for i in keep]
