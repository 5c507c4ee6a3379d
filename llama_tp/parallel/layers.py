"""Tensor-parallel linear layers that keep an explicit [start, stop) range.

Like mlx's `AllToShardedLinear` / `ShardedToAllLinear` (and their quantized
versions) in `mlx.nn.layers.distributed`, but a rank keeps the rows or columns
`start:stop` of the plan instead of an equal 1/N block, so N need not divide
the split dimension.

Slices are lazy: nothing is evaluated here. `mx.contiguous` (lazy too, and
what mlx's own sharding uses) makes the evaluated slice its own buffer; a
plain slice would be a view keeping the whole unsharded tensor alive.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
from mlx.nn.layers.distributed import sum_gradients

from ..cluster.distributed import world
from ..kernels import gguf_matmul, quantized_matmul
from ..kernels.blocks import block_span
from ..kernels.layers import GGUFLinear

_SHARDINGS = ("all-to-sharded", "sharded-to-all")


def _slice(a: mx.array, start: int, stop: int, axis: int) -> mx.array:
    """a[..., start:stop, ...] along `axis`, as its own buffer once evaluated."""
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop)
    return mx.contiguous(a[tuple(index)])


class _RangeLinear(nn.Module):
    """Common state: the full layer's dims, the kept range and the group.

    `params` are the already sliced arrays (weight, optional bias, and for
    quantized layers scales and biases).
    """

    _rows = True  # all-to-sharded keeps rows, sharded-to-all keeps input columns

    def __init__(
        self,
        params: dict[str, mx.array],
        input_dims: int,
        output_dims: int,
        start: int,
        stop: int,
        group: mx.distributed.Group | None = None,
    ):
        super().__init__()
        size = output_dims if self._rows else input_dims
        if not 0 <= start < stop <= size:
            what = "output row" if self._rows else "input column"
            raise ValueError(f"bad {what} range [{start}, {stop}) for size {size}")
        self.group = group or world()
        self.input_dims, self.output_dims = input_dims, output_dims
        self.start, self.stop = start, stop
        for name, value in params.items():
            setattr(self, name, value)  # arrays become parameters

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        start: int,
        stop: int,
        *,
        group: mx.distributed.Group | None = None,
    ) -> _RangeLinear:
        """The layer keeping `linear`'s rows (all-to-sharded) or input columns
        (sharded-to-all) start:stop; the slicing is the subclass's `_params`."""
        out_dims, in_dims = linear.weight.shape
        return cls(cls._params(linear, start, stop), in_dims, out_dims, start, stop, group)

    def _extra_repr(self) -> str:
        kept = "rows" if self._rows else "columns"
        return (
            f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
            f"{kept}=[{self.start}, {self.stop}), bias={'bias' in self}"
        )


class RangeAllToShardedLinear(_RangeLinear):
    """Output rows start:stop: x (..., in) -> (..., stop - start).

    No communication in the forward pass; as in mlx's `AllToShardedLinear`,
    gradients of x are summed over the group in the backward pass.
    """

    def __call__(self, x: mx.array) -> mx.array:
        x = sum_gradients(self.group)(x)
        if "bias" in self:
            return mx.addmm(self["bias"], x, self["weight"].T)
        return x @ self["weight"].T

    @staticmethod
    def _params(linear: nn.Linear, start: int, stop: int) -> dict[str, mx.array]:
        return {k: _slice(linear[k], start, stop, 0) for k in ("weight", "bias") if k in linear}


class RangeShardedToAllLinear(_RangeLinear):
    """Input columns start:stop, summed over the group:
    x (..., stop - start) -> (..., out), the same on every rank."""

    _rows = False

    def __call__(self, x: mx.array) -> mx.array:
        x = mx.distributed.all_sum(x @ self["weight"].T, group=self.group)
        if "bias" in self:
            x = x + self["bias"]  # once, after the sum: every rank holds it whole
        return x

    @staticmethod
    def _params(linear: nn.Linear, start: int, stop: int) -> dict[str, mx.array]:
        params = {"weight": _slice(linear.weight, start, stop, 1)}
        if "bias" in linear:
            params["bias"] = linear.bias
        return params


