"""The transformer every native family runs, with `shard(group)` on Attention and FeedForward.

Names follow Meta's reference implementation (and the MLX Llama example):
`tok_embeddings`, `layers.{i}.attention.{wq,wk,wv,wo}`,
`layers.{i}.feed_forward.{w1,w2,w3}`, `attention_norm`, `ffn_norm`, `norm`,
`output`. Checkpoint readers map their own names onto these.

Every mixer is a kind (the core attention and feed-forward here, the others in
`llama_tp/models/`): it declares its split table (`split_table(args)`, how its tensors
split: `parallel/splits.py`) and its cache (`cache_spec(args, layer)`: KV, rotating,
fixed-size arrays, or none). A layer is one mixer (`MixerBlock`) or attention then
feed-forward (`TransformerBlock`); each carries its `LayerSpec`, from which the model
makes its caches and masks (`layer_caches`, `layer_masks`).

Apart from the two `shard` methods, nothing here knows about ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache
from mlx_lm.models.rope_utils import initialize_rope

from .kernels import merge_heads, scaled_dot_product_attention  # mlx-lm's, native on CPU
from .kernels.layers import Pending, add_norm, product_add_norm, settle, settle_add_norm
from .model_args import ModelArgs
from .parallel.fused import fused_glu, fused_heads, fused_heads_rotated
from .parallel.llama_plan import table_styles
from .parallel.parallelize import parallelize
from .parallel.partition import RankPart
from .parallel.splits import (
    CacheSpec,
    LayerSpec,
    SplitTable,
    llama_attention,
    llama_feed_forward,
)
from .parallel.styles import LossParallel, PlanError, VocabParallel

# Chunked attention evaluates each query block before building the next (see
# `Attention._attend`); off inside `lazy_query_blocks()`.
_eval_query_blocks = True


@contextmanager
def lazy_query_blocks() -> Iterator[None]:
    """Chunked attention only builds its query blocks' graphs, evaluating nothing:
    for building a forward pass without running it (counting its collectives)."""
    global _eval_query_blocks
    saved, _eval_query_blocks = _eval_query_blocks, False
    try:
        yield
    finally:
        _eval_query_blocks = saved


class Attention(nn.Module):
    """x (B, L, dim) -> (B, L, dim): grouped-query attention with RoPE over a KV cache.

    The attention kind: split by whole heads (`splits.llama_attention`), a KVCache of
    its KV heads' keys and values. `hf_names` / `gguf_names`: its tensors in Hugging Face
    and GGUF checkpoints (checkpoint module path under the layer -> the model's), which
    the readers map (`checkpoints/hf.py`, `checkpoints/gguf.py`)."""

    hf_names = (
        ("self_attn.q_proj", "attention.wq"),
        ("self_attn.k_proj", "attention.wk"),
        ("self_attn.v_proj", "attention.wv"),
        ("self_attn.o_proj", "attention.wo"),
    )
    gguf_names = (
        ("attn_q", "attention.wq"),
        ("attn_k", "attention.wk"),
        ("attn_v", "attention.wv"),
        ("attn_output", "attention.wo"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        return llama_attention(args.head_dim)

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        return CacheSpec("kv", (("kv_heads", 2 * args.head_dim),))

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = hd = args.head_dim
        self.scale = hd**-0.5
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=args.o_bias)
        self.rope = initialize_rope(
            args.rope_dims or hd,
            args.rope_theta,
            args.rope_traditional,
            args.rope_scaling,
            args.max_position_embeddings,
        )
        # Local KV head of each local query head, when a rank's query heads do
        # not map onto its KV heads as plain GQA (see plan.RankPart.kv_map).
        # Set with object.__setattr__ so that it is not a parameter.
        object.__setattr__(self, "_kv_index", None)
        # Queries per block of a causal prefill (None: all at once); see `_attend`.
        object.__setattr__(self, "query_chunk", None)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """x (B, L, dim) -> q (B, nh, L, hd), k and v (B, nkv, L, hd), before RoPE. Head
        counts follow the (maybe sharded) projections."""
        heads = fused_heads(self, x, self.head_dim)  # one product (parallel/fused.py)
        if heads is not None:
            return heads
        B, L, _ = x.shape
        hd = self.head_dim
        q = self.wq(x).reshape(B, L, -1, hd).transpose(0, 2, 1, 3)
        k = self.wk(x).reshape(B, L, -1, hd).transpose(0, 2, 1, 3)
        v = self.wv(x).reshape(B, L, -1, hd).transpose(0, 2, 1, 3)
        return q, k, v

    def project_rotated(self, x: mx.array, offset: Any) -> tuple[mx.array, mx.array, mx.array]:
        """`project`, then RoPE on q and k from position `offset` (an int or an int32
        array): in one native operation when fused and the RoPE is plain."""
        if type(self).project is Attention.project:
            heads = fused_heads_rotated(self, x, self.head_dim, self.rope, offset)
            if heads is not None:
                return heads
        q, k, v = self.project(x)
        return self.rope(q, offset=offset), self.rope(k, offset=offset), v

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        return self.wo(self.mixed(x, mask, cache))

    def mixed(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        """The heads' outputs side by side before `wo`: x (B, L, dim) -> (B, L, nh * hd)."""
        offset = cache.offset if cache is not None else 0
        q, k, v = self.project_rotated(x, offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self._kv_index is not None:
            # Irregular local grouping: give every query head its own copy of
            # its KV head and attend as plain multi-head attention.
            k = mx.take(k, self._kv_index, axis=1)
            v = mx.take(v, self._kv_index, axis=1)
        return self._attend(q, k, v, mask, cache, merged=True)

    def _attend(
        self, q: mx.array, k: mx.array, v: mx.array, mask: Any, cache: Any, merged: bool = False
    ) -> mx.array:
        """Attention of q (B, nh, L, hd) over k, v (B, nkv, S, hd), S = offset + L ->
        (B, nh, L, hd), or (B, L, nh * hd) when `merged`.

        With `query_chunk` set and a causal mask, the queries go in blocks of that
        many positions: block [a, b) attends to keys [0, offset + b) under a causal
        mask (mlx aligns it to the lower right, so that is exactly its rows of the
        whole mask). MLX's CPU attention is not fused: it builds (B, nh, L, S) scores
        and probabilities, and blocks shrink them to (B, nh, chunk, S). Each block is
        evaluated as soon as it is built (outside `lazy_query_blocks`): evaluated
        together, the CPU backend allocates an op's output when it queues the op, so
        the next block's scores (or the rest of the layer's buffers) would be
        allocated while a block's scores are still alive. Other masks (an array:
        batched left padding) and quantized caches keep the single call.
        """
        c, L = self.query_chunk, q.shape[2]
        if c is None or L <= c or not isinstance(mask, str) or not isinstance(k, mx.array):
            return scaled_dot_product_attention(
                q, k, v, cache=cache, scale=self.scale, mask=mask, merged=merged
            )
        offset = k.shape[2] - L
        blocks = []
        for a in range(0, L, c):
            b = min(a + c, L)
            keys, values = k[:, :, : offset + b], v[:, :, : offset + b]
            out = scaled_dot_product_attention(
                q[:, :, a:b], keys, values, cache=cache, scale=self.scale, mask=mask
            )
            if _eval_query_blocks:
                mx.eval(out)
            blocks.append(out)
        out = mx.concatenate(blocks, axis=2)
        return merge_heads(out) if merged else out

    def shard(self, group: mx.distributed.Group, part: RankPart | None = None) -> None:
        """Split the heads over `group`: wq/wk/wv by output rows, wo by input columns.

        With `part=None` every rank takes an equal block (mlx's `shard_linear`);
        otherwise it takes the explicit head ranges of its `part` of the plan.
        Expressed through the parallel styles its split table gives (`table_styles`).
        """
        if part is None and self.n_kv_heads % group.size():
            raise PlanError(
                f"cannot split {self.n_kv_heads} KV heads evenly over {group.size()} ranks"
            )
        parts = None if part is None else {group.rank(): part}
        parallelize(self, table_styles(llama_attention(self.head_dim), parts), group)


class FeedForward(nn.Module):
    """x (B, L, dim) -> (B, L, dim): the SwiGLU feed-forward, split by its intermediate
    columns (`splits.llama_feed_forward`); it caches nothing."""

    hf_names = (
        ("mlp.gate_proj", "feed_forward.w1"),
        ("mlp.down_proj", "feed_forward.w2"),
        ("mlp.up_proj", "feed_forward.w3"),
    )
    gguf_names = (
        ("ffn_gate", "feed_forward.w1"),
        ("ffn_down", "feed_forward.w2"),
        ("ffn_up", "feed_forward.w3"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        return llama_feed_forward()

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        return None

    def __init__(self, args: ModelArgs, hidden_dim: int | None = None):
        """SwiGLU of `hidden_dim` columns (default `args.hidden_dim`)."""
        super().__init__()
        hidden = hidden_dim or args.hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=args.mlp_bias)  # gate
        self.w2 = nn.Linear(hidden, args.dim, bias=args.mlp_bias)  # down
        self.w3 = nn.Linear(args.dim, hidden, bias=args.mlp_bias)  # up

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(self.glu(x))

    def glu(self, x: mx.array) -> mx.array:
        """silu(w1 x) * w3 x, before `w2`: x (B, L, dim) -> (B, L, hidden)."""
        glu = fused_glu(self, x)  # one product (parallel/fused.py)
        if glu is None:
            glu = nn.silu(self.w1(x)) * self.w3(x)
        return glu

    def shard(self, group: mx.distributed.Group, part: RankPart | None = None) -> None:
        """Split the intermediate columns over `group`: w1/w3 by rows, w2 by columns
        (N equal blocks, or `part.ffn`), through the styles its split table gives."""
        parts = None if part is None else {group.rank(): part}
        parallelize(self, table_styles(llama_feed_forward(), parts), group)


class TransformerBlock(nn.Module):
    # the layer's own tensors, its norms, in checkpoints (GLM-4.5's and gpt-oss's GGUF
    # files name the feed-forward's norm post_attention_norm)
    hf_names = (
        ("input_layernorm", "attention_norm"),
        ("post_attention_layernorm", "ffn_norm"),
    )
    gguf_names = (
        ("attn_norm", "attention_norm"),
        ("ffn_norm", "ffn_norm"),
        ("post_attention_norm", "ffn_norm"),
    )

    def __init__(
        self,
        args: ModelArgs,
        attention: nn.Module | None = None,
        feed_forward: nn.Module | None = None,
        layer: int = 0,
    ):
        """A pre-norm block, attention then feed-forward; `attention` and `feed_forward`
        default to the Llama core's (the other families pass their own kinds:
        `llama_tp/models/`). `layer`: its index, for its kinds' cache (a window)."""
        super().__init__()
        self.attention = attention or Attention(args)
        self.feed_forward = feed_forward or FeedForward(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        object.__setattr__(self, "spec", LayerSpec.of(self.mixers(), args, layer))

    def mixers(self) -> dict[str, nn.Module]:
        """The block's mixers by path: each a kind with its split table and cache."""
        return {"attention": self.attention, "feed_forward": self.feed_forward}

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h, f = self.parts(x, None, mask, cache)
        return h + settle(f)

    def parts(
        self, x: mx.array, r: Pending | None, mask: Any = None, cache: Any = None
    ) -> tuple[mx.array, Pending]:
        """(h, f): h + f is the block's output (B, L, dim), for the input x + r (r None:
        x). The block's last sum, and its last product where it can, are left to the next
        block, whose norm takes them in one native operation (`run_layers`): f is an
        array, or (linear, y) for linear(y)."""
        if r is None:
            normed = self.attention_norm(x)
        else:
            x, normed = settle_add_norm(x, r, self.attention_norm)
        a, ff = self.attention, self.feed_forward
        if type(a).__call__ is Attention.__call__:  # wo's product, the sum and the norm
            h, normed = product_add_norm(a.wo, a.mixed(normed, mask, cache), x, self.ffn_norm)
        else:
            h, normed = add_norm(x, a(normed, mask, cache), self.ffn_norm)
        if type(ff).__call__ is FeedForward.__call__:
            return h, (ff.w2, ff.glu(normed))
        return h, ff(normed)


class MixerBlock(nn.Module):
    def __init__(self, args: ModelArgs, mixer: nn.Module, layer: int = 0):
        """A pre-norm block of one mixer (x + mixer(norm(x))): the layers of hybrid
        families whose every layer is one of attention, a recurrent mixer, a
        feed-forward or experts (Nemotron-H). `mixer` takes (x, mask, cache) when its
        kind caches, else x."""
        super().__init__()
        self.mixer = mixer
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        object.__setattr__(self, "spec", LayerSpec.of(self.mixers(), args, layer))

    def mixers(self) -> dict[str, nn.Module]:
        return {"mixer": self.mixer}

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if self.spec.cache is None:
            return x + self.mixer(self.norm(x))
        return x + self.mixer(self.norm(x), mask, cache)


def _mask(spec: CacheSpec | None, h: mx.array, cache: Any) -> Any:
    """The mask of a layer whose kind declares `spec`, for hidden states h (B, L, dim)
    (a CacheList's: its first cache's, as mlx-lm's DeepSeek-V3.2 makes it)."""
    if isinstance(cache, CacheList):
        cache = cache[0]
    if spec is None or spec.mask == "causal":
        return create_attention_mask(h, cache)
    if spec.mask == "window":
        return create_attention_mask(h, cache, window_size=spec.window)
    if spec.mask == "ssm":
        return create_ssm_mask(h, cache)
    if spec.mask == "chunked":
        return chunk_mask(h.shape[1], spec.window, cache)
    raise ValueError(f"unknown mask kind {spec.mask!r}")


def layer_masks(h: mx.array, layers: list[nn.Module], cache: list[Any]) -> list[Any]:
    """Each layer's mask for hidden states h (B, L, dim), as its kind's cache declares
    (`CacheSpec.mask`: causal, windowed for sliding-window attention, padding only for a
    recurrent layer), each made once from the first cache of its kind, as mlx-lm's
    hybrid models do. `cache`: one per layer (`per_layer`; None for a KV-shared layer,
    whose source comes first and makes the mask of its kind)."""
    made: dict[tuple[str, int | None], Any] = {}
    out = []
    for layer, c in zip(layers, cache, strict=True):
        spec = layer.spec.cache
        if spec is None and isinstance(layer, MixerBlock):
            out.append(None)  # a feed-forward or experts: no mask
            continue
        key = (spec.mask, spec.window) if spec is not None else ("causal", None)
        if key not in made:
            made[key] = _mask(spec, h, c)
        out.append(made[key])
    return out


class StateCache(ArraysCache):
    """mlx-lm's ArraysCache of a recurrent state (a linear-attention layer's conv and
    delta-rule state) that also counts the tokens the state has taken (`offset`, as a
    KV cache counts them), so that a cache of recurrent layers only (a pipeline stage of
    them, a Mamba model) still says what it holds. The count is one sequence's: a batch's
    rows keep their own in their KV layers."""

    def __init__(self, size: int, left_padding: list[int] | None = None, what: str = ""):
        super().__init__(size, left_padding)
        self.offset = 0
        self.what = what  # the layer kind (`CacheSpec.what`), for refusals

    def advance(self, N: int) -> None:
        super().advance(N)
        self.offset += N

    @classmethod
    def merge(cls, caches: list[Any]) -> StateCache:
        batch = super().merge(caches)
        batch.what = caches[0].what
        return batch

    def extract(self, idx: int) -> StateCache:
        row = StateCache(len(self.cache), what=self.what)
        row.cache = [c[idx : idx + 1] for c in self.cache]
        return row


class ChunkedCache(ChunkedKVCache):
    """mlx-lm's ChunkedKVCache of a chunked-attention layer (Llama 4: a query attends to
    the keys of its own chunk of `chunk_size` positions only), holding the keys from the
    start of the chunk of the first new token on: it drops the earlier ones when a token
    enters a new chunk (once a chunk, where mlx-lm's model keeps the last chunk_size keys
    and drops one at every step). Between decoding steps it holds at most a chunk.

    It steps back `n` tokens only while the chunk it steps back into is still held
    (`rewinds`, which `engine/caches.py` asks; `is_trimmable` says no to mlx-lm's prompt
    cache); `state` is mlx-lm's (keys, values, offset, chunk_size, start)."""

    def front(self) -> int:
        """The first position the cache holds once the next tokens are in."""
        if self.keys is None:
            return self.start_position
        return max(self.start_position, self.offset // self.chunk_size * self.chunk_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        drop = self.front() - self.start_position
        if drop:
            end = self.offset - self.start_position
            self.keys = self.keys[..., drop:end, :]
            self.values = self.values[..., drop:end, :]
            self.start_position += drop
        return super().update_and_fetch(keys, values)

    def maybe_trim_front(self) -> None:
        """(mlx-lm's model trims before every call; this cache trims in `update_and_fetch`.)"""

    def is_trimmable(self) -> bool:
        """False for mlx-lm's prompt cache (it would trim any count): the engine's facade
        asks `rewinds(n)`."""
        return False

    def rewinds(self, n: int) -> bool:
        """Whether stepping back `n` tokens leaves the keys the next token attends to."""
        offset = self.offset - n
        return offset >= 0 and offset // self.chunk_size * self.chunk_size >= self.start_position

    def trim(self, n: int) -> int:
        if not self.rewinds(n):
            raise ValueError(f"a chunked-attention cache cannot step back {n} tokens")
        self.offset -= n
        return n


def chunk_mask(L: int, chunk: int, cache: ChunkedCache | None) -> mx.array | None:
    """The (L, S) boolean mask of L new queries over a chunked-attention cache's keys
    (those it will hold after them, `ChunkedCache.front` on): each query sees the keys of
    its own chunk up to itself (mlx-lm's llama4 chunk mask). None for one query: every
    key held is of its chunk."""
    offset = cache.offset if cache is not None else 0
    if L == 1 and cache is not None:
        return None
    start = cache.front() if cache is not None else 0
    keys = mx.arange(start, offset + L)
    queries = mx.arange(offset, offset + L)[:, None]
    return ((keys // chunk) == (queries // chunk)) & (keys <= queries)


def make_layer_cache(spec: CacheSpec | None) -> Any:
    """mlx-lm's cache of the kind `spec` declares: a KVCache, a RotatingKVCache of the
    window (it never holds more than the window), a `ChunkedCache` of chunked attention
    (the current chunk's keys), an ArraysCache of fixed-size arrays (a `StateCache`: it
    counts its tokens), or a CacheList; a layer that caches nothing still gets a KVCache
    (unused), as mlx-lm's models give every layer one."""
    if spec is None or spec.kind == "kv":
        return KVCache()
    if spec.kind == "rotating":
        return RotatingKVCache(max_size=spec.window)
    if spec.kind == "chunked":
        return ChunkedCache(spec.window)
    if spec.kind == "arrays":
        return StateCache(size=spec.size, what=spec.what)
    if spec.kind == "list":
        return CacheList(*[make_layer_cache(p) for p in spec.parts])
    raise ValueError(f"unknown cache kind {spec.kind!r}")


def shares_cache(layer: nn.Module) -> bool:
    """Whether `layer` has no cache of its own: it attends over another layer's keys and
    values (Gemma's KV-shared layers), or its one mixer caches nothing (a `MixerBlock`
    of a feed-forward or experts: Nemotron-H's, as mlx-lm's make_cache)."""
    spec = layer.spec.cache
    if spec is None:
        return isinstance(layer, MixerBlock)
    return spec.kind == "shared"


def layer_caches(layers: list[nn.Module]) -> list[Any]:
    """mlx-lm's caches for `layers`, one per layer as each layer's kinds declare, none
    for a KV-shared layer (so fewer than the layers, as mlx-lm's Gemma 4 makes)."""
    return [make_layer_cache(layer.spec.cache) for layer in layers if not shares_cache(layer)]


def per_layer(layers: list[nn.Module], cache: list[Any] | None) -> list[Any]:
    """`cache` (`layer_caches`' list, or None) as one entry per layer: None for a
    KV-shared layer (and for all without a cache)."""
    if cache is None:
        return [None] * len(layers)
    owners = [layer for layer in layers if not shares_cache(layer)]
    if len(owners) != len(cache):
        raise ValueError(f"a cache of {len(cache)} layers for {len(owners)} caching layers")
    it = iter(cache)
    return [None if shares_cache(layer) else next(it) for layer in layers]


def run_layers(
    layers: list[nn.Module], h: mx.array, cache: list[Any] | None, side: mx.array | None = None
) -> mx.array:
    """h (B, L, dim) through `layers` with their caches (`layer_caches`' list) and masks.
    `side` (B, L, W): what every layer takes beside h (Gemma's per-layer inputs), passed
    to each layer as its fourth argument (each takes its own part)."""
    cache = per_layer(layers, cache)
    masks = layer_masks(h, layers, cache)
    pending = None  # the last core block's feed-forward output, not yet added to h
    for layer, c, mask in zip(layers, cache, masks, strict=True):
        if side is None and type(layer) is TransformerBlock:
            h, pending = layer.parts(h, pending, mask, c)
            continue
        if pending is not None:
            h, pending = h + settle(pending), None
        h = layer(h, mask, c) if side is None else layer(h, mask, c, side)
    return h if pending is None else h + settle(pending)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, layers: list[nn.Module] | None = None):
        """The Llama core; `layers` (default: core blocks) for the other families
        (`llama_tp.models.build(args)` builds any of them)."""
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = layers or [TransformerBlock(args, layer=i) for i in range(args.n_layers)]
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if not args.tie_word_embeddings:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    # Values per position that a pipeline's first stage hands on beside h (`side_inputs`)
    side_width = 0

    def make_cache(self) -> list[Any]:
        """One cache per caching layer (`layer_caches`), for mlx-lm's `make_prompt_cache`."""
        return layer_caches(self.layers)

    def embed(self, tokens: mx.array, input_embeddings: mx.array | None = None) -> mx.array:
        """tokens (B, L) -> the hidden state entering the first layer (B, L, dim); the
        embedding rows `input_embeddings`, when given, replace the lookup. (A family
        that scales its embeddings overrides it: `models/gemma.py`.)"""
        return self.tok_embeddings(tokens) if input_embeddings is None else input_embeddings

    def side_inputs(self, tokens: mx.array, h: mx.array) -> mx.array | None:
        """What every layer takes beside h, from the tokens and the embedded h: (B, L,
        `side_width`), or None (the Llama core: nothing)."""
        return None

    def hand_off_width(self, layer: int) -> int:
        """Values per position beside h that a pipeline stage starting at layer `layer`
        receives (the side inputs': `side_width`; Kimi K3's block states: more the later)."""
        return self.side_width

    def hand_off(self, h: mx.array, side: Any) -> mx.array:
        """What a pipeline stage sends on after its layers: h (B, L, dim) and the side
        input beside it, (B, L, dim + `hand_off_width`)."""
        return h if side is None else mx.concatenate([h, side.astype(h.dtype)], axis=-1)

    def take_over(self, x: mx.array) -> tuple[mx.array, Any]:
        """What a pipeline stage received (`hand_off`'s) -> (h, the side input)."""
        dim = self.args.dim
        return (x, None) if x.shape[-1] == dim else (x[..., :dim], x[..., dim:])

    def finish(self, h: mx.array, side: Any) -> mx.array:
        """The last layer's output h (B, L, dim) -> the final norm's input (the Llama
        core: h itself; Kimi K3 mixes in its block states)."""
        return h

    def head(self, h: mx.array) -> mx.array:
        """The final-normed h (B, L, dim) -> logits (B, L, V[_local])."""
        if self.args.tie_word_embeddings:
            return self.tok_embeddings.as_linear(h)
        return self.output(h)

    def shard_vocab(self, group: mx.distributed.Group, start: int, stop: int) -> None:
        """Keep vocabulary rows [start, stop) of the embedding and the output head.

        The embedding then completes its vectors with one all-reduce, and the
        model returns this rank's logits only: (B, L, stop - start).
        """
        rows = {group.rank(): (start, stop)}
        plan: dict[str, Any] = {"tok_embeddings": VocabParallel(rows)}
        if not self.args.tie_word_embeddings:
            plan["output"] = LossParallel(rows)
        parallelize(self, plan, group)

    def __call__(
        self,
        tokens: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        """tokens: (B, L) int -> logits (B, L, vocab_size), or (B, L, V_local) after shard_vocab.

        `input_embeddings` (B, L, dim), when given, replaces the embedding lookup
        (as in mlx-lm's models): the sampler may already hold the new token's row.
        """
        return self.head(self.hidden(tokens, cache, input_embeddings))

    def hidden(
        self,
        tokens: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        """tokens (B, L) -> the final-normed hidden state (B, L, dim) the head reads: the
        embedding, the layers, `finish` and the final norm. Under tensor parallelism it
        is whole on every rank (each block ends in an all-reduce); under sequence
        parallelism (parallel/sequence.py, which only the head gathers) it would be this
        rank's chunk of the positions."""
        h = self.embed(tokens, input_embeddings)
        # Under sequence parallelism h is this rank's chunk (>= 2 positions, see
        # parallel/sequence.py): the mask is "causal" either way.
        side = self.side_inputs(tokens, h)
        h = run_layers(self.layers, h, cache, side)
        return self.norm(self.finish(h, side))
