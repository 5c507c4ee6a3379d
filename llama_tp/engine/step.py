"""The per-token decode step as one compiled graph (`mx.compile`), or the same step eager.

A decode step of a small model is paid mostly outside its matrix products: Python
builds a graph of hundreds of operations for every token. `DecodeStep` builds it once
per shape and replays it: the forward from the embedding (or the embedding rows the
previous sampling exchange brought) through the head, and, for rows that sample greedily
or with a temperature only, the sharded sampler, collectives included, with the KV
cache as explicit inputs and outputs:

- each layer's KV buffer is passed whole, its length kept a multiple of 256 (as mlx-lm's
  `KVCache` grows it; a batch's buffer is padded to one after rows join or leave), so its
  shape changes once per 256 tokens, with the write position, the rows' RoPE positions
  and their key ranges as int32 arrays: the graph is the same at every token
  (`StepCache` stands in for each layer's cache while tracing);
- attention takes the whole buffer and each row's range of keys (the native kernel reads
  only those keys: the same arithmetic as the exact-length slice; elsewhere a mask);
- one compiled function per shape (batch rows, buffer length, input kind, sampling kind,
  the collectives in use), at most `MAX_ENTRIES` kept (least recently used dropped,
  MLX's cache entry with it), so a server whose batch size keeps changing holds a bounded
  number of graphs; `stats()` counts traces (each a recompilation) and evictions.

The eager step (`LLAMA_TP_COMPILE=0`, `--no-compile`) runs the very same function
without `mx.compile`, so compiled and uncompiled steps give the same tokens; caches or
layers the step does not know (sliding windows, latent attention, quantized caches,
pipeline stages) run the model's ordinary forward.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

ENV = "LLAMA_TP_COMPILE"  # "0": run the decode step eagerly
MAX_ENTRIES = 16  # compiled graphs kept per model (one per shape)

_compile = os.environ.get(ENV, "1") != "0"


def set_compile(on: bool) -> None:
    """Compile the decode step (the default) or run it eagerly (`--no-compile`)."""
    global _compile
    _compile = on


def compiling() -> bool:
    return _compile


class StepCache:
    """A layer's KV cache inside the step: the whole buffers, the write position, the
    rows' positions (RoPE's `offset`) and key ranges, all arrays."""

    def __init__(self, keys, values, pos, offsets, ranges):
        self.keys, self.values, self.pos = keys, values, pos
        self.offset, self.key_range = offsets, ranges

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, k, self.pos, axes=(2,))
        self.values = mx.slice_update(self.values, v, self.pos, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: Any = None) -> None:
        return None  # the key ranges are the mask


def _supported_attention(model: nn.Module) -> bool:
    from ..model import Attention
    from ..models.qk_norm import QKNormAttention

    return all(type(layer.attention) in (Attention, QKNormAttention) for layer in model.layers)


class DecodeStep:
    """`model`'s decode step over one-token rows: compiled (by shape) or eager."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._fns: OrderedDict[tuple, Any] = OrderedDict()
        self.traces = 0  # recompilations (each new shape traces once)
        self.evictions = 0
        self.calls = 0
        self.layers_ok = (
            getattr(model, "mesh", None) is None
            and hasattr(model, "layers")
            and _supported_attention(model)
        )

    def supports(self, cache: Sequence[Any] | None) -> bool:
        """The step runs over these caches: every one a filled `KVCache` or
        `BatchKVCache` (exactly those kinds), at one position; and no layer is counting
        its experts' routes (`record_expert_load`)."""
        if not self.layers_ok or not cache or len(cache) != len(self.model.layers):
            return False
        if any(
            getattr(layer.feed_forward, "expert_load", None) is not None
            for layer in self.model.layers
        ):
            return False  # counting expert routes (a side effect a graph cannot replay)
        kind = type(cache[0])
        if kind not in (KVCache, BatchKVCache) or any(type(c) is not kind for c in cache):
            return False
        if any(c.keys is None for c in cache):
            return False
        pos = _position(cache[0])
        return all(_position(c) == pos for c in cache)

    def stats(self) -> dict[str, int]:
        return {
            "traces": self.traces, "entries": len(self._fns), "evictions": self.evictions,
            "calls": self.calls,
        }  # fmt: skip

    def __call__(
        self,
        tokens: mx.array,
        cache: list[Any],
        emb: mx.array | None = None,
        sampling: tuple[mx.array, mx.array, mx.array] | None | bool = False,
        shard: Any = None,
    ) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """One step for tokens (B,) [with their embedding rows emb (B, dim)] over `cache`
        (`supports(cache)`): (logits (B, V_local), next tokens (B,) or None, their
        embedding rows or None). `sampling=False`: logits only (the caller samples);
        None: every row greedy; `sampling.draw_arrays`' (temps, keys, noisy): greedy or
        temperature rows, sampled on `shard`. The caches advance by one position."""
        self.calls += 1
        for c in cache:
            _reserve(c)
        c0 = cache[0]
        batch = type(c0) is BatchKVCache
        pos = _position(c0)
        B = tokens.shape[0]
        if batch:
            offsets = c0.offset.astype(mx.int32)
            starts = c0.left_padding.astype(mx.int32)
        else:
            offsets = mx.array(pos, dtype=mx.int32)
            starts = mx.zeros((B,), mx.int32)
        ranges = mx.stack([starts, mx.full((B,), pos + 1, mx.int32)], axis=1)
        kv = [(c.keys, c.values) for c in cache]
        for c in cache:  # the buffers are the step's now: MLX may update them in place
            c.keys = c.values = None
        samp = list(sampling) if isinstance(sampling, tuple) else []
        inputs = (tokens[:, None], emb, kv, mx.array([pos], mx.int32), offsets, ranges, samp)
        key = (
            B, c0_len(kv), str(kv[0][0].dtype), emb is not None, batch,
            "logits" if sampling is False else "greedy" if sampling is None else "noisy",
            id(mx.distributed.all_sum), id(mx.distributed.all_gather), _shard_key(shard),
        )  # fmt: skip
        fn = self._function(key, sampling, shard)
        try:
            logits, y, rows, keys, values = fn(*inputs)
        except BaseException:
            for c, (k, v) in zip(cache, kv, strict=True):  # the caches as they were
                c.keys, c.values = k, v
            raise
        for c, k, v in zip(cache, keys, values, strict=True):
            c.keys, c.values = k, v
            if batch:
                c.offset = c.offset + 1
                c._idx += 1
            else:
                c.offset += 1
        return logits, y, rows

    def _function(self, key: tuple, sampling: Any, shard: Any):
        fn = self._fns.get(key)
        if fn is not None:
            self._fns.move_to_end(key)
            return fn
        model = self.model

        def step(tokens, emb, kv, pos, offsets, ranges, samp):
            if compiled:
                self.traces += 1  # runs once per trace, not per replay
            caches = [StepCache(k, v, pos, offsets, ranges) for k, v in kv]
            h = None if emb is None else emb[:, None]
            logits = model(tokens, cache=caches, input_embeddings=h)[:, -1, :]
            y = rows = None
            if sampling is not False:
                y, rows = _sample(logits, samp, shard)
            return logits, y, rows, [c.keys for c in caches], [c.values for c in caches]

        compiled = _compile
        fn = mx.compile(step) if compiled else step
        if compiled:
            self._fns[key] = fn
            while len(self._fns) > MAX_ENTRIES:
                self._fns.popitem(last=False)  # its MLX cache entry goes with it
                self.evictions += 1
        return fn