class _QuantizedRangeLinear(_RangeLinear):
    """Affine-quantized state as in `nn.QuantizedLinear`: packed uint32 weight
    (out, in * bits / 32), scales and biases (out, in / group_size); frozen."""

    def __init__(
        self,
        params: dict[str, mx.array],
        input_dims: int,
        output_dims: int,
        start: int,
        stop: int,
        group_size: int,
        bits: int,
        group: mx.distributed.Group | None = None,
    ):
        super().__init__(params, input_dims, output_dims, start, stop, group)
        self.group_size, self.bits, self.mode = group_size, bits, "affine"
        self.freeze()

    def unfreeze(self, *args, **kwargs):
        """Unfreeze submodules only; the quantized parameters stay frozen."""
        super().unfreeze(*args, **kwargs)
        self.freeze(recurse=False)

    def _extra_repr(self) -> str:
        return f"{super()._extra_repr()}, group_size={self.group_size}, bits={self.bits}"

    def _matmul(self, x: mx.array) -> mx.array:
        return quantized_matmul(
            x,
            self["weight"],
            scales=self["scales"],
            biases=self["biases"],
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )

    @classmethod
    def from_quantized_linear(
        cls,
        q: nn.QuantizedLinear,
        start: int,
        stop: int,
        *,
        group: mx.distributed.Group | None = None,
    ) -> _QuantizedRangeLinear:
        """The layer keeping `q`'s rows or input columns start:stop (logical units)."""
        out_dims, in_dims, gs, bits = cls._config(q)
        params = cls._params(q, start, stop)
        return cls(params, in_dims, out_dims, start, stop, gs, bits, group)

    @staticmethod
    def _config(q: nn.QuantizedLinear) -> tuple[int, int, int, int]:
        """(output_dims, logical input_dims, group_size, bits) of a QuantizedLinear."""
        mode = getattr(q, "mode", "affine")
        if mode != "affine":
            raise ValueError(f"only affine quantization is supported, got mode {mode!r}")
        out_dims, packed = q.weight.shape
        return out_dims, packed * 32 // q.bits, q.group_size, q.bits


class QuantizedRangeAllToShardedLinear(_QuantizedRangeLinear):
    """Output rows start:stop of a quantized linear: x (..., in) -> (..., stop - start).

    Quantization groups run along the input, so a row slice is exact.
    """

    def __call__(self, x: mx.array) -> mx.array:
        x = self._matmul(sum_gradients(self.group)(x))
        if "bias" in self:
            x = x + self["bias"]
        return x

    @staticmethod
    def _params(q: nn.QuantizedLinear, start: int, stop: int) -> dict[str, mx.array]:
        names = ("weight", "scales", "biases", "bias")
        return {k: _slice(q[k], start, stop, 0) for k in names if k in q}


