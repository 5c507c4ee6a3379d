"""Gated DeltaNet layers (Qwen3.5 / 3.6, Qwen3-Next) in checkpoints: what the readers do
to their tensors, every one still read in slices.

MLX folders (mlx-lm's `sanitize` already applied) hold the model's tensors as the model
does. The others need a turn each, done by a source that reads any slice of the stored
tensor and gives that slice as the model holds it (so a rank reads only its bytes):

    Hugging Face release   conv1d.weight (C, 1, K)        -> (C, K, 1)
                           RMSNorm weights stored as w - 1 -> w (zero-centred; not the
                           linear attention's own gated norm), as mlx-lm's sanitize does
    GGUF (llama.cpp)       ssm_conv1d (C, K)              -> (C, K, 1)
                           ssm_a = -exp(A_log)            -> A_log
                           qwen35 / qwen35moe with more value heads than key heads: the
                           value heads "tiled" ([k0 v0, k1 v0, ..., k0 v1, ...]) in
                           attn_qkv's value rows, attn_gate, ssm_beta, ssm_alpha, ssm_a,
                           ssm_dt, the conv's value channels and ssm_out's columns ->
                           grouped by key head, as the model holds them (`Untiled`)

and the parts a text model does not use are left out, each named once: the vision tower
of a Qwen3.5 release, its multi-token prediction layers (`mtp.*`; GGUF: the layers after
`block_count - nextn_predict_layers`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

_SAID: set[str] = set()


def say_once(where: str, text: str) -> None:
    """`note: {where}: {text}` on stderr, once per process and text (rank 0 only)."""
    from ..cluster.distributed import is_rank0

    key = f"{where}: {text}"
    if key in _SAID:
        return
    _SAID.add(key)
    if is_rank0():
        print(f"note: {key}", file=sys.stderr, flush=True)


# -- names: a release's language model, its vision tower and prediction layers left out

_TEXT_PREFIXES = [
    (re.compile(r"^language_model\.model\."), "model."),  # mlx-lm / mlx-vlm's VLM folders
    (re.compile(r"^model\.language_model\."), "model."),  # Hugging Face releases
    (re.compile(r"^language_model\."), ""),  # language_model.lm_head
]
_VISION = re.compile(r"^(?:vision_tower|model\.visual|visual|multi_modal_projector|vision_model)\.")
_MTP = re.compile(r"^(?:model\.)?mtp\.")


def text_name(name: str, skipped: set[str]) -> str | None:
    """The language model's name of a stored tensor (`model.layers.3...`); None for a
    vision-tower or multi-token-prediction tensor (its kind added to `skipped`)."""
    if _VISION.match(name):
        skipped.add("vision")
        return None
    if _MTP.match(name):
        skipped.add("mtp")
        return None
    for pattern, repl in _TEXT_PREFIXES:
        new, n = pattern.subn(repl, name)
        if n:
            return new
    return name


SKIPPED = {
    "vision": "the vision tower is not loaded (text generation only)",
    "mtp": "its multi-token prediction layers are not used (skipped)",
}


# -- sources: a stored tensor's slices as the model holds them ---------------------------


@dataclass(frozen=True)
class _Info:
    shape: tuple[int, ...]


class Mapped:
    """A stored tensor read through `fn` (elementwise, or a reshape that keeps axis 0):
    `read` as the sliced readers do, whole or an (axis, start, stop) slice."""

    def __init__(self, file: Any, stored: str, shape: tuple[int, ...], fn: Callable):
        self.file, self.stored, self.fn = file, stored, fn
        self.path = getattr(file, "path", None)
        self.tensors = {stored: _Info(shape)}

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        raw = (
            self.file.read(self.stored)
            if axis is None
            else self.file.read(self.stored, axis, start, stop)
        )
        return self.fn(raw)


class Untiled:
    """A GGUF tensor whose value heads along `axis`, from `offset` (in the stored array's
    units), are tiled (`nk` key heads, `r` value heads each, `width` values a head: value
    head j of key head h at tiled position j * nk + h), read grouped (h * r + j): a
    range of whole key heads' value heads is r runs of the file, one per j."""

    def __init__(self, file: Any, stored: str, shape: tuple[int, ...], axis: int,
                 offset: int, nk: int, r: int, post: Callable | None = None):  # fmt: skip
        self.file, self.stored, self.axis = file, stored, axis
        self.offset, self.nk, self.r, self.post = offset, nk, r, post or (lambda x: x)
        self.path = getattr(file, "path", None)
        self.tensors = {stored: _Info(shape)}
        self.size = shape[axis]

    def _read(self, a: int, b: int) -> mx.array:
        return self.file.read(self.stored, self.axis, a, b)

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        if axis is not None and axis != self.axis:
            raise ValueError(f"{name}: value heads run along axis {self.axis}, not {axis}")
        if axis is None:
            start, stop = 0, self.size
        parts = []
        if start < self.offset:  # the sections before the values (q and k rows)
            parts.append(self._read(start, min(stop, self.offset)))
        if stop > self.offset:
            parts.append(self._grouped(max(start, self.offset) - self.offset, stop - self.offset))
        out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=self.axis)
        return self.post(out)

    def _grouped(self, a: int, b: int) -> mx.array:
        """Grouped positions [a, b) of the value section (whole key heads' values)."""
        nk, r = self.nk, self.r
        per_key = (self.size - self.offset) // nk  # a key head's values, in stored units
        width = per_key // r  # one value head
        if a % per_key or b % per_key:
            raise ValueError(
                f"{self.stored}: [{a}, {b}) is not whole key heads' value heads ({per_key} each)"
            )
        h0, h1 = a // per_key, b // per_key
        runs = [
            self._read(self.offset + (j * nk + h0) * width, self.offset + (j * nk + h1) * width)
            for j in range(r)
        ]  # run j: value head j of key heads h0 .. h1 - 1
        x = mx.stack(runs, axis=self.axis)  # (..., r, (h1 - h0) * width, ...)
        shape = list(x.shape)
        x = x.reshape(*shape[: self.axis], r, h1 - h0, width, *shape[self.axis + 2 :])
        x = mx.swapaxes(x, self.axis, self.axis + 1)  # grouped: key head, then its values
        return mx.contiguous(x.reshape(*shape[: self.axis], -1, *shape[self.axis + 2 :]))


