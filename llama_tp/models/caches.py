"""Every cache a layer holds: made from its kind's declaration, and each answering
whether and how it steps back.

A layer kind declares its cache (`parallel/splits.CacheSpec`: "kv", "rotating",
"chunked", "arrays", "list", "shared"); `make_layer_cache` makes it: mlx-lm's KVCache,
RotatingKVCache and CacheList, or one of the two kinds of llama_tp's own here,
`StateCache` (a recurrent state that counts its tokens) and `ChunkedCache` (Llama 4's
current chunk). A model's cache is one per caching layer (`layer_caches`; none for a
KV-shared layer), `per_layer` spreads it over the layers.

What a cache can undo is the cache's to say: `why_not_rewind(c, n)` asks the cache
(llama_tp's kinds answer themselves) and answers for mlx-lm's classes (a sliding
window once it wraps; a recurrent state of mlx-lm's models on the generic path;
batched kinds), so that the engine's facade (`engine/caches.py`) never tests a class.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

from ..parallel.splits import CacheSpec


class StateCache(ArraysCache):
    """mlx-lm's ArraysCache of a recurrent state (a linear-attention layer's conv and
    delta-rule state) that also counts the tokens the state has taken (`offset`, as a
    KV cache counts them), so that a cache of recurrent layers only (a pipeline stage of
    them, a Mamba model) still says what it holds. The count is one sequence's: a batch's
    rows keep their own in their KV layers."""

    def __init__(self, size: int, left_padding: list[int] | None = None, what: str = ""):
        super().__init__(size, left_padding)
        self.offset = 0
        self.what = what  # the layer kind (`CacheSpec.what`), for refusals

    def advance(self, N: int) -> None:
        super().advance(N)
        self.offset += N

    @classmethod
    def merge(cls, caches: list[Any]) -> StateCache:
        batch = super().merge(caches)
        batch.what = caches[0].what
        return batch

    def extract(self, idx: int) -> StateCache:
        row = StateCache(len(self.cache), what=self.what)
        row.cache = [c[idx : idx + 1] for c in self.cache]
        return row

    def why_not_rewind(self, n: int) -> str | None:
        """A recurrent state never steps back: it holds no earlier state."""
        return _recurrent(self)


class ChunkedCache(ChunkedKVCache):
    """mlx-lm's ChunkedKVCache of a chunked-attention layer (Llama 4: a query attends to
    the keys of its own chunk of `chunk_size` positions only), holding the keys from the
    start of the chunk of the first new token on: it drops the earlier ones when a token
    enters a new chunk (once a chunk, where mlx-lm's model keeps the last chunk_size keys
    and drops one at every step). Between decoding steps it holds at most a chunk.

    It steps back `n` tokens only while the chunk it steps back into is still held
    (`rewinds`, which `why_not_rewind` asks; `is_trimmable` says no to mlx-lm's prompt
    cache); `state` is mlx-lm's (keys, values, offset, chunk_size, start)."""

    def front(self) -> int:
        """The first position the cache holds once the next tokens are in."""
        if self.keys is None:
            return self.start_position
        return max(self.start_position, self.offset // self.chunk_size * self.chunk_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        drop = self.front() - self.start_position
        if drop:
            end = self.offset - self.start_position
            self.keys = self.keys[..., drop:end, :]
            self.values = self.values[..., drop:end, :]
            self.start_position += drop
        return super().update_and_fetch(keys, values)

    def maybe_trim_front(self) -> None:
        """(mlx-lm's model trims before every call; this cache trims in `update_and_fetch`.)"""

    def is_trimmable(self) -> bool:
        """False for mlx-lm's prompt cache (it would trim any count): the engine's facade
        asks `rewinds(n)`."""
        return False

    def rewinds(self, n: int) -> bool:
        """Whether stepping back `n` tokens leaves the keys the next token attends to."""
        offset = self.offset - n
        return offset >= 0 and offset // self.chunk_size * self.chunk_size >= self.start_position

    def why_not_rewind(self, n: int) -> str | None:
        if self.rewinds(n):
            return None
        return (
            "a chunked-attention layer's cache cannot step back past the start of the "
            "chunk it holds (Llama 4)"
        )

    def trim(self, n: int) -> int:
        if not self.rewinds(n):
            raise ValueError(f"a chunked-attention cache cannot step back {n} tokens")
        self.offset -= n
        return n


def _recurrent(c: ArraysCache) -> str:
    kind = getattr(c, "what", "") or "linear attention, Mamba"
    return f"a recurrent layer's state ({kind}) cannot step back"


def why_not_rewind(c: Any, n: int = 1) -> str | None:
    """What keeps one layer's cache `c` from stepping back `n` tokens, or None when it
    can: its own answer (llama_tp's kinds), else mlx-lm's `is_trimmable` and, where it
    says no, the reason of mlx-lm's class (a CacheList: its first cache that cannot)."""
    own = getattr(c, "why_not_rewind", None)
    if own is not None:
        return own(n)
    if isinstance(c, CacheList):
        return next(filter(None, (why_not_rewind(x, n) for x in c.caches)), None)
    if c.is_trimmable():
        return None
    if isinstance(c, RotatingKVCache):
        return (
            "a sliding-window layer's cache cannot step back once it holds its whole "
            "window (gpt-oss)"
        )
    if isinstance(c, ArraysCache):
        return _recurrent(c)
    return f"a layer's {type(c).__name__} cannot step back"


def keeps_state(c: Any) -> bool:
    """Whether one layer's cache `c` holds a state it cannot always step back over (a
    recurrent state; a chunked-attention layer's chunk once it moved on): checkpoints of
    it serve instead (`engine/caches.checkpoint`)."""
    return isinstance(c, ArraysCache | ChunkedCache)


def cache_kind(c: Any) -> tuple:
    """What makes two caches interchangeable for the masks a model makes from them (the
    generic path's stages, over mlx-lm's own caches)."""
    if isinstance(c, CacheList):
        return ("CacheList", *(cache_kind(x) for x in c.caches))
    if isinstance(c, ArraysCache):
        return (type(c).__name__, len(c.cache))
    params = ("max_size", "keep", "chunk_size", "step")
    return (type(c).__name__, *((k, getattr(c, k)) for k in params if hasattr(c, k)))


def make_layer_cache(spec: CacheSpec | None) -> Any:
    """mlx-lm's cache of the kind `spec` declares: a KVCache, a RotatingKVCache of the
    window (it never holds more than the window), a `ChunkedCache` of chunked attention
    (the current chunk's keys), an ArraysCache of fixed-size arrays (a `StateCache`: it
    counts its tokens), or a CacheList; a layer that caches nothing still gets a KVCache
    (unused), as mlx-lm's models give every layer one."""
    if spec is None or spec.kind == "kv":
        return KVCache()
    if spec.kind == "rotating":
        return RotatingKVCache(max_size=spec.window)
    if spec.kind == "chunked":
        return ChunkedCache(spec.window)
    if spec.kind == "arrays":
        return StateCache(size=spec.size, what=spec.what)
    if spec.kind == "list":
        return CacheList(*[make_layer_cache(p) for p in spec.parts])
    raise ValueError(f"unknown cache kind {spec.kind!r}")


def shares_cache(layer: nn.Module) -> bool:
    """Whether `layer` has no cache of its own: it attends over another layer's keys and
    values (Gemma's KV-shared layers), or its kinds cache nothing and the block then
    takes none (`bare_when_uncached`: a `MixerBlock` of a feed-forward or experts,
    Nemotron-H's, as mlx-lm's make_cache)."""
    spec = layer.spec.cache
    if spec is None:
        return getattr(layer, "bare_when_uncached", False)
    return spec.kind == "shared"


def layer_caches(layers: list[nn.Module]) -> list[Any]:
    """mlx-lm's caches for `layers`, one per layer as each layer's kinds declare, none
    for a KV-shared layer (so fewer than the layers, as mlx-lm's Gemma 4 makes)."""
    return [make_layer_cache(layer.spec.cache) for layer in layers if not shares_cache(layer)]


def per_layer(layers: list[nn.Module], cache: list[Any] | None) -> list[Any]:
    """`cache` (`layer_caches`' list, or None) as one entry per layer: None for a
    KV-shared layer (and for all without a cache)."""
    if cache is None:
        return [None] * len(layers)
    owners = [layer for layer in layers if not shares_cache(layer)]
    if len(owners) != len(cache):
        raise ValueError(f"a cache of {len(cache)} layers for {len(owners)} caching layers")
    it = iter(cache)
    return [None if shares_cache(layer) else next(it) for layer in layers]
