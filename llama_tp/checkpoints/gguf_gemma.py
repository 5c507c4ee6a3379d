"""Gemma 3's and Gemma 4's GGUF files (`gemma3`, `gemma4`: llama.cpp's converter's
layout) as the model holds them, each tensor still read in slices. Gemma 3: every norm
as stored less 1 (the converter adds the 1 of Gemma 3's 1 + w norms). Gemma 4:

    ffn_gate_up_exps  (E, 2 I, dim) -> experts.switch_mlp.gate_proj / up_proj (E, I, dim):
                      each expert's first / second I rows (`GGUFFile.read_piece`)
    rope_freqs        (global head_dim / 2): 1 for the rotated pairs, 1e30 for the others
                      -> the global layers' partial ("proportional") RoPE factor; the
                      vector itself is not held
    attn_k / attn_v / attn_k_norm of the KV-shared layers: never used (mlx-lm drops them)

and what the metadata cannot say, from the tensors: keys = values in the global layers
(no attn_v there; their KV heads are then head_count_kv's global entries). The names,
the metadata and the fields: `models/gemma.py` (`gemma4_gguf_fields`, `GemmaBlock`'s
`gguf_names`)."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from .gated_delta import Mapped

ARCHITECTURES = ("gemma3", "gemma4")
_GATE_UP = ".experts.switch_mlp.gate_up_proj."


class _Piece:
    """Piece j of k of each expert's rows of a stacked GGUF tensor, read as its own
    (E, R, C) tensor in slices (`GGUFFile.read_piece`)."""

    def __init__(self, file: Any, j: int, k: int):
        self.file, self.piece = file, (j, k)
        self.path = file.path

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        return self.file.read_piece(name, self.piece, axis, start, stop)


def gemma_gguf(weights: dict, sources: dict, args: Any, kv: list[int], path: str) -> None:
    """In place: the tensors as above; `args`' keys = values and global RoPE from the
    tensors (`kv`: the metadata's KV heads per layer). Gemma 3: every norm less the 1
    the converter added (the model's norms scale by 1 + w, as mlx-lm's)."""
    if args.gemma == 3:
        for name in [k for k in weights if k.endswith("norm.weight") and k in sources]:
            file, stored = sources[name]
            shape = tuple(weights[name].shape)
            sources[name] = (Mapped(file, stored, shape, lambda x: x - 1.0), stored)
        return
    for name in [k for k in weights if _GATE_UP in k]:
        file, stored = sources.pop(name)
        v = weights.pop(name)
        shape = (v.shape[0], v.shape[1] // 2, v.shape[2])
        for j, proj in enumerate(("gate_proj", "up_proj")):
            new = name.replace("gate_up_proj", proj)
            weights[new] = mx.zeros(shape, v.dtype)  # a placeholder: the source reads it
            sources[new] = (_Piece(file, j, 2), stored)
    shared = [i for i, s in enumerate(args.kv_sources) if s is not None]
    unused = tuple(f"layers.{i}.attention.{p}." for i in shared for p in ("wk", "wv", "k_norm"))
    for name in [k for k in weights if k.startswith(unused)] if unused else ():
        del weights[name]
        sources.pop(name, None)
    full = [
        i
        for i, kind in enumerate(args.layer_types)
        if kind == "full_attention" and args.kv_sources[i] is None
    ]
    x = args.extra
    if full:
        x["k_eq_v"] = f"layers.{full[0]}.attention.wv.weight" not in weights
        x["global_kv_heads"] = kv[full[0]] if x["k_eq_v"] else 0
        if not x["k_eq_v"] and kv[full[0]] != args.n_kv_heads:
            raise ValueError(
                f"{path}: the global layers have {kv[full[0]]} KV heads of their own values "
                f"(attn_v), the sliding ones {args.n_kv_heads}: mlx-lm's Gemma 4 has no such layer"
            )
    if "rope_freqs.weight" in sources:
        file, stored = sources["rope_freqs.weight"]
        t = file.gguf[stored]
        if t.type_name != "F32":
            raise ValueError(f"{path}: rope_freqs is {t.type_name}, not F32")
        # read as the header is (metadata, not a weight held: not counted in READ)
        freqs = np.fromfile(file.path, np.float32, math.prod(t.shape), offset=t.offset)
        rotated = int((freqs < 1e10).sum())
        theta, params = x["rope"]["full_attention"]
        factor = 2 * rotated / x["global_head_dim"]
        x["rope"]["full_attention"] = (theta, dict(params, partial_rotary_factor=factor))