# -- Hugging Face releases ----------------------------------------------------------------

# the norms a Qwen3.5 / Qwen3-Next release stores zero-centred (mlx-lm's sanitize list)
_ZERO_CENTRED = re.compile(
    r"^(?:layers\.\d+\.(?:attention_norm|ffn_norm|attention\.q_norm|attention\.k_norm)|norm)\.weight$"
)


def is_release(weights: dict[str, mx.array]) -> bool:
    """A Hugging Face release (not mlx-lm's sanitized folder): its conv weights are stored
    (C, 1, K), as mlx-lm tells them apart."""
    return any(
        k.endswith("attention.conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items()
    )


def from_release(weights: dict, sources: dict) -> None:
    """A release's tensors as the model holds them, in place (see the module docstring)."""
    for name in list(weights):
        if name not in sources:
            continue
        file, stored = sources[name]
        v = weights[name]
        if name.endswith("attention.conv1d.weight") and v.shape[-1] != 1:
            shape = (v.shape[0], v.shape[2], v.shape[1])
            weights[name] = v.swapaxes(1, 2)
            sources[name] = (Mapped(file, stored, shape, lambda x: x.swapaxes(1, 2)), stored)
        elif _ZERO_CENTRED.match(name) and v.ndim == 1:
            weights[name] = v + 1.0
            sources[name] = (Mapped(file, stored, tuple(v.shape), lambda x: x + 1.0), stored)


# -- GGUF files -----------------------------------------------------------------------------


def _value_tensors(args: Any) -> dict[str, tuple[int, int]]:
    """Model tensor suffix -> (axis of its value heads, offset of their section in values)
    of the tensors a qwen35 file tiles."""
    q_and_k = 2 * args.linear_num_key_heads * args.linear_key_head_dim
    return {
        "attention.in_proj_qkv": (0, q_and_k),
        "attention.conv1d": (0, q_and_k),
        "attention.in_proj_z": (0, 0),
        "attention.in_proj_b": (0, 0),
        "attention.in_proj_a": (0, 0),
        "attention.A_log": (0, 0),
        "attention.dt_bias": (0, 0),
        "attention.out_proj": (1, 0),
    }


def from_gguf(weights: dict, sources: dict, args: Any, tiled: bool) -> None:
    """A GGUF file's linear-attention tensors as the model holds them, in place: the conv
    (C, K) as (C, K, 1), ssm_a as A_log, and with `tiled` the value heads grouped."""
    nk = args.linear_num_key_heads
    r = args.linear_num_value_heads // nk
    sections = _value_tensors(args) if tiled and r > 1 else {}
    for name in list(weights):
        if name not in sources or ".attention." not in name:
            continue
        file, stored = sources[name]
        v = weights[name]
        post, shape = None, tuple(v.shape)
        if name.endswith("attention.conv1d.weight"):
            shape = (*shape, 1)
            post = lambda x: x[..., None]  # noqa: E731
        elif name.endswith("attention.A_log"):
            post = lambda x: mx.log(-x)  # noqa: E731
        module = re.sub(r"^layers\.\d+\.|\.(?:weight|scales|biases)$", "", name)
        if module in sections:
            axis, offset = sections[module]
            # the offset in the stored array's units: proportional (packed columns, scales)
            full = args.linear_num_value_heads * args.linear_value_head_dim + offset
            stored_offset = offset * v.shape[axis] // full
            src = Untiled(file, stored, tuple(v.shape), axis, stored_offset, nk, r, post)
        elif post is not None:
            src = Mapped(file, stored, shape, post)
        else:
            continue
        weights[name] = mx.zeros(shape, v.dtype)  # a placeholder: the source reads it
        sources[name] = (src, stored)


# -- Kimi delta attention (Kimi-Linear) -----------------------------------------------------


class Flat:
    """A stored tensor of one non-1 axis, or (heads, values), read as 1-D (Kimi's A_log
    (1, 1, H, 1), a release's dt_bias (H, d)): a slice of the flat values is a slice of
    its first non-1 axis, whole rows of the rest."""

    def __init__(self, file: Any, stored: str, shape: tuple[int, ...]):
        self.file, self.stored = file, stored
        self.path = getattr(file, "path", None)
        self.axis = next((i for i, n in enumerate(shape) if n != 1), 0)
        self.inner = 1
        for n in shape[self.axis + 1 :]:
            self.inner *= n
        self.tensors = {stored: _Info((shape[self.axis] * self.inner,))}
        self.post: Callable = lambda x: x  # elementwise, after the read (a GGUF's ssm_a)

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        if axis is None:
            return self.post(self.file.read(self.stored).reshape(-1))
        if start % self.inner or stop % self.inner:
            raise ValueError(f"{name}: [{start}, {stop}) is not whole rows of {self.inner}")
        a, b = start // self.inner, stop // self.inner
        return self.post(self.file.read(self.stored, self.axis, a, b).reshape(-1))


_RELEASE_CONV = re.compile(r"\.attention\.([qkv])_conv1d\.weight$")


def kda_tensors(weights: dict, sources: dict) -> None:
    """Kimi delta attention's tensors as the model holds them, in place: A_log (and a
    release's dt_bias) 1-D, a release's convs `q_conv1d` (C, 1, K) as `q_conv.conv`
    (C, K, 1)."""
    for name in list(weights):
        if name not in sources or ".attention." not in name:
            continue
        file, stored = sources[name]
        v = weights[name]
        if name.endswith(("attention.A_log", "attention.dt_bias")) and v.ndim > 1:
            weights[name] = v.reshape(-1)
            sources[name] = (Flat(file, stored, tuple(v.shape)), stored)
        elif m := _RELEASE_CONV.search(name):
            new = name[: m.start()] + f".attention.{m.group(1)}_conv.conv.weight"
            shape = (v.shape[0], v.shape[2], v.shape[1])
            del weights[name], sources[name]
            weights[new] = v.swapaxes(1, 2)
            sources[new] = (Mapped(file, stored, shape, lambda x: x.swapaxes(1, 2)), stored)


def kda_stored(weights: dict) -> dict:
    """What `convert` writes for mlx-lm (its names already): A_log as mlx-lm's kimi_linear
    holds it, (1, 1, H, 1)."""
    return {
        k: v.reshape(1, 1, -1, 1) if k.endswith("self_attn.A_log") else v
        for k, v in weights.items()
    }


def kda_gguf(weights: dict, sources: dict, args: Any) -> None:
    """A GGUF file's KDA tensors as the model holds them, in place (llama.cpp's converter
    wrote the convs (1, C, 1, K) and ssm_a = -exp(A_log) (1, 1, H, 1)): the convs
    (C, K, 1), A_log 1-D; each still read in slices (by channels, by heads). The metadata
    names no KDA head count of its own: ssm_beta's rows are one per head."""
    beta = next((v for k, v in weights.items() if k.endswith("attention.b_proj.weight")), None)
    if beta is not None:
        args.extra["kda_heads"] = beta.shape[0]
    for name in list(weights):
        if name not in sources or ".attention." not in name:
            continue
        file, stored = sources[name]
        v = weights[name]
        if name.endswith("_conv.conv.weight") and v.ndim == 4:  # (1, C, 1, K)
            shape = (v.shape[1], v.shape[3], 1)
            weights[name] = mx.zeros(shape, v.dtype)  # a placeholder: the source reads it
            sources[name] = (_Conv(file, stored, shape), stored)
        elif name.endswith("attention.A_log"):
            flat = Flat(file, stored, tuple(v.shape))
            flat.post = lambda x: mx.log(-x)
            weights[name] = mx.zeros((v.size,), v.dtype)
            sources[name] = (flat, stored)
        elif name.endswith("attention.dt_bias") and v.ndim > 1:
            weights[name] = mx.zeros((v.size,), v.dtype)
            sources[name] = (Flat(file, stored, tuple(v.shape)), stored)


class _Conv:
    """A GGUF conv (1, C, 1, K), float, read as (C, K, 1): a range of channels is a range
    of axis 1 of the stored array (the GGUF reader's slices are a matrix's rows or
    columns, so this reads the bytes itself)."""

    def __init__(self, file: Any, stored: str, shape: tuple[int, ...]):
        self.file, self.stored = file, stored
        self.path = getattr(file, "path", None)
        self.tensors = {stored: _Info(shape)}

    def read(self, name: str, axis: int | None = None, start: int = 0, stop: int = 0) -> mx.array:
        from .safetensors import read_dense

        src = self.file.gguf[self.stored]
        stored = tuple(reversed(src.shape))  # (1, C, 1, K)
        if axis is None:
            start, stop = 0, stored[1]
        raw = read_dense(self.path, src.offset, stored, src.type_name, 1, start, stop)
        return raw.reshape(stop - start, stored[3], 1)
