"""A model's modules by path, and the one walk that puts other modules in their place.

Sharding swaps a linear layer for its all-to-sharded or sharded-to-all twin
(`parallelize`, the generic path's styles), `--dtype` a quantized layer for its float
twin (`cast.py`), the loader a GGUF tensor's layer for the native kernels' block layer
(`checkpoints/build.py`), `convert` a quantized layer for a float one: each goes through
`swap_modules` (every module, by path) or `replace_at` (one path). Paths are mlx's
(`named_modules`): dot-separated attribute names and list indices, "" the model itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.nn as nn


def module_at(model: nn.Module, path: str) -> Any:
    """What `model` holds at `path` ("layers.3.attention"; "": the model): a module, or a
    list or dict of them."""
    obj: Any = model
    for part in path.split(".") if path != "" else ():
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    return obj


def replace_at(model: nn.Module, path: str, new: Any) -> None:
    """Put `new` where `model` holds `path` (not ""): an attribute of a module, an item of
    a list or dict."""
    parent_path, _, name = path.rpartition(".")
    parent = module_at(model, parent_path)
    if isinstance(parent, list):
        parent[int(name)] = new
    elif isinstance(parent, nn.Module):
        setattr(parent, name, new)
    else:
        parent[name] = new


def swap_modules(model: nn.Module, swap: Callable[[str, nn.Module], nn.Module | None]) -> int:
    """Put `swap(path, module)` in the place of every module of `model` (the model itself
    aside) for which it returns one, in place, parents before their children (the
    children of a module replaced are not visited); returns how many were replaced. The
    modules are listed before the first swap: a swap may free its module's arrays."""
    replaced: set[str] = set()
    for path, module in model.named_modules():
        parts = path.split(".")
        if not path or any(".".join(parts[:i]) in replaced for i in range(1, len(parts))):
            continue
        new = swap(path, module)
        if new is not None and new is not module:
            replace_at(model, path, new)
            replaced.add(path)
    return len(replaced)
