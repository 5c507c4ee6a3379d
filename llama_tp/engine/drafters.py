"""Drafters for speculative decoding: prompt lookup (n-grams) and a small draft model.

A drafter proposes up to k tokens to follow a sequence (`propose(tokens, k, draw)`,
`tokens` ending with the token the target is about to be fed); the target then
checks them in one forward (`decoder.Decoder`, `engine/speculative.py`). Every
rank runs the same drafter on the same tokens, so every rank proposes the same
drafts: a replicated draft model computes the same on every rank, a sharded one
agrees through its collectives, and both sample with `draw`, the target's
sampler at each draft's position and key.

A draft model keeps its own KV cache and the tokens it holds; each proposal
first trims it to the longest prefix it shares with the sequence (a chat's
earlier turns stay, rejected drafts go) and feeds the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..parallel.vocab_shards import VocabShard, vocab_shard
from . import caches
from .prefill import prefill

# draw(logits (1, V_local), their shard, i) -> the i-th draft (1,), as the target samples it
Draw = Callable[[mx.array, VocabShard, int], mx.array]


class Drafter:
    """What the speculative step needs: proposals after a sequence."""

    def prefill(self, tokens: list[int], step: int = 512) -> None:
        """Process `tokens` but the last ahead of the first proposal (draft models)."""

    def propose(self, tokens: list[int], k: int, draw: Draw) -> list[int]:
        """Up to `k` tokens to follow `tokens`."""
        raise NotImplementedError


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from `max_ngram` down to `min_ngram`) and propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, tokens: list[int], k: int, draw: Draw) -> list[int]:
        return lookup(tokens, k, self.max_ngram, self.min_ngram)


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
    sharded like the target (its logits are then this rank's vocabulary columns).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.shard = vocab_shard(model)
        self.cache = caches.new(model)
        self.fed: list[int] = []  # the tokens the draft cache holds, exactly

    def prefill(self, tokens: list[int], step: int = 512) -> None:
        common = 0
        if tokens[: len(self.fed)] == self.fed:
            common = min(len(self.fed), len(tokens) - 1)
        else:
            while (
                common < min(len(self.fed), len(tokens) - 1) and self.fed[common] == tokens[common]
            ):
                common += 1
        if common < len(self.fed):
            if caches.can_rewind(self.cache, len(self.fed) - common):
                caches.rewind(self.cache, len(self.fed) - common)
            else:  # a layer kind that cannot step back: the draft's cache afresh
                self.cache, common = caches.new(self.model), 0
            self.fed = self.fed[:common]
        prefill(self.model, tokens[common:-1], self.cache, step)
        self.fed = list(tokens[:-1])

    def propose(self, tokens: list[int], k: int, draw: Draw) -> list[int]:
        self.prefill(tokens)
        pending, drafts = tokens[-1:], []
        for i in range(k):
            logits = self.model(mx.array(pending, mx.int32)[None], cache=self.cache)[:, -1, :]
            self.fed += pending
            d = draw(logits, self.shard, i)
            if i + 1 < k:
                mx.async_eval(d)
            pending = [d.item()]
            drafts.append(pending[0])
        return drafts


def make_drafter(draft: Any, target: nn.Module) -> Drafter | None:
    """A drafter from `draft`: None, "ngram", a Drafter, or a (draft) model."""
    if draft is None or isinstance(draft, Drafter):
        return draft
    if isinstance(draft, str):
        if draft == "ngram":
            return NgramDrafter()
        raise ValueError(f"unknown drafter {draft!r}: use 'ngram' or a draft model")
    if isinstance(draft, nn.Module):
        return ModelDrafter(draft)
    raise TypeError(f"draft must be 'ngram', a Drafter or a model, not {type(draft).__name__}")


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
    from ..cluster.distributed import agreed
    from ..loading.loader import load_model, load_whole

    if sharded:
        vocab_parallel = vocab_shard(target).ranks > 1
        model, ckpt = load_model(path, group, vocab_parallel, split=split)
    else:
        model, ckpt = load_whole(path, group)
    agreed(lambda: check_same_tokenizer(target, tokenizer, model, load_tokenizer(ckpt)), group)
    return model
