"""The Llama-family transformer, with `shard(group)` on Attention and FeedForward.

Names follow Meta's reference implementation (and the MLX Llama example):
`tok_embeddings`, `layers.{i}.attention.{wq,wk,wv,wo}`,
`layers.{i}.feed_forward.{w1,w2,w3}`, `attention_norm`, `ffn_norm`, `norm`,
`output`. Checkpoint readers map their own names onto these.

Apart from the two `shard` methods, nothing here knows about ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.rope_utils import initialize_rope

from .kernels import scaled_dot_product_attention  # mlx-lm's, native on the CPU
from .model_args import ModelArgs
from .parallel.fused import fused_glu, fused_heads
from .parallel.llama_plan import attention_styles, feed_forward_styles
from .parallel.parallelize import parallelize
from .parallel.partition import RankPart
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

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.project(x)
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset=offset)
        k = self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self._kv_index is not None:
            # Irregular local grouping: give every query head its own copy of
            # its KV head and attend as plain multi-head attention.
            k = mx.take(k, self._kv_index, axis=1)
            v = mx.take(v, self._kv_index, axis=1)
        out = self._attend(q, k, v, mask, cache)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)  # (B, L, nh * hd)
        return self.wo(out)

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, mask: Any, cache: Any) -> mx.array:
        """Attention of q (B, nh, L, hd) over k, v (B, nkv, S, hd), S = offset + L.

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
            return scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
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
        return mx.concatenate(blocks, axis=2)

    def shard(self, group: mx.distributed.Group, part: RankPart | None = None) -> None:
        """Split the heads over `group`: wq/wk/wv by output rows, wo by input columns.

        With `part=None` every rank takes an equal block (mlx's `shard_linear`);
        otherwise it takes the explicit head ranges of its `part` of the plan.
        Expressed through the parallel styles (`llama_plan.attention_styles`).
        """
        if part is None and self.n_kv_heads % group.size():
            raise PlanError(
                f"cannot split {self.n_kv_heads} KV heads evenly over {group.size()} ranks"
            )
        parts = None if part is None else {group.rank(): part}
        parallelize(self, attention_styles(self.head_dim, parts), group)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, hidden_dim: int | None = None):
        """SwiGLU of `hidden_dim` columns (default `args.hidden_dim`)."""
        super().__init__()
        hidden = hidden_dim or args.hidden_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=args.mlp_bias)  # gate
        self.w2 = nn.Linear(hidden, args.dim, bias=args.mlp_bias)  # down
        self.w3 = nn.Linear(args.dim, hidden, bias=args.mlp_bias)  # up

    def __call__(self, x: mx.array) -> mx.array:
        glu = fused_glu(self, x)  # one product (parallel/fused.py)
        if glu is None:
            glu = nn.silu(self.w1(x)) * self.w3(x)
        return self.w2(glu)

    def shard(self, group: mx.distributed.Group, part: RankPart | None = None) -> None:
        """Split the intermediate columns over `group`: w1/w3 by rows, w2 by columns
        (N equal blocks, or `part.ffn`), through `llama_plan.feed_forward_styles`."""
        parts = None if part is None else {group.rank(): part}
        parallelize(self, feed_forward_styles(parts), group)


class TransformerBlock(nn.Module):
    def __init__(
        self,
        args: ModelArgs,
        attention: nn.Module | None = None,
        feed_forward: nn.Module | None = None,
    ):
        """A pre-norm block; `attention` and `feed_forward` default to the Llama core's
        (the other families pass their own: `llama_tp/models/`)."""
        super().__init__()
        self.attention = attention or Attention(args)
        self.feed_forward = feed_forward or FeedForward(args)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = x + self.attention(self.attention_norm(x), mask, cache)
        return h + self.feed_forward(self.ffn_norm(h))


def layer_masks(h: mx.array, layers: list[nn.Module], cache: list[Any]) -> list[Any]:
    """Each layer's attention mask for hidden states h (B, L, dim): causal, and windowed
    for the sliding-window layers (an attention's `window`), each made once from the first
    cache of its kind, as mlx-lm's gpt_oss does."""
    made: dict[int | None, Any] = {}
    out = []
    for layer, c in zip(layers, cache, strict=True):
        w = getattr(layer.attention, "window", None)
        if w not in made:
            made[w] = create_attention_mask(h, c, window_size=w)
        out.append(made[w])
    return out


def layer_caches(layers: list[nn.Module]) -> list[Any]:
    """mlx-lm's caches for `layers`: a RotatingKVCache of the window for sliding-window
    attention (it never holds more than the window), a KVCache otherwise."""
    out: list[Any] = []
    for layer in layers:
        w = getattr(layer.attention, "window", None)
        out.append(RotatingKVCache(max_size=w) if w else KVCache())
    return out


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, layers: list[nn.Module] | None = None):
        """The Llama core; `layers` (default: core blocks) for the other families
        (`llama_tp.models.build(args)` builds any of them)."""
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = layers or [TransformerBlock(args) for _ in range(args.n_layers)]
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if not args.tie_word_embeddings:
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def make_cache(self) -> list[Any]:
        """One cache per layer (`layer_caches`), for mlx-lm's `make_prompt_cache`."""
        return layer_caches(self.layers)

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
        h = self.tok_embeddings(tokens) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        # Under sequence parallelism h is this rank's chunk (>= 2 positions, see
        # parallel/sequence.py): the mask is "causal" either way.
        masks = layer_masks(h, self.layers, cache)
        for layer, c, mask in zip(self.layers, cache, masks, strict=True):
            h = layer(h, mask, c)
        h = self.norm(h)
        if self.args.tie_word_embeddings:
            return self.tok_embeddings.as_linear(h)
        return self.output(h)
