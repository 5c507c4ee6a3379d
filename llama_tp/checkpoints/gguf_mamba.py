"""Nemotron-H's GGUF files (`nemotron_h`, `nemotron_h_moe`: llama.cpp's converter's
layout) as the model holds them: the Mamba-2 tensors the converter turned, turned back,
each still read in slices (`mamba.Mamba2Mixer.split_table`):

    ssm_conv1d  (C, K)            -> conv1d.weight (C, K, 1), by channels (rows)
    ssm_a       (nh, 1) = -exp(A) -> A_log (nh,), by heads
    ssm_d       (nh, 1)           -> D (nh,), by heads
    ssm_norm    (groups, width)   -> norm.weight (nh hd,), by heads (whole groups; one
                                     group: a (1, width) row's columns)

and what the metadata cannot say, from the tensors: each layer's kind (a "-" layer in a
file with experts has a feed-forward width of 0, as the converter writes it), the dense
feed-forward's width, the biases."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .gated_delta import Flat, Mapped

ARCHITECTURES = ("nemotron_h", "nemotron_h_moe")

# a layer's kind by the tensor only it has
_KINDS = (
    ("M", "mixer.in_proj.weight"),
    ("*", "mixer.wq.weight"),
    ("E", "mixer.switch_mlp.fc1.weight"),
    ("-", "mixer.up_proj.weight"),
)


def mamba_gguf(weights: dict, sources: dict, args: Any) -> None:
    """In place: the Mamba tensors as above; args' pattern, widths and biases from the
    tensors (a layer of no known kind keeps the metadata's)."""
    pattern = list(args.pattern)
    for i in range(len(pattern)):
        found = [c for c, name in _KINDS if f"layers.{i}.{name}" in weights]
        if len(found) == 1:
            pattern[i] = found[0]
    args.extra["pattern"] = "".join(pattern)
    if args.n_experts:
        args.sparse_layers = [i for i, c in enumerate(pattern) if c == "E"]
    dense = next((i for i, c in enumerate(pattern) if c == "-"), None)
    if dense is not None:
        args.hidden_dim = weights[f"layers.{dense}.mixer.up_proj.weight"].shape[0]
    has = lambda suffix: any(k.endswith(suffix) for k in weights)  # noqa: E731
    args.qkv_bias = has("mixer.wq.bias")
    args.o_bias = has("mixer.wo.bias")
    args.mlp_bias = has("mixer.up_proj.bias")
    args.extra["use_conv_bias"] = has("mixer.conv1d.bias") or "M" not in pattern
    args.extra["mamba_proj_bias"] = has("mixer.in_proj.bias")
    for name in list(weights):
        if name not in sources or ".mixer." not in name:
            continue
        file, stored = sources[name]
        v = weights[name]
        if name.endswith("mixer.conv1d.weight") and v.ndim == 2:
            shape = (*v.shape, 1)
            src = Mapped(file, stored, shape, lambda x: x[..., None])
        elif name.endswith(("mixer.A_log", "mixer.D", "mixer.norm.weight")) and v.ndim == 2:
            shape = (v.size,)
            src = Flat(file, stored, tuple(v.shape))
            if name.endswith("A_log"):
                src.post = lambda x: mx.log(-x)
        else:
            continue
        weights[name] = mx.zeros(shape, v.dtype)  # a placeholder: the source reads it
        sources[name] = (src, stored)
