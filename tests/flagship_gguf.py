"""Flagship families' tiny folders as llama.cpp's converter writes their GGUF files.

Each writer takes mlx-lm's float32 folder (flagship_fixtures.py) and writes the file
convert_hf_to_gguf.py would: llama.cpp's tensor names and metadata keys, float32, or
with `quantized` (a ggml type) every projection whose rows take its blocks (gguf-py's
quantization; `stored` False: the same values dequantized, as float32). The writers sit
by kind: flagship_gguf_linear.py (Kimi-Linear, Kimi K3, Nemotron-H), flagship_gguf_moe.py
(MiniMax-M2, GLM-5 / DeepSeek-V3.2, Llama 4, Step-3.5), flagship_gguf_gemma.py.
"""

from __future__ import annotations

from flagship_gguf_gemma import gemma4_vocabulary, gguf_gemma3, gguf_gemma4
from flagship_gguf_linear import gguf_k3, gguf_kimi, gguf_nemotron
from flagship_gguf_moe import gguf_llama4, gguf_minimax, gguf_sparse, gguf_step

__all__ = ["GGUF", "gguf_gemma3", "gguf_gemma4", "gguf_k3", "gguf_kimi", "gguf_nemotron"]
__all__ += ["gemma4_vocabulary", "gguf_llama4", "gguf_minimax", "gguf_sparse", "gguf_step"]

GGUF = {
    "kimi_linear": lambda src, out: gguf_kimi(src, out),
    "minimax": lambda src, out: gguf_minimax(src, out),
}
GGUF |= {"nemotron_h": lambda src, out: gguf_nemotron(src, out)}
GGUF |= {"nemotron_g1": lambda src, out: gguf_nemotron(src, out)}
GGUF |= {"glm5": lambda src, out: gguf_sparse(src, out)}
GGUF |= {"llama4": lambda src, out: gguf_llama4(src, out)}
GGUF |= {"step3p5": lambda src, out: gguf_step(src, out)}
GGUF |= {"gemma4": lambda src, out: gguf_gemma4(src, out)}
GGUF |= {"kimi_k3": lambda src, out: gguf_k3(src, out)}
