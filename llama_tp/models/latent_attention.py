"""Multi-head latent attention (DeepSeek-V3, Kimi K2): mlx-lm's `DeepseekV3Attention`
under the model's names and masks, with `shard`.

Keys and values come from one small latent per token: `kv_a_proj_with_mqa` (dim ->
kv_lora_rank + qk_rope_head_dim) gives the latent c (normalised by `kv_a_layernorm`)
and one RoPE key k_pe that every head shares. A head's key and value are c through its
slice of the checkpoint's `kv_b_proj`, held as mlx-lm holds them: `embed_q`
(H, kv_lora_rank, qk_nope_head_dim) and `unembed_out` (H, v_head_dim, kv_lora_rank),
so that decoding attends in the latent space (the query absorbs `embed_q`) and prefill
expands the keys and values. The cache holds c and k_pe only: kv_lora_rank +
qk_rope_head_dim values per token and layer (DeepSeek-V3: 512 + 64), whatever the heads.

Split by heads (its split table, `LatentAttention.split_table`): the rows of q_b_proj
(or wq) and the heads of embed_q / unembed_out, wo by columns; the latent projections and
norms are replicated, so every rank computes and caches the same latent as one process
(its cache spec: kv_lora_rank + qk_rope_head_dim values per token, whole).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention
from mlx_lm.models.deepseek_v3 import DeepseekV3Attention
from mlx_lm.models.deepseek_v3 import ModelArgs as DeepseekV3Args

from ..model_args import ModelArgs
from ..parallel.kind_shard import ShardedByTable
from ..parallel.splits import COLUMNS, HEADS, ROWS, CacheSpec, SplitTable, TensorSplit


def deepseek_v3_args(args: ModelArgs) -> DeepseekV3Args:
    """mlx-lm's config of the attention and router pieces reused here."""
    return DeepseekV3Args(
        hidden_size=args.dim,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_heads,
        q_lora_rank=args.q_lora_rank or None,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=args.qk_rope_head_dim,
        qk_nope_head_dim=args.qk_nope_head_dim,
        v_head_dim=args.v_head_dim,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        rope_scaling=args.rope_scaling,
        n_routed_experts=args.n_experts,
        num_experts_per_tok=args.n_experts_per_tok,
        norm_topk_prob=args.norm_topk_prob,
        routed_scaling_factor=args.routed_scaling_factor,
        n_group=args.n_group,
        topk_group=args.topk_group,
    )


