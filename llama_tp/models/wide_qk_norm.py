"""MiniMax-M2's attention: the Llama attention with q/k RMS norms over the full width of
all heads (mlx-lm's `MiniMaxAttention`), and the family's config fields.

`q_norm` (weights of n_heads * head_dim) normalises each token's whole query row, and
`k_norm` (n_kv_heads * head_dim) its whole key row, before the heads are split out and
rotated (partial RoPE: the first `rotary_dim` values of each head). Unlike Qwen3's
per-head norms (`qk_norm.py`), the mean of squares runs across every head, so a rank
holding some heads cannot normalise them alone: split by heads, each rank sums the
squares of its own queries and keys in float32, one all-reduce of those two sums per
token (B, L, 2) gives the full rows' sums, and every rank divides by the full widths.
That is one extra small collective per attention layer (`bench` counts it). Any head
split is exact: a rank's norm weights are its heads' slices (the split table's VECTOR
entries, read sliced); a KV head held by several ranks (more ranks than KV groups, or
a group straddling two ranks) is counted by the first rank holding it only.

The feed-forward is MiniMax's experts: sigmoid scores plus a correction bias pick the
top-k, their sigmoid scores renormalised (`models/moe.py`'s "sigmoid_bias" router,
DeepSeek-V3's selection without groups behind a plain linear gate).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn

from ..model_args import ModelArgs
from ..parallel.kind_shard import PlanPart
from ..parallel.partition import RankPart
from ..parallel.splits import VECTOR, SplitTable, TensorSplit
from ..parallel.styles import PlanError
from .attention import Attention


class WideQKNormAttention(Attention):
    """x (B, L, dim) -> (B, L, dim), as `Attention`, with q and k RMS-normalised over all
    heads' values (`q_norm`, `k_norm`): across ranks once split (`take_heads`)."""

    hf_names = ()  # Qwen3's names (`qk_norm.py`): self_attn.q_norm / k_norm
    # llama.cpp's `minimax-m2` names are every attention's and expert's (attn_q_norm /
    # attn_k_norm as Qwen3's, one vector of all heads' values each); its routing bias,
    # exp_probs_b, is the feed-forward's own (mlx-lm's), not the router's (DeepSeek's)
    gguf_names = (("exp_probs_b.bias$", "feed_forward.e_score_correction_bias"),)

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        """The core attention's, and each norm's weights by its heads' values."""
        table = super().split_table(args)
        norms = {
            "q_norm.weight": TensorSplit("q_heads", VECTOR, args.head_dim),
            "k_norm.weight": TensorSplit("kv_heads", VECTOR, args.head_dim),
        }
        return replace(table, tensors={**table.tensors, **norms})

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.q_norm = nn.RMSNorm(args.n_heads * args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.n_kv_heads * args.head_dim, eps=args.norm_eps)
        # the full widths the means divide by, and once split: the group the sums of
        # squares are reduced over and the first local key value this rank counts
        object.__setattr__(self, "widths", (args.n_heads * args.head_dim, self.k_norm.weight.size))
        object.__setattr__(self, "group", None)
        object.__setattr__(self, "k_counted", 0)

    def take_heads(self, group: mx.distributed.Group, q: range, kv: range, counted: int) -> None:
        """Keep the norm weights of query heads `q` and KV heads `kv` (global ranges);
        the KV heads from local index `counted` on are this rank's in the sums."""
        hd = self.head_dim
        self.q_norm.weight = mx.contiguous(self.q_norm.weight[q.start * hd : q.stop * hd])
        self.k_norm.weight = mx.contiguous(self.k_norm.weight[kv.start * hd : kv.stop * hd])
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "k_counted", counted * hd)

    def shard(self, group: mx.distributed.Group, part: RankPart | PlanPart | None = None) -> None:
        """As `Attention.shard`, in equal blocks or by the placement's plan; a rank's own
        part alone cannot say which of its KV heads a lower rank counts: refused."""
        if isinstance(part, RankPart):
            raise PlanError("full-width q/k norms are split by the model's plan, not one part")
        super().shard(group, part)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # (B, L, heads * hd)
        q, k = self.norms(q, k)
        hd = self.head_dim
        return tuple(t.reshape(B, L, -1, hd).transpose(0, 2, 1, 3) for t in (q, k, v))

    def norms(self, q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
        """q (B, L, local q values), k (B, L, local k values), RMS-normalised over the
        full rows: mlx's fast norm in one process, else the all-reduced sums of squares."""
        if self.group is None:
            return self.q_norm(q), self.k_norm(k)
        sq = q.astype(mx.float32).square().sum(-1, keepdims=True)
        sk = k[..., self.k_counted :].astype(mx.float32).square().sum(-1, keepdims=True)
        sums = mx.distributed.all_sum(mx.concatenate([sq, sk], axis=-1), group=self.group)
        (wq, wk), (nq, nk) = self.widths, (self.q_norm, self.k_norm)
        return _scaled(q, sums[..., :1] / wq, nq), _scaled(k, sums[..., 1:] / wk, nk)


def _scaled(t: mx.array, mean: mx.array, norm: nn.RMSNorm) -> mx.array:
    """t (B, L, n) over rows whose mean square is `mean` (B, L, 1), times its weights (as
    mlx-lm's `ShardedRMSNorm`: in float32, back to t's dtype)."""
    return (t.astype(mx.float32) * mx.rsqrt(mean + norm.eps) * norm.weight).astype(t.dtype)


def minimax_fields(config: dict) -> dict:
    """MiniMax-M2's fields: partial rotary (`rotary_dim` of each head), the full-width q/k
    norms, its experts behind sigmoid scores with a correction bias (mlx-lm's defaults)."""
    scoring = config.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"model config: scoring_func {scoring!r} (MiniMax's is 'sigmoid')")
    if not config.get("use_qk_norm", True):
        raise ValueError("model config: MiniMax without use_qk_norm is not supported")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {
        "rope_dims": int(config.get("rotary_dim") or head_dim),
        "rope_scaling": None,  # mlx-lm's MiniMax rotates with plain RoPE whatever it says
        "n_experts": config["num_local_experts"],
        "n_experts_per_tok": config["num_experts_per_tok"],
        "moe_hidden_dim": config["intermediate_size"],
        "norm_topk_prob": True,
        "router": "sigmoid_bias",
        "extra": {"wide_qk_norm": True},
    }


