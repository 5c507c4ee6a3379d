"""Vocabulary-parallel embedding and output head.

Each rank keeps the rows [start, stop) of the vocabulary:
- the embedding looks up the ids in its range (zeros elsewhere) and one
  all-reduce completes every vector;
- as a head (`as_linear`, tied or not) it computes the logits of its range only,
  (..., stop - start); `sampling.VocabShard` turns those into tokens and
  log-probabilities without gathering them.
Plain, affine-quantized (GGUF converted, MLX 4/8-bit) and GGUF-block tables (the native
kernels' `GGUFEmbedding`) alike.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kernels import gguf_dequantize, gguf_matmul, quantized_matmul
from ..kernels.layers import GGUFEmbedding


def _rows(a: mx.array, start: int, stop: int) -> mx.array:
    # contiguous: a plain slice would keep the whole table alive once evaluated
    return mx.contiguous(a[start:stop])


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of a (vocab_size, dim) embedding table (plain or quantized);
    `ranges`: every rank's (start, stop), by rank."""

    def __init__(
        self,
        table: nn.Module,
        start: int,
        stop: int,
        group: mx.distributed.Group,
        ranges: tuple[tuple[int, int], ...] | None = None,
    ):
        super().__init__()
        self.start, self.stop, self.group = start, stop, group
        # every rank's rows, by rank (None: not known here; the samplers ask the group)
        object.__setattr__(self, "ranges", ranges)
        self.vocab_size = table.weight.shape[0]
        self.weight = _rows(table.weight, start, stop)
        self.quantized = isinstance(table, nn.QuantizedEmbedding)
        self.type_name = getattr(table, "type_name", None)  # GGUF blocks as stored
        if isinstance(table, GGUFEmbedding):
            self.dims, self.dtype = table.dims, table.dtype
            self.freeze()
        if self.quantized:
            self.scales = _rows(table.scales, start, stop)
            self.biases = _rows(table.biases, start, stop)
            self.group_size, self.bits, self.mode = table.group_size, table.bits, table.mode
            self.freeze()

    def local_rows(self, ids: mx.array) -> mx.array:
        """Rows of local ids (0 <= ids < stop - start): (..., dim)."""
        if self.type_name is not None:
            return gguf_dequantize(self.weight[ids], self.type_name, 0, self.dims, self.dtype)
        if not self.quantized:
            return self.weight[ids]
        return mx.dequantize(
            self.weight[ids],
            self.scales[ids],
            self.biases[ids],
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )

    def __call__(self, ids: mx.array) -> mx.array:
        """ids (B, L) -> embeddings (B, L, dim), identical on every rank."""
        local = ids - self.start
        mine = (local >= 0) & (local < self.stop - self.start)
        rows = self.local_rows(mx.where(mine, local, 0))
        return mx.distributed.all_sum(rows * mine[..., None].astype(rows.dtype), group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        """x (..., dim) -> this rank's logits (..., stop - start)."""
        if self.type_name is not None:
            return gguf_matmul(x, self.weight, self.type_name)
        if not self.quantized:
            return x @ self.weight.T
        return quantized_matmul(
            x,
            self.weight,
            self.scales,
            self.biases,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