class LatentAttention(ShardedByTable, DeepseekV3Attention):
    """x (B, L, dim) -> (B, L, dim): mlx-lm's multi-head latent attention, its output
    projection named `wo` (and a direct query projection `wq`), with `n_heads` local."""

    # its own projections and norms under their own names (last among the kinds: the
    # projections every attention has are named by `Attention`)
    hf_names = (("self_attn", "attention"),)
    gguf_names = (
        ("attn_q_a_norm", "attention.q_a_layernorm"),
        ("attn_q_a", "attention.q_a_proj"),
        ("attn_q_b", "attention.q_b_proj"),
        ("attn_kv_a_norm", "attention.kv_a_layernorm"),
        ("attn_kv_a_mqa", "attention.kv_a_proj_with_mqa"),
        ("attn_kv_b", "attention.kv_b_proj"),
        ("attn_k_b", "attention.embed_q"),
        ("attn_v_b", "attention.unembed_out"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        """Query heads, any count per rank: their rows of q_b_proj (or wq), their (H, out,
        in) stacks of embed_q / unembed_out, wo's columns; the latent whole."""
        q_head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        return SplitTable(
            "latent attention",
            {
                "q_b_proj" if args.q_lora_rank else "wq": TensorSplit("q_heads", ROWS, q_head_dim),
                "embed_q": TensorSplit("q_heads", HEADS),
                "unembed_out": TensorSplit("q_heads", HEADS),
                "wo": TensorSplit("q_heads", COLUMNS, args.v_head_dim),
            },
            module="heads",
            plain_when_even=False,
        )

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        """The latent and the RoPE key, whole on every rank."""
        return CacheSpec("kv", (("", args.kv_lora_rank + args.qk_rope_head_dim),))

    def __init__(self, args: ModelArgs):
        super().__init__(deepseek_v3_args(args))
        object.__setattr__(self, "args", args)
        self.wo = self.pop("o_proj")  # the names every attention of the model uses
        if "q_proj" in self:
            self.wq = self.pop("q_proj")
        self.n_heads = self.n_kv_heads = args.n_heads  # set to the local heads by `shard`
        self.head_dim = args.v_head_dim

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, _ = x.shape
        q = self.wq(x) if "wq" in self else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, L, self.n_heads, self.q_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
        latent, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
        latent = mx.expand_dims(self.kv_a_layernorm(latent), axis=1)  # (B, 1, L, rank)
        offset = cache.offset if cache is not None else 0
        q_pe, k_pe = self.rope(q_pe, offset), self.rope(k_pe, offset)
        if isinstance(mask, str):  # "causal": the RoPE scores below need it as an array
            mask = create_causal_mask(L, offset)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        return self.attend(q_nope, q_pe, latent, k_pe, mask, cache, self.gate(x))

    def gate(self, x: mx.array) -> mx.array | None:
        """What the heads' merged output is multiplied by before `wo` (None: nothing;
        Kimi K3's output gate: `models/kimi_k3.py`)."""
        return None

    def attend(
        self,
        q_nope: mx.array,
        q_pe: mx.array,
        latent: mx.array,
        k_pe: mx.array,
        mask: Any,
        cache: Any,
        gate: mx.array | None = None,
    ) -> mx.array:
        """The heads' output (B, L, dim) from their queries (B, heads, L, *) and the cached
        latent (B, 1, S, rank) and RoPE keys (B, 1, S, rope), under `mask` (an array or
        None): RoPE scores added to the latent attention's, decoding in the latent space;
        the merged heads times `gate` (B, L, heads * v_head_dim) when given."""
        B, _, L, _ = q_nope.shape
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        if mask is not None:
            low = mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype)
            pe_scores = mx.where(mask, pe_scores, low)
        if L == 1:  # decoding: attend in the latent space
            q_nope = self.embed_q(q_nope)
            k = v = latent
        else:
            k = self.embed_q(latent, transpose=False)
            v = self.unembed_out(latent)
        out = scaled_dot_product_attention(
            q_nope, k, v, cache=cache, scale=self.scale, mask=pe_scores
        )
        if L == 1:
            out = self.unembed_out(out)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.wo(out if gate is None else out * gate)


def deepseek_v3_fields(config: dict) -> dict:
    """Latent attention and routing fields of a DeepSeek-V3 config (mlx-lm's defaults)."""
    d = DeepseekV3Args.from_dict(config)
    check_routing(d.topk_method, d.scoring_func)
    routed = d.n_routed_experts or 0
    freq = d.moe_layer_freq or 1
    sparse = [
        i
        for i in range(d.num_hidden_layers)
        if routed and i >= d.first_k_dense_replace and i % freq == 0
    ]
    return {
        "n_experts": routed,
        "n_experts_per_tok": d.num_experts_per_tok if routed else 0,
        "moe_hidden_dim": d.moe_intermediate_size,
        "shared_expert_dim": (d.n_shared_experts or 0) * d.moe_intermediate_size,
        "shared_expert_gated": False,
        "norm_topk_prob": bool(d.norm_topk_prob),
        "router": "sigmoid_group",
        "n_group": d.n_group,
        "topk_group": d.topk_group,
        "routed_scaling_factor": float(d.routed_scaling_factor),
        "sparse_layers": None if len(sparse) == d.num_hidden_layers else sparse,
        "kv_lora_rank": d.kv_lora_rank,
        "q_lora_rank": d.q_lora_rank or 0,
        "qk_nope_head_dim": d.qk_nope_head_dim,
        "qk_rope_head_dim": d.qk_rope_head_dim,
        "v_head_dim": d.v_head_dim,
    }


def check_routing(topk_method: str, scoring_func: str) -> None:
    if topk_method != "noaux_tc" or scoring_func != "sigmoid":
        raise ValueError(
            f"model config: routing {topk_method!r} with {scoring_func!r} scores is not "
            "supported (DeepSeek-V3's is 'noaux_tc' with 'sigmoid')"
        )
