"""The other model families, as small variations of the Llama core (see `registry.py`)."""

from .moe import MoEFeedForward, expert_load, record_expert_load
from .qk_norm import QKNormAttention
from .registry import GGUF_ARCHITECTURES, MODEL_TYPES, build

__all__ = [
    "GGUF_ARCHITECTURES",
    "MODEL_TYPES",
    "MoEFeedForward",
    "QKNormAttention",
    "build",
    "expert_load",
    "record_expert_load",
]
