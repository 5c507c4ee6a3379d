"""Which kernels compute a loaded model's products: the native CPU kernels
(`llama_tp.kernels`) on every rank or on none, and the line `--verbose` prints for it.

The loader asks `native_kernels` once per load (collective: every rank of the group
answers), then `products_path` for the description it keeps on the checkpoint.
"""

from __future__ import annotations

import mlx.core as mx

from ..cluster.distributed import all_gather_object, eprint0


def products_path(dtype: str | None, native: bool) -> str:
    """What computes the model's matrix products, for --verbose."""
    from .. import kernels

    if dtype is not None:
        return f"{dtype} weights, MLX's matmul"
    if native:
        return kernels.status().describe()
    if mx.default_device() != mx.cpu:
        return f"MLX's quantized_matmul on {mx.default_device()}"
    if kernels.status().native:  # but not on every rank
        return "MLX's quantized_matmul (the native kernels are off on another rank)"
    return kernels.status().describe()


def kernels_here() -> bool:
    """Whether this process can run the native kernels: on the CPU, extension loaded
    (`native_kernels` asks every rank of a group the same)."""
    from .. import kernels

    return mx.default_device() == mx.cpu and kernels.status().native


def native_kernels(dtype: str | None, group: mx.distributed.Group) -> bool:
    """Whether the native kernels (`llama_tp.kernels`) run: on the CPU, with the extension
    loaded on every rank of `group` (all or none: the ranks hold the same layer kinds).
    Quantized products take them when the weights stay quantized (no `dtype`); RoPE and
    attention take them either way. The one fallback warning, with its reason, goes to
    rank 0's stderr (only where quantized products lose them)."""
    from .. import kernels

    if mx.default_device() != mx.cpu:
        return False
    if dtype is not None and not kernels.status().native:
        return False  # no warning: the products are float ones
    mine = kernels.status()
    here = kernels_here()
    every = all_gather_object(here, group) if group.size() > 1 else [here]
    if all(every):
        kernels.set_threads(kernels.default_threads(group.size()))
        return True
    warning = kernels.fallback_warning()
    if warning is None and mine.native:
        off = [r for r, ok in enumerate(every) if not ok]
        warning = f"warning: native kernels off on rank {off[0]}: MLX's kernel on every rank"
    if warning:
        eprint0(warning, group=group)
    return False
