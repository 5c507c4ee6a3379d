"""The engine's one way to a sequence's caches, whatever its layers' kinds hold.

A model's cache is mlx-lm's list of one cache per layer (what the model call, prefill
and mlx-lm's `LRUPromptCache` take), each of its layer kind's declared kind
(`parallel/splits.CacheSpec`: a KVCache, a RotatingKVCache of a window, an ArraysCache
of a recurrent state, a CacheList). The engine never assumes they are all trimmable KV
caches; it asks here:

    cache = new(model)
    held(cache)                     # tokens the cache holds
    can_rewind(cache, n)            # can it step back n tokens? (a KV cache can; a
    rewind(cache, n, why)           #   sliding window only until it wraps; a recurrent
                                    #   state never: CacheError naming the layer kind)
    snap = checkpoint(cache)        # a recurrent state kept, to return to later
    restore(cache, snap)            #   (speculative decoding, a chat's next turn)
    why_not_merge(cache)            # None, or which layer's cache cannot join a batch
    batched = merge(cache)          # a batch of one row, of each layer's batched kind
    extend(batched, other); filter(batched, keep); extract(batched, i)

`Decoder._release/_trim/_draft_step`, `BatchEngine._admit/_release`, `Chat._reuse/
_end_turn` and `ModelDrafter.prefill` go through these functions only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache, make_prompt_cache

Cache = list[Any]  # one mlx-lm cache per layer


class CacheError(ValueError):
    """A cache asked to do what its layer kind cannot (step back over a recurrent state)."""


def new(model: nn.Module) -> Cache:
    """An empty cache for `model`: one per layer, as its kinds declare (`make_cache`)."""
    return make_prompt_cache(model)


def _layers(cache: Sequence[Any]) -> list[Any]:
    """Every layer cache, a CacheList's own caches in its place."""
    out = []
    for c in cache:
        out.extend(_layers(c.caches) if isinstance(c, CacheList) else [c])
    return out


def held(cache: Sequence[Any]) -> int:
    """Tokens the cache holds (of one sequence): its KV layers' count (a sliding window's
    counts every token it has seen). CacheError when no layer counts them (a cache of
    recurrent states only: their holder must count)."""
    counts = [c.offset for c in _layers(cache) if isinstance(getattr(c, "offset", None), int)]
    if not counts:
        raise CacheError("no layer of this cache counts its tokens (recurrent states only)")
    return max(counts)


def why_not_rewind(cache: Sequence[Any]) -> str | None:
    """What keeps the cache from stepping back (the first such layer, named by its
    kind), or None when every layer can."""
    for c in _layers(cache):
        if c.is_trimmable():
            continue
        if isinstance(c, RotatingKVCache):
            return (
                "a sliding-window layer's cache cannot step back once it holds its whole "
                "window (gpt-oss)"
            )
        if isinstance(c, ArraysCache):
            return "a recurrent layer's state (linear attention, Mamba) cannot step back"
        return f"a layer's {type(c).__name__} cannot step back"
    return None


def can_rewind(cache: Sequence[Any], n: int = 1) -> bool:
    """Whether every layer can step back `n` tokens (any n > 0 alike: a KV cache can; a
    sliding window only until it wraps; a recurrent state never)."""
    return n <= 0 or why_not_rewind(cache) is None


def rewind(cache: Sequence[Any], n: int, why: str = "") -> None:
    """Step back `n` tokens in every layer; CacheError naming the layer kind that cannot,
    prefixed with `why` (what asked: 'speculative decoding')."""
    if n <= 0:
        return
    reason = why_not_rewind(cache)
    if reason is not None:
        raise CacheError(f"{why}: {reason}" if why else reason)
    for c in cache:
        c.trim(n)


@dataclass(frozen=True)
class Checkpoint:
    """What `restore` needs to bring a cache back: per layer, the token count of a
    trimmable one (it steps back to it), or a copy of the state of one that cannot."""

    layers: tuple[tuple[str, Any], ...]


def _copy(x: Any) -> Any:
    """A copy of a cache state that later in-place updates leave alone."""
    if isinstance(x, mx.array):
        return mx.array(x)  # a new array of the old node: `a[i] = b` rebinds `a` only
    if isinstance(x, list | tuple):
        return type(x)(_copy(v) for v in x)
    return x


def checkpoint(cache: Sequence[Any]) -> Checkpoint:
    """The cache as it is now, to `restore` after tokens were added to it: cheap for KV
    layers (their token count), a copy of the state for the others (recurrent states
    are small and fixed; a sliding window is its window)."""
    out = []
    for c in _layers(cache):
        if c.is_trimmable():
            out.append(("offset", c.offset))
        else:
            out.append(("state", _copy(c.state)))
    return Checkpoint(tuple(out))


def restore(cache: Sequence[Any], snap: Checkpoint) -> None:
    """Bring `cache` back to `checkpoint`'s moment (only tokens added since)."""
    layers = _layers(cache)
    if len(layers) != len(snap.layers):
        raise CacheError(f"a checkpoint of {len(snap.layers)} layers for {len(layers)}")
    for c, (kind, value) in zip(layers, snap.layers, strict=True):
        if kind == "offset":
            if c.offset > value:
                c.trim(c.offset - value)
        else:
            c.state = _copy(value)


def arrays(cache: Sequence[Any]) -> list[mx.array]:
    """Every array the cache holds (to evaluate it: prefill's chunks)."""
    out: list[mx.array] = []

    def walk(x: Any) -> None:
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    for c in _layers(cache):
        walk(c.state)
    return out


# -- batches: each layer's batched kind (mlx-lm's BatchKVCache, BatchRotatingKVCache, an
# ArraysCache of several rows) ---------------------------------------------------------


def why_not_merge(cache: Sequence[Any]) -> str | None:
    """What keeps the cache out of a batch (the first layer cache whose class has no
    `merge`: Llama 4's ChunkedKVCache, as mlx-lm's classes build it), or None. The server
    then runs one sequence at a time."""
    for c in cache:
        if not callable(getattr(type(c), "merge", None)):
            return f"its {type(c).__name__} cannot merge into a batch"
    return None


def merge(cache: Sequence[Any]) -> Cache:
    """One sequence's cache as a batch of one row, each layer's own batched kind."""
    return [c.merge([c]) for c in cache]


def extend(batch: Sequence[Any], other: Sequence[Any]) -> None:
    """Append `other`'s rows to `batch`, layer by layer, in place."""
    for mine, new_rows in zip(batch, other, strict=True):
        mine.extend(new_rows)


def filter_rows(batch: Sequence[Any], keep: list[int]) -> None:
    """Keep the rows at `keep` of `batch`, in place."""
    rows = mx.array(keep, dtype=mx.int32)
    for c in batch:
        c.filter(rows)


def extract(batch: Sequence[Any], i: int) -> Cache:
    """Row `i` of `batch` as one sequence's cache."""
    return [c.extract(i) for c in batch]