def _shard_key(shard: Any) -> tuple | None:
    if shard is None:
        return None
    return (shard.start, shard.stop, shard.size, shard.ranks, id(shard.embedding))


def c0_len(kv: list[tuple[mx.array, mx.array]]) -> int:
    return kv[0][0].shape[2]


def _sample(logits: mx.array, samp: list[mx.array], shard: Any):
    from .sampling import sample_arrays

    temps, keys, noisy = samp if samp else (None, None, None)
    return sample_arrays(logits, shard, temps, keys, noisy)


def _position(c: Any) -> int:
    return c._idx if type(c) is BatchKVCache else c.offset


def _reserve(c: Any, n: int = 1) -> None:
    """Make room in `c`'s buffers for n more positions, their length a whole number of
    the cache's steps (256): what mlx-lm's `update_and_fetch` grows to, but also after a
    batch's rows joined or left (`merge`, `extend` and `filter` leave any length), so
    that the step's shapes, and its compiled graphs, stay few. Positions past the cache's
    are never read (the key ranges)."""
    size = c.keys.shape[2]
    want = -(-(_position(c) + n) // c.step) * c.step
    if size >= want and size % c.step == 0:
        return
    want = max(want, -(-size // c.step) * c.step)
    B, H, _, D = c.keys.shape
    c.keys = mx.concatenate([c.keys, mx.zeros((B, H, want - size, D), c.keys.dtype)], axis=2)
    pad = mx.zeros((B, H, want - size, c.values.shape[3]), c.values.dtype)
    c.values = mx.concatenate([c.values, pad], axis=2)


def describe_step(model: nn.Module) -> str:
    """One line for --verbose: how decode steps ran, and the products fused."""
    from ..parallel.fused import fused_count

    s = decode_step_for(model).stats()
    f = fused_count(model)
    fused = f"fused products: q/k/v {f['qkv']}, gate/up {f['gate_up']}"
    if not s["calls"]:
        how = "eager (the model's own forward: no step it compiles)"
    elif _compile:
        how = f"compiled, {s['traces']} graph{'s' * (s['traces'] != 1)} traced, {s['calls']} steps"
    else:
        how = f"eager (--no-compile), {s['calls']} steps"
    return f"{how}; {fused}"


def decode_step_for(model: nn.Module) -> DecodeStep:
    """The model's `DecodeStep` (one per model, kept on it)."""
    step = model.__dict__.get("_decode_step")
    if step is None:
        step = DecodeStep(model)
        object.__setattr__(model, "_decode_step", step)
    return step
