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
layers the step does not know run the model's ordinary forward: it reaches the caches
through the facade (`engine/caches.py`: `kv_position`, `take_kv`, `give_kv`) and takes
only plain KV caches, so sliding windows, latent attention, recurrent states (linear
attention, Mamba), quantized caches and pipeline stages stay eager.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..kernels import ext as native_ext
from ..kernels import fusing, on_cpu
from . import caches

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
        # two updates, not one: a primitive of two outputs cannot take over its inputs'
        # buffers (each output holds the inputs), so it would copy them; each one native
        # primitive on the CPU (MLX's slice_update is three tasks there)
        e = native_ext()
        if e is not None and on_cpu() and fusing():
            self.keys = e.kv_write(self.keys, k, self.pos)
            self.values = e.kv_write(self.values, v, self.pos)
        else:
            self.keys = mx.slice_update(self.keys, k, self.pos, axes=(2,))
            self.values = mx.slice_update(self.values, v, self.pos, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: Any = None) -> None:
        return None  # the key ranges are the mask


def _supported_layers(model: nn.Module) -> bool:
    """Every layer is the core attention (or its q/k-norm variant) then a feed-forward
    or experts, caching a plain causal KV cache (as its kinds declare): the layers whose
    cache the step holds as buffers. Other kinds (sliding windows, latent attention,
    recurrent mixers, `MixerBlock` layers) run the model's own forward."""
    from ..models.attention import Attention
    from ..models.qk_norm import QKNormAttention

    for layer in model.layers:
        spec = getattr(layer, "spec", None)
        if type(getattr(layer, "attention", None)) not in (Attention, QKNormAttention):
            return False
        if spec is None or spec.cache is None or spec.cache.kind != "kv":
            return False
        if spec.cache.mask != "causal":
            return False
    return True


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
            and _supported_layers(model)
        )
        # the feed-forwards that can count their experts' routes (`record_expert_load`):
        # looked up once, not at every step (87 us a step on the built-in model's 30 layers)
        self._routed = [
            layer.feed_forward
            for layer in getattr(model, "layers", [])
            if getattr(getattr(layer, "feed_forward", None), "counts_routes", False)
        ]

    def supports(self, cache: Sequence[Any] | None) -> bool:
        """The step runs over these caches: the model's layers are kinds it knows, every
        layer's cache a filled plain KV cache at one position (`caches.kv_position`),
        and no layer is counting its experts' routes (`record_expert_load`)."""
        if not self.layers_ok or not cache or len(cache) != len(self.model.layers):
            return False
        if any(getattr(ff, "expert_load", None) is not None for ff in self._routed):
            return False  # counting expert routes (a side effect a graph cannot replay)
        return caches.kv_position(cache) is not None

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
        B = tokens.shape[0]
        buf = caches.take_kv(cache, B)  # the buffers are the step's now (updated in place)
        ranges = mx.stack([buf.starts, mx.full((B,), buf.pos + 1, mx.int32)], axis=1)
        samp = list(sampling) if isinstance(sampling, tuple) else []
        pos = mx.array([buf.pos], mx.int32)
        inputs = (tokens[:, None], emb, buf.kv, pos, buf.offsets, ranges, samp)
        key = (
            B, buf.kv[0][0].shape[2], str(buf.kv[0][0].dtype), emb is not None, buf.batch,
            "logits" if sampling is False else "greedy" if sampling is None else "noisy",
            id(mx.distributed.all_sum), id(mx.distributed.all_gather), _shard_key(shard),
        )  # fmt: skip
        fn = self._function(key, sampling, shard)
        try:
            logits, y, rows, keys, values = fn(*inputs)
        except BaseException:
            caches.give_kv(cache, buf.kv)  # the caches as they were
            raise
        caches.give_kv(cache, list(zip(keys, values, strict=True)), 1)
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


def _sample(logits: mx.array, samp: list[mx.array], shard: Any):
    from .sampling import sample_arrays

    temps, keys, noisy = samp if samp else (None, None, None)
    return sample_arrays(logits, shard, temps, keys, noisy)


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
