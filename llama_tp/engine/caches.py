"""The engine's one way to a sequence's caches, whatever its layers' kinds hold.

A model's cache is mlx-lm's list of one cache per layer (what the model call, prefill
and mlx-lm's `LRUPromptCache` take), each of its layer kind's declared kind
(`parallel/splits.CacheSpec`: a KVCache, a RotatingKVCache of a window, an ArraysCache
of a recurrent state, a CacheList; `models/caches.py` makes them and has each say how it
steps back). The engine never assumes they are all trimmable KV caches; it asks here:

    cache = new(model)
    held(cache)                     # tokens the cache holds
    can_rewind(cache, n)            # can it step back n tokens? (a KV cache can; a
    rewind(cache, n, why)           #   sliding window only until it wraps, a chunked
                                    #   layer within its chunk; a recurrent state
                                    #   never: CacheError naming the layer kind)
    snap = checkpoint(cache)        # a recurrent state kept, to return to later
    restore(cache, snap)            #   (speculative decoding, a chat's next turn)
    why_not_merge(cache)            # None, or which layer's cache cannot join a batch
    batched = merge(cache)          # a batch of one row, of each layer's batched kind
    extend(batched, other); filter(batched, keep); extract(batched, i)
    kv_position(cache)              # plain KV layers only? their position (else None)
    buf = take_kv(cache, rows)      # their buffers, for the compiled decode step,
    give_kv(cache, buf.kv, 1)       #   given back one position on

`Decoder._release/_trim/_draft_step`, `BatchEngine._admit/_release`, `Chat._reuse/
_end_turn`, `ModelDrafter.prefill` and the compiled decode step (`engine/step.py`) go
through these functions only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, CacheList, KVCache, make_prompt_cache

from ..models import caches as layer_cache

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


def why_not_rewind(cache: Sequence[Any], n: int = 1) -> str | None:
    """What keeps the cache from stepping back `n` tokens (the first such layer, named by
    its kind: each layer's cache answers, `models/caches.why_not_rewind`), or None when
    every layer can."""
    return next(filter(None, (layer_cache.why_not_rewind(c, n) for c in _layers(cache))), None)


def recurrent(cache: Sequence[Any]) -> bool:
    """Whether some layer holds a state it cannot always step back over (a recurrent
    state; a chunked-attention layer's chunk once it moved on): checkpoints serve
    instead."""
    return any(layer_cache.keeps_state(c) for c in _layers(cache))


def can_rewind(cache: Sequence[Any], n: int = 1) -> bool:
    """Whether every layer can step back `n` tokens (a KV cache can; a sliding window only
    until it wraps; a chunked-attention layer within the chunk it holds; a recurrent
    state never)."""
    return n <= 0 or why_not_rewind(cache, n) is None


def rewind(cache: Sequence[Any], n: int, why: str = "") -> None:
    """Step back `n` tokens in every layer; CacheError naming the layer kind that cannot,
    prefixed with `why` (what asked: 'speculative decoding')."""
    if n <= 0:
        return
    reason = why_not_rewind(cache, n)
    if reason is not None:
        raise CacheError(f"{why}: {reason}" if why else reason)
    for c in cache:
        c.trim(n)


@dataclass(frozen=True)
class Checkpoint:
    """What `restore` needs to bring a cache back: per layer, the token count of a
    trimmable one (it steps back to it), or a copy of the state of one that cannot (and
    its token count, if it keeps one)."""

    layers: tuple[tuple[str, Any, int | None], ...]

    def arrays(self) -> list[mx.array]:
        """The copied states' arrays (to evaluate them)."""
        out: list[mx.array] = []
        for kind, value, _ in self.layers:
            if kind == "state":
                _walk(value, out)
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


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
            out.append(("offset", c.offset, c.offset))
        else:
            out.append(("state", _copy(c.state), getattr(c, "offset", None)))
    return Checkpoint(tuple(out))


def restore(cache: Sequence[Any], snap: Checkpoint) -> None:
    """Bring `cache` back to `checkpoint`'s moment (only tokens added since)."""
    layers = _layers(cache)
    if len(layers) != len(snap.layers):
        raise CacheError(f"a checkpoint of {len(snap.layers)} layers for {len(layers)}")
    for c, (kind, value, offset) in zip(layers, snap.layers, strict=True):
        if kind == "offset":
            if c.offset > value:
                c.trim(c.offset - value)
        else:
            c.state = _copy(value)
            if offset is not None:
                c.offset = offset


def arrays(cache: Sequence[Any]) -> list[mx.array]:
    """Every array the cache holds (to evaluate it: prefill's chunks)."""
    out: list[mx.array] = []
    for c in _layers(cache):
        _walk(c.state, out)
    return out


def _walk(x: Any, out: list[mx.array]) -> None:
    if isinstance(x, mx.array):
        out.append(x)
    elif isinstance(x, list | tuple):
        for v in x:
            _walk(v, out)


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


# -- the compiled decode step's view (engine/step.py): plain KV buffers -----------------


@dataclass
class KVBuffers:
    """What the compiled decode step takes from a cache of plain KV layers: each layer's
    whole key and value buffers (B, H, S, D), the write position, each row's RoPE
    position (B,) or one int32 scalar (one sequence), and the first key each row reads
    (B,): its left padding in a batch."""

    kv: list[tuple[mx.array, mx.array]]
    pos: int
    offsets: mx.array
    starts: mx.array
    batch: bool


def _kv_position(c: Any) -> int:
    return c._idx if type(c) is BatchKVCache else c.offset


def kv_position(cache: Sequence[Any]) -> int | None:
    """The common position of a cache whose every layer is a filled plain KV cache of one
    kind (one sequence's KVCache, or a batch's BatchKVCache): what the compiled decode
    step runs over. None for any other cache (a sliding window, a recurrent state, a
    quantized or list cache, an empty one): the model's own forward runs."""
    if not cache:
        return None
    kind = type(cache[0])
    if kind not in (KVCache, BatchKVCache) or any(type(c) is not kind for c in cache):
        return None
    if any(c.keys is None for c in cache):
        return None
    pos = _kv_position(cache[0])
    return pos if all(_kv_position(c) == pos for c in cache) else None


def _reserve(c: Any, n: int) -> None:
    """Room in `c`'s buffers for n more positions, their length a whole number of the
    cache's steps (256): what mlx-lm's `update_and_fetch` grows to, but also after a
    batch's rows joined or left (`merge`, `extend` and `filter_rows` leave any length),
    so that the step's shapes, and its compiled graphs, stay few. Positions past the
    cache's are never read (the key ranges)."""
    size = c.keys.shape[2]
    want = -(-(_kv_position(c) + n) // c.step) * c.step
    if size >= want and size % c.step == 0:
        return
    want = max(want, -(-size // c.step) * c.step)
    B, H, _, D = c.keys.shape
    c.keys = mx.concatenate([c.keys, mx.zeros((B, H, want - size, D), c.keys.dtype)], axis=2)
    pad = mx.zeros((B, H, want - size, c.values.shape[3]), c.values.dtype)
    c.values = mx.concatenate([c.values, pad], axis=2)


def take_kv(cache: Sequence[Any], rows: int, n: int = 1) -> KVBuffers:
    """The buffers of a `kv_position` cache, with room for n more positions, handed to
    the step: the cache lets go of them (MLX may then update them in place) until
    `give_kv` gives them back."""
    for c in cache:
        _reserve(c, n)
    c0 = cache[0]
    batch = type(c0) is BatchKVCache
    pos = _kv_position(c0)
    if batch:
        offsets, starts = c0.offset.astype(mx.int32), c0.left_padding.astype(mx.int32)
    else:
        offsets, starts = mx.array(pos, dtype=mx.int32), mx.zeros((rows,), mx.int32)
    kv = [(c.keys, c.values) for c in cache]
    for c in cache:
        c.keys = c.values = None
    return KVBuffers(kv, pos, offsets, starts, batch)


def give_kv(cache: Sequence[Any], kv: Sequence[tuple[mx.array, mx.array]], n: int = 0) -> None:
    """Give `take_kv`'s buffers (or the step's updated ones) back, n positions on."""
    for c, (k, v) in zip(cache, kv, strict=True):
        c.keys, c.values = k, v
        if n and type(c) is BatchKVCache:
            c.offset = c.offset + n
            c._idx += n
        elif n:
            c.offset += n