class QuantizedRangeShardedToAllLinear(_QuantizedRangeLinear):
    """Input columns start:stop (multiples of group_size) of a quantized linear,
    summed over the group: x (..., stop - start) -> (..., out)."""

    _rows = False

    def __call__(self, x: mx.array) -> mx.array:
        x = mx.distributed.all_sum(self._matmul(x), group=self.group)
        if "bias" in self:
            x = x + self["bias"]  # once, after the sum
        return x

    @staticmethod
    def _params(q: nn.QuantizedLinear, start: int, stop: int) -> dict[str, mx.array]:
        gs, bits = q.group_size, q.bits
        # Scales/biases have one column per group, so the split must be on group
        # boundaries; packed words must not straddle it either.
        if start % gs or stop % gs or (start * bits) % 32 or (stop * bits) % 32:
            raise ValueError(
                f"quantized input column range [{start}, {stop}) is not on "
                f"group_size {gs} boundaries ({bits} bits)"
            )
        params = {
            "weight": _slice(q.weight, start * bits // 32, stop * bits // 32, 1),
            "scales": _slice(q.scales, start // gs, stop // gs, 1),
            "biases": _slice(q.biases, start // gs, stop // gs, 1),
        }
        if "bias" in q:
            params["bias"] = q.bias
        return params


class _BlockRangeLinear(_RangeLinear):
    """GGUF blocks as stored (`kernels.layers.GGUFLinear`): weight uint8 (rows, blocks *
    bytes), `lead` values of the first block before the kept columns; frozen."""

    def __init__(
        self,
        params: dict[str, mx.array],
        input_dims: int,
        output_dims: int,
        start: int,
        stop: int,
        type_name: str,
        lead: int,
        group: mx.distributed.Group | None = None,
    ):
        super().__init__(params, input_dims, output_dims, start, stop, group)
        self.type_name, self.lead = type_name, lead
        self.freeze()

    def _extra_repr(self) -> str:
        return f"{super()._extra_repr()}, type={self.type_name}"

    def _matmul(self, x: mx.array) -> mx.array:
        return gguf_matmul(x, self["weight"], self.type_name, self.lead)

    @classmethod
    def from_blocks(
        cls, q: GGUFLinear, start: int, stop: int, *, group: mx.distributed.Group | None = None
    ) -> _BlockRangeLinear:
        params, lead = cls._params(q, start, stop)
        return cls(params, q.input_dims, q.output_dims, start, stop, q.type_name, lead, group)


class BlockRangeAllToShardedLinear(_BlockRangeLinear):
    """Output rows start:stop of a GGUF-block linear (whole blocks: they lie in rows)."""

    def __call__(self, x: mx.array) -> mx.array:
        x = self._matmul(sum_gradients(self.group)(x))
        return x + self["bias"] if "bias" in self else x

    @staticmethod
    def _params(q: GGUFLinear, start: int, stop: int) -> tuple[dict[str, mx.array], int]:
        return {k: _slice(q[k], start, stop, 0) for k in ("weight", "bias") if k in q}, q.lead


class BlockRangeShardedToAllLinear(_BlockRangeLinear):
    """Input columns start:stop of a GGUF-block linear, summed over the group. The rank
    keeps the blocks covering its columns: a block a boundary falls in is held by both
    neighbours, each multiplying only its own columns (x enters at `lead`, the rest of
    the block meets zeros), so any split is exact."""

    _rows = False

    def __call__(self, x: mx.array) -> mx.array:
        x = mx.distributed.all_sum(self._matmul(x), group=self.group)
        return x + self["bias"] if "bias" in self else x

    @staticmethod
    def _params(q: GGUFLinear, start: int, stop: int) -> tuple[dict[str, mx.array], int]:
        a, b, lead = block_span(q.lead + start, q.lead + stop, q.type_name)
        params = {"weight": _slice(q.weight, a, b, 1)}
        if "bias" in q:
            params["bias"] = q.bias
        return params, lead


def shard_linear_range(
    module: nn.Module,
    sharding: str,
    start: int,
    stop: int,
    group: mx.distributed.Group | None = None,
) -> nn.Module:
    """Shard a `nn.Linear`, affine `nn.QuantizedLinear` or GGUF-block
    `kernels.layers.GGUFLinear` to output rows ("all-to-sharded") or input columns
    ("sharded-to-all") start:stop, in logical (unpacked) units. Returns a new layer;
    `module` is unchanged.
    """
    if sharding not in _SHARDINGS:
        raise ValueError(f"sharding must be one of {_SHARDINGS}, got {sharding!r}")
    rows = sharding == "all-to-sharded"
    if isinstance(module, GGUFLinear):
        cls = BlockRangeAllToShardedLinear if rows else BlockRangeShardedToAllLinear
        return cls.from_blocks(module, start, stop, group=group)
    if isinstance(module, nn.QuantizedLinear):
        cls = QuantizedRangeAllToShardedLinear if rows else QuantizedRangeShardedToAllLinear
        return cls.from_quantized_linear(module, start, stop, group=group)
    if isinstance(module, nn.Linear):
        cls = RangeAllToShardedLinear if rows else RangeShardedToAllLinear
        return cls.from_linear(module, start, stop, group=group)
    raise TypeError(
        f"cannot shard {type(module).__name__}: expected nn.Linear, nn.QuantizedLinear "
        "or GGUFLinear"
    )
