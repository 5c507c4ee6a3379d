"""Which GGUF type llama.cpp's quantizer gives each tensor of a quantization mix, for
planning a GGUF from a `config.json` before it exists (`plan --gguf-quant Q4_K_M`).

llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp) for the K-quant mixes: a
default type (Q4_K for Q4_K_M, Q5_K for Q5_K_M), the output head Q6_K (the embedding
too when tied), `attn_v` Q6_K in the layers `use_more_bits` picks (Q8_0 with 8 experts),
every `ffn_down` (dense, experts and shared experts) Q6_K in those layers, `attn_k` Q8_0
and `attn_output` Q5_K with 8 experts; then a type whose 256-value blocks do not fit
the rows falls back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; F16 if 32 does not fit
either). Norms, biases and the router (`ffn_gate_inp`) are not quantized: float32.
Names are the model's (`layers.N.attention.wv`, ...), matched to llama.cpp's categories.
"""

from __future__ import annotations

import re

from .gguf_quants import GROUP, mlx_bits

MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighths, and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(path: str, cols: int, mix: str, n_layers: int, n_experts: int, tied: bool) -> str:
    """The GGUF type of the module `path` (its weight's rows of `cols` values) in `mix`."""
    base = MIXES[mix]
    m = re.match(r"^layers\.(\d+)\.", path)
    layer = int(m.group(1)) if m else 0
    if path == "output" or (tied and path == "tok_embeddings"):
        kind = "Q6_K" if cols % 256 == 0 else "Q8_0"
    elif path.endswith("attention.wv"):
        kind = "Q6_K" if _more_bits(layer, n_layers) else base
        kind = "Q8_0" if n_experts == 8 else kind
    elif path.endswith("attention.wk") and n_experts == 8:
        kind = "Q8_0"
    elif path.endswith("attention.wo") and n_experts == 8:
        kind = "Q5_K"
    elif path.endswith(("feed_forward.w2", "switch_mlp.down_proj", "shared_expert.w2")):
        kind = "Q6_K" if _more_bits(layer, n_layers) else base
    else:
        kind = base
    if cols % 256 and kind in _FALLBACK:
        kind = _FALLBACK[kind]
    return kind if cols % 32 == 0 else "F16"


def quantized_by(path: str) -> bool:
    """Whether llama.cpp quantizes the module `path` at all (not the routers)."""
    return not path.endswith(("router", "shared_expert_gate"))


def held_bits(kind: str) -> int | None:
    """MLX bits the loader holds a `kind` tensor in (groups of `GROUP`; None: float)."""
    return mlx_bits(kind)


__all__ = ["GROUP", "MIXES", "held_bits", "quantized_by", "tensor_type"]
