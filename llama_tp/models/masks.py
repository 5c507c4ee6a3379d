"""Each layer's attention mask, as its kind's cache declares (`CacheSpec.mask`): causal,
windowed (sliding-window attention), chunked (Llama 4's chunked attention), or padding
only (a recurrent layer, mlx-lm's `create_ssm_mask`); made once per kind of mask from
the first cache of that kind, as mlx-lm's hybrid models do."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import CacheList

from ..parallel.splits import CacheSpec
from .caches import ChunkedCache


def _mask(spec: CacheSpec | None, h: mx.array, cache: Any) -> Any:
    """The mask of a layer whose kind declares `spec`, for hidden states h (B, L, dim)
    (a CacheList's: its first cache's, as mlx-lm's DeepSeek-V3.2 makes it)."""
    if isinstance(cache, CacheList):
        cache = cache[0]
    if spec is None or spec.mask == "causal":
        return create_attention_mask(h, cache)
    if spec.mask == "window":
        return create_attention_mask(h, cache, window_size=spec.window)
    if spec.mask == "ssm":
        return create_ssm_mask(h, cache)
    if spec.mask == "chunked":
        return chunk_mask(h.shape[1], spec.window, cache)
    raise ValueError(f"unknown mask kind {spec.mask!r}")


def layer_masks(h: mx.array, layers: list[nn.Module], cache: list[Any]) -> list[Any]:
    """Each layer's mask for hidden states h (B, L, dim), as its kind's cache declares
    (`CacheSpec.mask`: causal, windowed for sliding-window attention, padding only for a
    recurrent layer), each made once from the first cache of its kind, as mlx-lm's
    hybrid models do. `cache`: one per layer (`caches.per_layer`; None for a KV-shared
    layer, whose source comes first and makes the mask of its kind)."""
    made: dict[tuple[str, int | None], Any] = {}
    out = []
    for layer, c in zip(layers, cache, strict=True):
        spec = layer.spec.cache
        if spec is None and getattr(layer, "bare_when_uncached", False):
            out.append(None)  # a one-mixer layer of a feed-forward or experts: no mask
            continue
        key = (spec.mask, spec.window) if spec is not None else ("causal", None)
        if key not in made:
            made[key] = _mask(spec, h, c)
        out.append(made[key])
    return out


def chunk_mask(L: int, chunk: int, cache: ChunkedCache | None) -> mx.array | None:
    """The (L, S) boolean mask of L new queries over a chunked-attention cache's keys
    (those it will hold after them, `ChunkedCache.front` on): each query sees the keys of
    its own chunk up to itself (mlx-lm's llama4 chunk mask). None for one query: every
    key held is of its chunk."""
    offset = cache.offset if cache is not None else 0
    if L == 1 and cache is not None:
        return None
    start = cache.front() if cache is not None else 0
    keys = mx.arange(start, offset + L)
    queries = mx.arange(offset, offset + L)[:, None]
    return ((keys // chunk) == (queries // chunk)) & (keys <= queries)
