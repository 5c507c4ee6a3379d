"""llama_tp: tensor-parallel inference for Llama-family models on MLX.

from llama_tp import Chat, load
model, tokenizer = load("model.gguf")   # sharded when run under mlx.launch
chat = Chat(model, tokenizer)           # multi-turn chat; see llama_tp.chat
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Chat", "load", "load_model"]


def __getattr__(name: str):
    # Imported on first use: `llama_tp.plan` and the command-line tools start
    # without paying for mlx-lm and transformers until they need them.
    if name in ("load", "load_model"):
        from . import loader

        return getattr(loader, name)
    if name == "Chat":
        from .conversation import Chat

        return Chat
    raise AttributeError(f"module 'llama_tp' has no attribute {name!r}")
