"""Gemma 3's and Gemma 4's attention: sliding and global layers, each with its own RoPE
base and (Gemma 4) head size and KV heads, and Gemma 4's KV-shared layers.

Every layer normalises each query and key head (Gemma 3: RMSNorm scaled by 1 + w, as
mlx-lm's gemma3_text; Gemma 4: plain RMSNorm, and the values too, without a scale)
before RoPE. Layers whose `layer_types` entry is "sliding_attention" attend to the last
`sliding_window` positions through a RotatingKVCache of the window (their cache spec
makes the model build it and a windowed mask, as for gpt-oss); the others attend to
everything. Gemma 4's global layers have heads of `global_head_dim` values, partial
("proportional") RoPE, and with `attention_k_eq_v` keys that are the values (no v_proj)
over `num_global_key_value_heads` KV heads. Its last `num_kv_shared_layers` layers
compute no keys or values: each attends over those of the last earlier layer of its
type (`kv_sources`), which hands them on when it runs (`_kv`); such a layer caches
nothing (the model makes no cache for it, and a pipeline stage keeps it with its
source: `placement.tied_boundaries`).

Split by heads as the core attention (the split tables below): query heads with their
KV groups; a global layer's KV heads are a unit of their own (`global_kv`, the groups a
rank's query heads need, shared by neighbours where a group straddles two ranks, so
that its KV map is irregular there) and its heads twice as wide. A KV-shared layer's
query heads are the same rank's as its source's, so it reads the source's local keys.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma3_text import RMSNorm as OnePlusRMSNorm
from mlx_lm.models.gemma4_text import RMSNormNoScale
from mlx_lm.models.rope_utils import initialize_rope

from ..model_args import ModelArgs
from ..parallel.splits import COLUMNS, ROWS, CacheSpec, SplitTable, TensorSplit, Unit
from .attention import Attention


def _table(args: ModelArgs, head_dim: int, kv_unit: str, values: bool) -> SplitTable:
    tensors = {
        "wq": TensorSplit("q_heads", ROWS, head_dim),
        "wk": TensorSplit(kv_unit, ROWS, head_dim),
        "wo": TensorSplit("q_heads", COLUMNS, head_dim),
    }
    if values:
        tensors["wv"] = TensorSplit(kv_unit, ROWS, head_dim)
    units = ()
    if kv_unit == "global_kv":
        units = (Unit("global_kv", args.global_kv_heads, "global KV heads", follows="q_heads"),)
    return SplitTable("attention", tensors, module="heads", units=units)


class GemmaAttention(Attention):
    """x (B, L, dim) -> (B, L, dim): a sliding (or, Gemma 3, any) layer's attention:
    `n_kv_heads` KV heads of `head_dim`; `kv_source` (another layer's attention, not a
    child module): the layer whose keys and values a KV-shared layer attends over."""

    hf_names = ()  # the core attention's and qk-norm's names (`QKNormAttention`)
    gguf_names = ()
    kv_unit = "kv_heads"

    @classmethod
    def dims(cls, args: ModelArgs) -> tuple[int, int]:
        """(KV heads, head size) of this kind's layers."""
        return args.n_kv_heads, args.head_dim

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        return _table(args, cls.dims(args)[1], cls.kv_unit, True)

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        window = args.window(layer)
        mask = "causal" if window is None else "window"
        source = args.kv_sources[layer] if args.gemma == 4 else None
        if source is not None:
            return CacheSpec("shared", mask=mask, window=window, source=source)
        per_token = ((cls.kv_unit, 2 * cls.dims(args)[1]),)
        if window is None:
            return CacheSpec("kv", per_token)
        return CacheSpec("rotating", per_token, window=window, mask="window")

    def __init__(self, args: ModelArgs, layer: int):
        nn.Module.__init__(self)
        object.__setattr__(self, "args", args)  # (not a parameter) its split table's
        n_kv, hd = self.dims(args)
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, n_kv, hd
        kind = args.layer_types[layer]
        self.k_eq_v = args.gemma == 4 and kind == "full_attention" and args.k_eq_v
        shared = args.gemma == 4 and args.kv_sources[layer] is not None
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        if not shared:
            self.wk = nn.Linear(args.dim, n_kv * hd, bias=False)
            if not self.k_eq_v:
                self.wv = nn.Linear(args.dim, n_kv * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        norm = OnePlusRMSNorm if args.gemma == 3 else nn.RMSNorm
        self.q_norm = norm(hd, eps=args.norm_eps)
        if not shared:
            self.k_norm = norm(hd, eps=args.norm_eps)
        self.v_norm = RMSNormNoScale(hd, eps=args.norm_eps) if args.gemma == 4 else None
        # Gemma 4 scales nothing (its norms do); Gemma 3 by query_pre_attn_scalar
        self.scale = 1.0 if args.gemma == 4 else args.query_pre_attn_scalar**-0.5
        theta, scaling = args.rope[kind]
        self.rope = initialize_rope(
            hd,
            theta,
            args.rope_traditional,
            scaling,
            max_position_embeddings=args.max_position_embeddings,
        )
        object.__setattr__(self, "_kv_index", None)
        object.__setattr__(self, "query_chunk", None)
        object.__setattr__(self, "kv_source", None)  # set by the model (`link_kv_sources`)
        object.__setattr__(self, "sharers", 0)  # KV-shared layers reading this one's
        object.__setattr__(self, "_kv", None)
        object.__setattr__(self, "_reads", 0)

    def _keys_values(self, x: mx.array, cache: Any) -> tuple[mx.array, mx.array, Any]:
        """This layer's keys and values (B, n_kv, S, hd) after the cache, and the offset
        its queries take; a KV-shared layer's are its source's."""
        src = self.kv_source
        if src is not None:
            k, v, offset = src._kv
            object.__setattr__(src, "_reads", src._reads + 1)
            if src._reads == src.sharers:  # the last reader: let the arrays go
                object.__setattr__(src, "_kv", None)
            return k, v, offset
        B, L, _ = x.shape
        k = self.wk(x).reshape(B, L, -1, self.head_dim)
        v = k if self.k_eq_v else self.wv(x).reshape(B, L, -1, self.head_dim)
        offset = cache.offset if cache is not None else 0
        k = self.rope(self.k_norm(k).transpose(0, 2, 1, 3), offset=offset)
        if self.v_norm is not None:
            v = self.v_norm(v)
        v = v.transpose(0, 2, 1, 3)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self.sharers:
            object.__setattr__(self, "_kv", (k, v, offset))
            object.__setattr__(self, "_reads", 0)
        return k, v, offset

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.wq(x).reshape(B, L, -1, self.head_dim))
        k, v, offset = self._keys_values(x, cache)
        q = self.rope(q.transpose(0, 2, 1, 3), offset=offset)
        if self._kv_index is not None:  # irregular local grouping (see `Attention`)
            k = mx.take(k, self._kv_index, axis=1)
            v = mx.take(v, self._kv_index, axis=1)
        out = self._attend(q, k, v, mask, cache)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class GemmaGlobalAttention(GemmaAttention):
    """Gemma 4's global (full-attention) layers: heads of `global_head_dim` values; with
    `attention_k_eq_v`, keys that are the values over `global_kv_heads` KV heads (their
    own unit, `global_kv`)."""

    @classmethod
    def dims(cls, args: ModelArgs) -> tuple[int, int]:
        return (args.global_kv_heads or args.n_kv_heads), args.global_head_dim

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        return _table(args, args.global_head_dim, cls.kv_unit_of(args), not args.k_eq_v)

    @staticmethod
    def kv_unit_of(args: ModelArgs) -> str:
        return "global_kv" if args.global_kv_heads else "kv_heads"

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        spec = super().cache_spec(args, layer)
        if spec.kind == "kv":
            return CacheSpec("kv", ((cls.kv_unit_of(args), 2 * args.global_head_dim),))
        return spec

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__(args, layer)
        object.__setattr__(self, "kv_unit", self.kv_unit_of(args))


def link_kv_sources(layers: list[nn.Module], args: ModelArgs) -> None:
    """Point every KV-shared layer's attention at its source's (`args.kv_sources`)."""
    if args.gemma != 4:
        return
    for j, source in enumerate(args.kv_sources):
        if source is None:
            continue
        src = layers[source].attention
        object.__setattr__(layers[j].attention, "kv_source", src)
        object.__setattr__(src, "sharers", src.sharers + 1)
