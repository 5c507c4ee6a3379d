"""The model: embedding, the layers of its kinds in order, the final norm and the head.

Names follow Meta's reference implementation (and the MLX Llama example):
`tok_embeddings`, `layers.{i}.*`, `norm`, `output`; checkpoint readers map their own
names onto these. The layers are blocks (`models/blocks.py`) of kinds: the core
attention and feed-forward (`models/attention.py`, `models/feed_forward.py`) or any
family's (`models/registry.py`), each declaring its split table and cache; the model
makes each layer's cache and mask from them (`models/caches.py`, `models/masks.py`) and
runs the layers (`run_layers`). A family with more than layers (scaled embeddings,
inputs beside h, capped logits) subclasses `Transformer` (`models/gemma.py`).

Nothing here knows about ranks: the kinds split themselves (`shard(group, part)`), the
loader applies them (`parallel/shard.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .kernels.layers import settle
from .model_args import ModelArgs
from .models.blocks import TransformerBlock
from .models.caches import layer_caches, per_layer
from .models.masks import layer_masks

__all__ = ["Transformer", "run_layers"]


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

    def __call__(
        self,
        tokens: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        """tokens: (B, L) int -> logits (B, L, vocab_size), or (B, L, V_local) when the head
        is split by vocabulary rows (`parallel/shard.py`).

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
