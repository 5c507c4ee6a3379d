"""Drafters for speculative decoding: prompt lookup (n-grams) and a small draft model.

A drafter proposes up to k next tokens after the tokens generated so far; the
target model then checks them in one forward (`engine/speculative.py`). Every
rank runs the same drafter on the same tokens, so every rank proposes the same
drafts (a replicated draft model computes the same on every rank; a sharded one
agrees through its collectives; sampling uses the key stream all ranks share).

A drafter keeps `history`: every token of the sequence the target's cache holds
or is about to hold (prompt and accepted tokens), so that a chat can continue
from its cache and trim both alike (`trim`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .sampling import VocabShard, vocab_shard

MAX_DRAFT_TOKENS = 64


class Drafter:
    """What the speculative loop needs: history, proposals, and trimming."""

    def __init__(self) -> None:
        self.history: list[int] = []

    def reset(self) -> None:
        """Forget everything (a new sequence from an empty cache)."""
        self.history = []

    def trim(self, n: int) -> None:
        """Keep the first `n` tokens of the history (the target's cache was trimmed to n)."""
        self.history = self.history[:n]

    def extend(self, tokens: list[int]) -> None:
        """Tokens the target's cache now holds (or is about to: the last one)."""
        self.history.extend(tokens)

    def prefill(self, step: int = 512) -> None:
        """Process the history but its last token (draft models); before the timed loop."""

    def propose(self, k: int, temp: float, key: mx.array | None) -> tuple[list[int], Any]:
        """Up to `k` tokens to follow the history, and their draft distributions:
        (tokens, q) with q the log-probabilities (n, V or V_local) aligned with the
        target's logits, or None when each draft is certain (a point mass)."""
        raise NotImplementedError

    def accepted(self, base: int, n_accepted: int) -> None:
        """After verification: the history (length `base` before the step's new tokens
        were added) kept `n_accepted` of the drafts; drop what was not kept."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the history's last n tokens
    (n from `max_ngram` down to `min_ngram`) and propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__()
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, k: int, temp: float, key: mx.array | None) -> tuple[list[int], Any]:
        return lookup(self.history, k, self.max_ngram, self.min_ngram), None


def lookup(history: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the history's last n-gram."""
    n_hist = len(history)
    if k <= 0:
        return []
    for n in range(min(max_ngram, n_hist - 1), min_ngram - 1, -1):
        tail = history[n_hist - n :]
        # latest match first: recent text is the best predictor of what comes next
        for start in range(n_hist - n - 1, -1, -1):
            if history[start : start + n] == tail:
                return history[start + n : start + n + k]
    return []


class ModelDrafter(Drafter):
    """A small model that shares the target's tokenizer, with its own KV cache.

    `model` is whole on every rank (replicated: drafting costs no collective) or
    sharded like the target (its logits are then this rank's vocabulary range,
    the same range as the target's). `target_shard` is the target's vocabulary
    range: a replicated draft's distributions are cut to it.
    """

    def __init__(self, model: nn.Module, target_shard: VocabShard | None = None):
        super().__init__()
        self.model = model
        self.shard = vocab_shard(model)  # None when replicated (or not vocabulary-parallel)
        self.target_shard = target_shard
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.cache = make_prompt_cache(self.model)
        self.fed: list[int] = []  # the tokens the draft cache holds, exactly

    def trim(self, n: int) -> None:
        super().trim(n)
        self._trim_cache(n)

    def _trim_cache(self, n: int) -> None:
        if len(self.fed) > n:
            trim_prompt_cache(self.cache, len(self.fed) - n)
            self.fed = self.fed[:n]

    def _feed(self, tokens: list[int]) -> mx.array:
        """Feed tokens into the draft cache; logits of the last one: (V or V_local,)."""
        logits = self.model(mx.array(tokens, dtype=mx.int32)[None], cache=self.cache)
        self.fed.extend(tokens)
        return logits[0, -1]

    def prefill(self, step: int = 512) -> None:
        # The histories agree up to len(fed) unless a caller changed them: check cheaply.
        if self.history[: len(self.fed)] != self.fed:
            self.reset_cache()
        pending = self.history[len(self.fed) : -1]
        for i in range(0, len(pending), step):
            self._feed(pending[i : i + step])
            mx.eval([c.state for c in self.cache])

    def reset_cache(self) -> None:
        self.cache, self.fed = make_prompt_cache(self.model), []

    def propose(self, k: int, temp: float, key: mx.array | None) -> tuple[list[int], Any]:
        pending = self.history[len(self.fed) :]
        drafts: list[int] = []
        qs: list[mx.array] = []
        for i in range(k):
            logits = self._feed(pending).astype(mx.float32)[None]  # (1, V[_local])
            if temp == 0:
                d = self._argmax(logits)
            else:
                key, sub = mx.random.split(key)
                z = logits / temp
                d = self._argmax(z + self._gumbel(sub, z.shape[-1]))
                qs.append(self._logprobs(z))
            if i + 1 < k:
                mx.async_eval(d)
            pending = [d.item()]
            drafts.append(pending[0])
        if temp == 0 or not qs:
            return drafts, None
        return drafts, mx.concatenate(qs, axis=0)  # (k, V_target_local)

    def _argmax(self, scores: mx.array) -> mx.array:
        if self.shard is None:
            return mx.argmax(scores, axis=-1)[0]
        return self.shard.argmax(scores)[0]

    def _gumbel(self, key: mx.array, width: int) -> mx.array:
        if self.shard is None:
            return mx.random.gumbel(shape=(1, width), key=key)
        return self.shard.local_gumbel(key, 1)

    def _logprobs(self, z: mx.array) -> mx.array:
        """log q over the target's columns: (1, V_target_local)."""
        if self.shard is not None:  # sharded alike: the same columns as the target's
            return z - self.shard.logsumexp(z)
        lq = z - mx.logsumexp(z, axis=-1, keepdims=True)
        t = self.target_shard
        return lq if t is None else lq[:, t.start : t.stop]

    def accepted(self, base: int, n_accepted: int) -> None:
        # fed = history[:base] + drafts[:k-1]; keep history[:base] + the accepted drafts
        self._trim_cache(min(len(self.fed), base + n_accepted))


def make_drafter(draft: Any, target: nn.Module) -> Drafter | None:
    """A drafter from `draft`: None, "ngram", a Drafter, or a (draft) model."""
    if draft is None or isinstance(draft, Drafter):
        return draft
    if isinstance(draft, str):
        if draft == "ngram":
            return NgramDrafter()
        raise ValueError(f"unknown drafter {draft!r}: use 'ngram' or a draft model")
    if isinstance(draft, nn.Module):
        return ModelDrafter(draft, vocab_shard(target))
    raise TypeError(f"draft must be 'ngram', a Drafter or a model, not {type(draft).__name__}")


def check_num_draft_tokens(k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(
            f"num_draft_tokens must be an integer from 1 to {MAX_DRAFT_TOKENS}, got {k}"
        )


PROBES = ("The quick brown fox", "Hello, world! 123", "é 東京")


def check_same_tokenizer(target: nn.Module, target_tok: Any, draft: nn.Module, draft_tok: Any):
    """Raise ValueError (one line) unless the draft model shares the target's vocabulary."""
    tv, dv = target.args.vocab_size, draft.args.vocab_size
    if tv != dv:
        raise ValueError(
            f"the draft model's vocabulary has {dv} tokens, the model's {tv}: "
            "a draft model must share the model's tokenizer"
        )
    for text in PROBES:
        a, b = list(target_tok.encode(text)), list(draft_tok.encode(text))
        if a != b:
            raise ValueError(
                f"the draft model's tokenizer differs from the model's: {text!r} is {b[:8]} "
                f"for the draft and {a[:8]} for the model"
            )
    if set(target_tok.eos_token_ids) != set(draft_tok.eos_token_ids):
        raise ValueError(
            f"the draft model's end-of-sequence ids {sorted(draft_tok.eos_token_ids)} differ "
            f"from the model's {sorted(target_tok.eos_token_ids)}"
        )


def load_draft(
    path: str | Path,
    target: nn.Module,
    tokenizer: Any,
    group: mx.distributed.Group,
    sharded: bool = False,
    split: tuple[float, ...] | None = None,
) -> nn.Module:
    """Load the draft model at `path`: whole on every rank, or sharded over `group` with
    the target's vocabulary setting and `split` weights (its --split: the same vocabulary
    rows per rank); raises on every rank when its tokenizer differs."""
    from ..checkpoints.tokenizer import load_tokenizer
    from ..cluster.distributed import agree_ok
    from .loader import load_model, load_whole

    if sharded:
        vocab_parallel = vocab_shard(target) is not None
        model, ckpt = load_model(path, group, vocab_parallel, split=split)
    else:
        model, ckpt = load_whole(path, group)
    error = None
    try:
        check_same_tokenizer(target, tokenizer, model, load_tokenizer(ckpt))
    except Exception as e:
        error = e
    agree_ok(error, group)
    return model