def minimax_gguf_fields(get) -> dict:
    """The same fields from a GGUF file's `minimax-m2.*` metadata (llama.cpp's converter:
    rope.dimension_count is `rotary_dim`, expert_feed_forward_length the experts' width,
    expert_gating_func 2 (sigmoid) when the config said so; the q/k norms are the wide
    ones, not Qwen3's per-head norms the tensors' names alone would suggest)."""
    gating = get("expert_gating_func")
    if gating not in (None, 2):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ValueError(f"expert_gating_func {gating} (MiniMax's is 2, sigmoid)")
    experts, width = get("expert_count") or 0, get("expert_feed_forward_length") or 0
    if not experts or not width:
        raise ValueError(f"{experts} experts of width {width}")
    return {
        "rope_dims": get("rope.dimension_count") or 0,
        "rope_scaling": None,  # as `minimax_fields`
        "qk_norm": False,
        "n_experts": experts,
        "n_experts_per_tok": get("expert_used_count") or 0,
        "moe_hidden_dim": width,
        "shared_expert_dim": 0,
        "norm_topk_prob": True,
        "router": "sigmoid_bias",
        "sparse_layers": None,
        "extra": {"wide_qk_norm": True},
    }


def minimax_config(a: ModelArgs) -> dict:
    """MiniMax-M2's `config.json` keys (what `convert` writes)."""
    return {
        "num_local_experts": a.n_experts,
        "num_experts_per_tok": a.n_experts_per_tok,
        "shared_intermediate_size": 0,
        "rotary_dim": a.rope_dims or a.head_dim,
        "scoring_func": "sigmoid",
        "use_qk_norm": True,
    }
