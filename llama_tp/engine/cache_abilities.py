"""What a model's caches can do, asked of mlx-lm's own caches (one function).

    a = cache_abilities(make_prompt_cache(model))
    a.rewinds   # trim_prompt_cache works: Chat reuses the cache, speculative steps back
    a.merges    # every cache merges into a batch: the server batches, else one at a time
    a.held      # tokens the cache holds (the first cache that counts them), None: unknown

A Llama's KV caches do all three; a sliding window that has filled cannot rewind;
a recurrent state (Mamba, gated delta: `ArraysCache`) merges but cannot rewind and does
not count tokens; a chunked cache (Llama 4) neither rewinds nor merges. `why` names the
first cache that cannot, for the server's log and `/v1/status`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache


@dataclass(frozen=True)
class CacheAbilities:
    rewinds: bool
    merges: bool
    held: int | None
    why_not_merged: str | None = None


def cache_abilities(cache: list[Any]) -> CacheAbilities:
    """`cache` (one model's per-layer caches) asked with mlx-lm's own functions."""
    cannot = next((c for c in cache if not callable(getattr(type(c), "merge", None))), None)
    why = None if cannot is None else f"its {type(cannot).__name__} cannot merge into a batch"
    held = next((c.offset for c in cache if isinstance(getattr(c, "offset", None), int)), None)
    return CacheAbilities(can_trim_prompt_cache(cache), cannot is None, held, why)
