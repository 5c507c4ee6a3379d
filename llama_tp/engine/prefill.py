"""Prefill: a prompt's tokens into a KV cache, in chunks, without their logits."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .caches import arrays


def prefill(model: nn.Module, tokens: list[int], cache: list[Any], step: int = 512) -> None:
    """Run `tokens` into `cache` in chunks of `step` positions. Only the caches are
    evaluated: the output head never runs for these positions (as in mlx-lm)."""
    x = mx.array(tokens, dtype=mx.int32)
    while x.size:
        n = min(step, x.size)
        model(x[None, :n], cache=cache)
        mx.eval(arrays(cache))
        x = x[n:]
