"""Sequence parallelism in prefill: the residual stream and norms split along the sequence.

Between the sharded projections every rank keeps only its chunk of the sequence,
(B, ceil(L / N), dim), instead of the whole (B, L, dim):

- the layer that starts the residual stream (the embedding) keeps its own chunk
  (`SequenceContext.scatter`);
- a module whose input must be whole (attention, feed-forward, the output head)
  first gathers the chunks (`all_gather`, `SequenceContext.gather`); attention then
  takes its queries one chunk at a time (its `query_chunk`), so that MLX's unfused
  CPU attention builds (L / N, L) scores per head instead of (L, L);
- a sharded-to-all projection (`wo`, `w2`) ends in a reduce-scatter over the
  sequence. MLX 0.32's ring backend (CPU) has no `sum_scatter` ("[ring] sum_scatter
  not supported"), so it is the projection's `all_sum` followed by taking the chunk:
  the same bytes as today's all-reduce, and the sum is transient.

Uneven lengths are padded to a multiple of N (the padding never enters attention:
`gather` trims it). Sequence parallelism is active only while each chunk has at
least two positions (L > N): decoding (L = 1) and very short prompts run the plain
path unchanged, and the mask the model computes from its chunk ("causal") stays right.

The split is done by changing the class of the modules the styles name (a subclass
whose `__call__` adds the gather or scatter), so parameter names, and therefore
checkpoint loading, are unchanged and the model code stays rank-agnostic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn


class SequenceContext:
    """The state a model's sequence-parallel layers share during one forward pass."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.length: int | None = None  # the whole sequence length while active

    @property
    def active(self) -> bool:
        return self.length is not None

    def chunk(self) -> int:
        """Positions per rank: ceil(L / N)."""
        assert self.length is not None
        return -(-self.length // self.group.size())

    def begin(self, length: int) -> None:
        """Start a forward pass over `length` positions (active if each chunk gets >= 2)."""
        n = self.group.size()
        self.length = length if n > 1 and -(-length // n) >= 2 else None

    def scatter(self, x: mx.array) -> mx.array:
        """Whole (B, L, ...) (the same on every rank) -> this rank's chunk (B, Lc, ...)."""
        if not self.active:
            return x
        c, n = self.chunk(), self.group.size()
        pad = c * n - x.shape[1]
        if pad:
            widths = [(0, 0)] * x.ndim
            widths[1] = (0, pad)
            x = mx.pad(x, widths)
        r = self.group.rank()
        return mx.contiguous(x[:, r * c : (r + 1) * c])

    def gather(self, x: mx.array) -> mx.array:
        """This rank's chunk (B, Lc, ...) -> the whole (B, L, ...), padding trimmed."""
        if not self.active:
            return x
        y = mx.distributed.all_gather(x.swapaxes(0, 1), group=self.group)  # (N * Lc, B, ...)
        return y.swapaxes(0, 1)[:, : self.length]


_CLASSES: dict[tuple[type, str], type] = {}


def _rewrap(module: nn.Module, kind: str, make: Callable[[type], dict[str, Any]]) -> None:
    """Give `module` a subclass of its class (cached) with the methods `make` returns."""
    cls = type(module)
    key = (cls, kind)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{kind}{cls.__name__}", (cls,), make(cls))
    module.__class__ = _CLASSES[key]


def gather_input(module: nn.Module, ctx: SequenceContext, query_chunks: bool = False) -> None:
    """`module(x, ...)` receives the whole sequence: its chunks are gathered first.

    `query_chunks` (attention): while sequence parallelism is active, the module's
    `query_chunk` is the chunk size for the call, so that it attends one sequence
    chunk of queries at a time (the (L, L) scores become (L / N, L)).
    """
    object.__setattr__(module, "_sequence", ctx)

    def make(base: type) -> dict[str, Any]:
        def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
            ctx = self._sequence
            if not (query_chunks and ctx.active):
                return base.__call__(self, ctx.gather(x), *args, **kwargs)
            saved = getattr(self, "query_chunk", None)
            object.__setattr__(self, "query_chunk", ctx.chunk())
            try:
                return base.__call__(self, ctx.gather(x), *args, **kwargs)
            finally:
                object.__setattr__(self, "query_chunk", saved)

        return {"__call__": __call__}

    _rewrap(module, "SequenceChunked" if query_chunks else "SequenceGathered", make)


def scatter_output(module: nn.Module, ctx: SequenceContext, begins: bool = False) -> None:
    """`module(x)`'s whole output (B, L, ...) becomes this rank's chunk.

    `begins`: this module starts the residual stream (the embedding); its input's
    length starts the forward pass. An embedding used as the tied output head
    (`as_linear`) then gathers its input first.
    """
    object.__setattr__(module, "_sequence", ctx)

    def make(base: type) -> dict[str, Any]:
        def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
            if begins:
                self._sequence.begin(x.shape[1])
            return self._sequence.scatter(base.__call__(self, x, *args, **kwargs))

        methods: dict[str, Any] = {"__call__": __call__}
        if begins and hasattr(base, "as_linear"):

            def as_linear(self, x: mx.array) -> mx.array:
                return base.as_linear(self, self._sequence.gather(x))

            methods["as_linear"] = as_linear
        return methods

    _rewrap(module, "SequenceBegin" if begins else "SequenceScattered", make)
