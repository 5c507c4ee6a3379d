"""The layer kinds and the families built of them (see `registry.py`).

The package straddles `llama_tp.model`: the modules the model is made of (the core
kinds `attention.py` and `feed_forward.py`, `blocks.py`, `caches.py`, `masks.py`) are
below it, the families (which build or extend the model) above. So importing the
package imports none of them; the names below come from their modules on first use.
"""

from __future__ import annotations

import importlib

_NAMES = {
    "GGUF_ARCHITECTURES": "registry",
    "MODEL_TYPES": "registry",
    "build": "registry",
    "MoEFeedForward": "moe",
    "expert_load": "moe",
    "record_expert_load": "moe",
    "QKNormAttention": "qk_norm",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
