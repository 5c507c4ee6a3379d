"""Sparse attention (DeepSeek-V3.2, GLM-5): latent attention whose queries each attend to
the `index_topk` keys a lightning indexer picks, mlx-lm's `DeepseekV32Attention` under
the model's names and masks, with `shard`.

The attention is latent attention (`latent_attention.py`: the latent c and one RoPE key
per token cached, heads split by their rows of q_b_proj and their embed_q / unembed_out).
Beside it the indexer (mlx-lm's `Indexer`: `wq_b` from the query latent, one key per
token through `wk` and a LayerNorm `k_norm`, `weights_proj` weighting its heads) scores
every cached key for every query: sum over its heads of relu(q . k) times the head's
weight. Each query then attends to its `index_topk` best keys only (all of them while
the cache holds no more than that). The indexer's keys have a cache of their own, beside
the latent's: the layer's cache is mlx-lm's `CacheList(latent KVCache, indexer
KVCache)`, both rewinding alike (the indexer's values are empty: it caches keys only,
`index_head_dim` values per token).

The indexer is replicated, not split by its heads: its scores are a sum over all of its
heads before the top-k, so a split would need the (L, S) score matrix all-reduced before
every layer's selection, a second collective per layer. Replicated, every rank computes
the same scores from the same (replicated) input and query latent and picks the same
keys, so ranks agree exactly with one process; the cost is its weights (wq_b, wk,
weights_proj: DeepSeek-V3.2's 14M parameters of a layer's ~11B) and its key cache (128
values per token of the latent's 576) on every rank.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.deepseek_v32 import Indexer as MlxLmIndexer
from mlx_lm.models.deepseek_v32 import ModelArgs as DeepseekV32Args

from ..model_args import ModelArgs
from ..parallel.splits import CacheSpec, SplitTable
from .latent_attention import LatentAttention, deepseek_v3_fields

# The fields the indexer reads (ModelArgs.extra), with mlx-lm's deepseek_v32 defaults
INDEXER_FIELDS = ("index_n_heads", "index_head_dim", "index_topk", "indexer_rope_interleave")


class Indexer(MlxLmIndexer):
    """mlx-lm's lightning indexer (its parameters, RoPE and scores); its cache holds the
    keys only (an empty value per token, not mlx-lm's zeros as wide as the keys)."""

    def __call__(
        self, x: mx.array, qr: mx.array, mask: mx.array | None, cache: Any = None
    ) -> mx.array | None:
        """x (B, L, dim), qr (B, L, q_lora_rank) -> each query's top-k key positions (B,
        1, L, index_topk), or None when there are no more keys than that."""
        b, s, _ = x.shape
        q = self.wq_b(qr).reshape(b, s, self.n_heads, self.head_dim).swapaxes(1, 2)
        k = self.k_norm(self.wk(x)).reshape(b, 1, s, self.head_dim)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, _ = cache.update_and_fetch(k, mx.zeros((b, 1, s, 0), k.dtype))
        if k.shape[2] <= self.index_topk:
            return None
        scores = mx.maximum(q @ k.swapaxes(-1, -2), 0)  # (B, H, L, S)
        weights = self.weights_proj(x) * (self.n_heads**-0.5 * self.softmax_scale)
        scores = scores * weights.swapaxes(-1, -2)[..., None]
        if s > 1:  # summed head by head, as mlx-lm sums them (the same rounding)
            scores = sum(scores[:, h : h + 1] for h in range(scores.shape[1]))
        else:
            scores = scores.sum(axis=1, keepdims=True)
        if mask is not None:
            scores = mx.where(mask, scores, -float("inf"))
        return mx.argpartition(scores, kth=-self.index_topk, axis=-1)[..., -self.index_topk :]


def indexer_args(args: ModelArgs) -> DeepseekV32Args:
    """mlx-lm's config of the indexer."""
    return DeepseekV32Args(
        hidden_size=args.dim,
        q_lora_rank=args.q_lora_rank,
        qk_rope_head_dim=args.qk_rope_head_dim,
        rope_theta=args.rope_theta,
        rope_scaling=args.rope_scaling,
        max_position_embeddings=args.max_position_embeddings,
        **{k: args.extra[k] for k in INDEXER_FIELDS},
    )


class SparseAttention(LatentAttention):
    """x (B, L, dim) -> (B, L, dim): latent attention over the keys the `indexer` picks
    for each query (mlx-lm's `DeepseekV32Attention`), `n_heads` local."""

    # llama.cpp's glm-dsa / deepseek32 names of the indexer (the latent's are
    # LatentAttention's): k_norm's weight and bias, the rest as stored
    gguf_names = (
        ("indexer.attn_q_b", "attention.indexer.wq_b"),
        ("indexer.attn_k", "attention.indexer.wk"),
        ("indexer.k_norm", "attention.indexer.k_norm"),
        ("indexer.proj", "attention.indexer.weights_proj"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        """Latent attention's: the query heads split, the latent and the indexer whole."""
        table = super().split_table(args)
        return SplitTable(
            "sparse attention",
            table.tensors,
            module=table.module,
            plain_when_even=table.plain_when_even,
        )

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        """The latent and RoPE key, and the indexer's key, whole on every rank."""
        latent = super().cache_spec(args, layer)
        keys = CacheSpec("kv", (("", args.index_head_dim),))
        return CacheSpec("list", parts=(latent, keys), what="sparse attention")

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if "wq" in self:
            raise ValueError("model config: sparse attention needs q_lora_rank > 0")
        self.indexer = Indexer(indexer_args(args))

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr).reshape(B, L, self.n_heads, self.q_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
        latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
        latent = mx.expand_dims(self.kv_a_layernorm(latent), axis=1)  # (B, 1, L, rank)
        kv_cache, index_cache = cache if cache is not None else (None, None)
        offset = kv_cache.offset if kv_cache is not None else 0
        q_pe, k_pe = self.rope(q_pe, offset), self.rope(k_pe, offset)
        if isinstance(mask, str):  # "causal": the indexer and RoPE scores need an array
            mask = create_causal_mask(L, offset)
        if kv_cache is not None:
            latent, k_pe = kv_cache.update_and_fetch(latent, k_pe)
        top = self.indexer(x, qr, mask, cache=index_cache)
        if top is not None:
            latent, k_pe, mask = _select(top, latent, k_pe, mask, L)
        if kv_cache is not None:  # the indexer's keys evaluated with the latent's
            kv_cache.keys = mx.depends(kv_cache.keys, (index_cache.keys,))
        return self.attend(q_nope, q_pe, latent, k_pe, mask, cache)


def _select(
    top: mx.array, latent: mx.array, k_pe: mx.array, mask: mx.array | None, L: int
) -> tuple[mx.array, mx.array, mx.array | None]:
    """The indexer's picks `top` (B, 1, L, k) applied as mlx-lm applies them: one query
    gathers its k latents and RoPE keys; several keep every key under a mask of each
    query's k."""
    if L == 1:
        idx = top[:, :, 0, :, None]
        latent = mx.take_along_axis(
            latent, mx.broadcast_to(idx, idx.shape[:-1] + (latent.shape[-1],)), axis=2
        )
        k_pe = mx.take_along_axis(
            k_pe, mx.broadcast_to(idx, idx.shape[:-1] + (k_pe.shape[-1],)), axis=2
        )
        return latent, k_pe, None if mask is None else mx.take_along_axis(mask, top, axis=-1)
    shape = (*top.shape[:-1], latent.shape[2])
    sparse = mx.put_along_axis(mx.zeros(shape, dtype=mx.bool_), top, mx.array(True), axis=-1)
    return latent, k_pe, sparse if mask is None else sparse & mask


def sparse_fields(config: dict, interleave: bool) -> dict:
    """A DeepSeek-V3.2 / GLM-5 config's fields: DeepSeek-V3's latent attention and
    routing, and the indexer's (`interleave`: the family's default RoPE layout of the
    indexer's keys; GLM-5 keeps its RoPE base and scaling in `rope_parameters`)."""
    out = deepseek_v3_fields(config)
    if not out["q_lora_rank"]:
        raise ValueError(
            "sparse attention needs q_lora_rank > 0 (the indexer reads the query latent)"
        )
    extra = {
        "index_n_heads": int(config.get("index_n_heads", 64)),
        "index_head_dim": int(config.get("index_head_dim", 128)),
        "index_topk": int(config.get("index_topk", 2048)),
        "indexer_rope_interleave": bool(config.get("indexer_rope_interleave", interleave)),
    }
    bad = [k for k in INDEXER_FIELDS[:3] if extra[k] <= 0]
    if bad:
        raise ValueError(f"model config: {bad[0]} must be positive, got {extra[bad[0]]}")
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and config.get("rope_scaling") is None:
        out["rope_scaling"] = rope  # as mlx-lm's glm_moe_dsa reads it
    return out | {"extra": extra}


def deepseek_v32_fields(config: dict) -> dict:
    return sparse_fields(config, interleave=False)


def glm_moe_dsa_fields(config: dict) -> dict:
    return sparse_fields(config, interleave=True)


def indexer_config(a: ModelArgs) -> dict:
    """The indexer's `config.json` keys (what `convert` writes), GLM-5's RoPE block."""
    out = {k: a.extra[k] for k in INDEXER_FIELDS}
    if a.model_type == "glm_moe_dsa":
        out["rope_parameters"] = {"rope_type": "default", **(a.rope_scaling or {})}
        out["rope_parameters"]["rope_theta"] = a.rope_theta
    return out
