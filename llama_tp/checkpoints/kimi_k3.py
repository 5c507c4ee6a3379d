"""Kimi K3's release layout in the readers: what mlx-lm's `kimi_k3` sanitize does to it,
done by sources that read any slice (so a rank reads only its bytes).

    q_proj, k_proj, v_proj of a KDA layer      -> qkv_proj (q | k | v rows, `Joined`)
    q_conv1d, k_conv1d, v_conv1d (C, 1, K)     -> qkv_conv.conv (the convs turned by
                                                  `kda_tensors`, then joined)
    A_log stored longer than the heads         -> its first `num_heads` values
    layers after num_hidden_layers              -> left out (the prediction layers)
    experts.N.wK.weight_packed (rows, cols / 2)  -> experts.N.wK.weight (rows, cols / 8)
      uint8, weight_scale (rows, cols / 32) uint8     uint32, .scales: MLX's `mxfp4` mode,
                                                     the same bytes (`Packed`)

The per-expert `block_sparse_moe.experts.N.w1/w2/w3` are stacked as every release's
(`experts.py`); the `*_res.proj_weight` / `*_res.norm_weight` names and the
`block_sparse_moe` names are the kinds' own (`models/kimi_k3.py`,
`models/latent_experts.py`); `kv_b_proj` is split as DeepSeek-V3's (`latent.py`).

The release's routed experts are compressed-tensors' `mxfp4-pack-quantized`: 4-bit E2M1
values, element 2i in the low nibble of byte i, one E8M0 exponent per 32 values, which is
MLX's `mxfp4` layout byte for byte (mlx-lm's sanitize only views the bytes as uint32):
held as stored, never dequantized, a rank reading only its experts' (or its rows',
whole groups of its columns') bytes.

llama.cpp's `kimi-k3` GGUF (`k3_gguf`) is Kimi-Linear's layout (`gated_delta.kda_gguf`
turns its convs and ssm_a back) with the release's q/k/v apart, joined here the same
way; its fused residual queries are held as they are (`*_res_score`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .base import CheckpointError
from .gated_delta import say_once


@dataclass(frozen=True)
class _Info:
    shape: tuple[int, ...]


class Joined:
    """Tensors stored apart, read as their concatenation along axis 0: a slice of rows
    reads only the parts it covers; a slice along another axis, that slice of each."""

    def __init__(self, parts: list[tuple[Any, str]]):
        self.parts = [(f, s, tuple(f.tensors[s].shape)) for f, s in parts]
        self.stored = parts[0][1]
        self.path = getattr(parts[0][0], "path", None)
        rows = sum(shape[0] for _, _, shape in self.parts)
        self.tensors = {self.stored: _Info((rows, *self.parts[0][2][1:]))}

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        if axis not in (None, 0):
            return mx.concatenate([f.read(s, axis, start, stop) for f, s, _ in self.parts])
        if axis is None:
            start, stop = 0, self.tensors[self.stored].shape[0]
        out, at = [], 0
        for f, s, shape in self.parts:
            a, b = max(start, at) - at, min(stop, at + shape[0]) - at
            if a < b:
                out.append(f.read(s) if (a, b) == (0, shape[0]) else f.read(s, 0, a, b))
            at += shape[0]
        return out[0] if len(out) == 1 else mx.concatenate(out)


class Leading:
    """The first `n` values of a 1-D stored tensor (a release's A_log, longer than the
    heads)."""

    def __init__(self, file: Any, stored: str, n: int):
        self.file, self.stored = file, stored
        self.path = getattr(file, "path", None)
        self.tensors = {stored: _Info((n,))}

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        if axis is None:
            start, stop = 0, self.tensors[self.stored].shape[0]
        return self.file.read(self.stored, 0, start, stop)


class Packed:
    """A release's packed expert weight, (rows, cols / 2) uint8, read as MLX's mxfp4 weight
    (rows, cols / 8) uint32: the same bytes, a column slice of 4 bytes per uint32."""

    def __init__(self, file: Any, stored: str):
        self.file, self.stored = file, stored
        self.path = getattr(file, "path", None)
        rows, half = file.tensors[stored].shape
        self.tensors = {stored: _Info((rows, half // 4))}

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        if axis == 1:
            start, stop = 4 * start, 4 * stop
        if axis is None:
            return self.file.read(self.stored).view(mx.uint32)
        return self.file.read(self.stored, axis, start, stop).view(mx.uint32)


# a release's per-expert packed MXFP4 tensors (compressed-tensors' mxfp4-pack-quantized)
_PACKED = re.compile(r"^(.*\.block_sparse_moe\.experts\.\d+\.w[123])\.weight_(packed|scale)$")


def packed_expert(name: str, file: Any, stored: str, value: mx.array) -> tuple[str, Any, mx.array]:
    """A release's `experts.N.wK.weight_packed` / `weight_scale` (`stored` in `file`)
    as MLX's mxfp4 `experts.N.wK.weight` (a `Packed` source) / `.scales`; other tensors
    as they are. Anything but uint8 bytes whose values fill whole uint32s is refused."""
    m = _PACKED.match(name)
    if m is None:
        return name, file, value
    shape, packed = list(file.tensors[stored].shape), m.group(2) == "packed"
    dtypes = (mx.uint8, mx.int8) if packed else (mx.uint8,)  # E8M0 scales load as uint8
    if value.dtype not in dtypes or len(shape) != 2 or (packed and shape[1] % 4):
        dtype = str(value.dtype).removeprefix("mlx.core.")
        raise CheckpointError(
            f"{getattr(file, 'path', '')}: {stored}: {dtype} {shape}: only "
            "compressed-tensors' mxfp4-pack-quantized experts are read (uint8, 2 values a byte)"
        )
    if not packed:
        return f"{m.group(1)}.scales", file, value
    return f"{m.group(1)}.weight", Packed(file, stored), value.view(mx.uint32)  # same bytes


_LAYER = re.compile(r"^layers\.(\d+)\.")
_PARTS = ("weight", "scales", "biases")


def k3_release(weights: dict, sources: dict, args: Any, where: str) -> None:
    """A Kimi K3 release's tensors as the model holds them, in place (see the module
    docstring); mlx-lm's folders pass through unchanged."""
    extra = [k for k in weights if (m := _LAYER.match(k)) and int(m.group(1)) >= args.n_layers]
    for name in extra:
        del weights[name]
        sources.pop(name, None)
    if extra:
        say_once(where, "its layers after num_hidden_layers (prediction layers) are not used")
    for i in args.kda_layers:
        p = f"layers.{i}.attention."
        joins = {f"qkv_proj.{x}": [f"w{c}.{x}" for c in "qkv"] for x in _PARTS}
        joins["qkv_conv.conv.weight"] = [f"{c}_conv.conv.weight" for c in "qkv"]
        for new, parts in joins.items():
            parts = [p + x for x in parts]
            if p + new in weights or not all(x in weights for x in parts):
                continue
            joined = Joined([sources.pop(x) for x in parts])
            sources[p + new] = (joined, joined.stored)
            weights[p + new] = mx.concatenate([weights.pop(x) for x in parts])
        a, h = p + "A_log", args.kda_heads
        if a in weights and weights[a].shape[0] > h:
            file, stored = sources[a]
            weights[a], sources[a] = weights[a][:h], (Leading(file, stored, h), stored)


def k3_gguf(weights: dict, sources: dict, args: Any, where: str) -> None:
    """A `kimi-k3` GGUF's tensors as the model holds them, in place, after `kda_gguf`:
    the KDA layers' attn_q/k/v and convs joined (as the release's); the latent
    attention's output gate, the latent width and its norm as the tensors say (llama.cpp
    reads attn_gate, expert_latent_length and ffn_routed_norm when present)."""
    kda, extra = set(args.kda_layers), args.extra
    extra["mla_output_gate"] = any(
        (m := _LAYER.match(k))
        and int(m.group(1)) not in kda
        and k.endswith("attention.g_proj.weight")
        for k in weights
    )
    down = [v for k, v in weights.items() if k.endswith("routed_expert_down_proj.weight")]
    if down and not extra["routed_expert_hidden_size"]:
        extra["routed_expert_hidden_size"] = down[0].shape[0]
    extra["latent_moe_norm"] = any(k.endswith("routed_expert_norm.weight") for k in weights)
    k3_release(weights, sources, args, where)
