"""The layers: `TransformerBlock` (a pre-norm block, attention then feed-forward, of the
core kinds or any family's) and `MixerBlock` (one mixer: attention, a recurrent mixer,
a feed-forward or experts). Each lists its mixers (`mixers()`, the kinds the placement
splits and `shard` shards) and carries its `LayerSpec` (their split tables and cache),
from which the model makes its caches and masks (`caches.py`, `masks.py`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..kernels.layers import Pending, add_norm, product_add_norm, settle, settle_add_norm
from ..model_args import ModelArgs
from ..parallel.splits import LayerSpec
from .attention import Attention
from .feed_forward import FeedForward


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
    # a layer whose kind caches nothing takes no cache and no mask (`caches.shares_cache`)
    bare_when_uncached = True

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
