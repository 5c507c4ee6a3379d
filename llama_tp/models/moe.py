"""The mixture-of-experts feed-forward (Mixtral, Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, gpt-oss).

A router picks `n_experts_per_tok` of `n_experts` SwiGLU experts for every token, and
their outputs are summed with the router's weights; Qwen2-MoE adds a shared expert
that every token goes through, behind a sigmoid gate (DeepSeek-V3: without a gate).
The experts are mlx-lm's `SwitchGLU`: all of them in one (E, out, in) tensor per
projection, applied with `mx.gather_mm` / `mx.gather_qmm`, the tokens sorted by expert
when there are many (prefill, batches), as mlx-lm does. Three routers:

    Mixtral:     top-k of the router's logits, softmax over those k (gpt-oss too, with a
                 router bias, and experts with biases behind the clamped SwiGLU)
    Qwen:        softmax over all experts, top-k, renormalised to 1 with norm_topk_prob
    DeepSeek-V3: sigmoid scores; the top-k of the scores plus a correction bias among
                 the best `topk_group` of `n_group` groups; their sigmoid scores,
                 renormalised with norm_topk_prob, times routed_scaling_factor
                 (mlx-lm's `MoEGate`: the router's `weight` and `e_score_correction_bias`)
    MiniMax:     the same selection without groups, from a linear `router` (quantized
                 as mlx-lm quantizes it) of float32 inputs and the block's own
                 `e_score_correction_bias`, as mlx-lm's `MiniMaxSparseMoeBlock`
                 (Step-3.5: its `router_bias`, times `routed_scaling_factor`)
    Llama 4:     top-1 of the router's logits, its sigmoid score scaling the expert's
                 input (not its output), beside an ungated shared expert (mlx-lm's
                 llama4 `MoE`)
    Kimi-Linear: DeepSeek-V3's selection (groups, renormalised, scaled) behind a
                 linear `router` and the block's own bias (mlx-lm's `KimiSparseMoE`)

Its split table (`MoEFeedForward.split_table`): every expert's gate/up rows and down
columns by "expert_ffn" (or whole experts, when the plan splits by expert), the shared
expert's by "shared_ffn", all kept in place and summed once (`parallel/experts.py`'s
styles); the router whole. Apart from `shard`, nothing here knows about ranks.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import SwigluOAI
from mlx_lm.models.deepseek_v3 import MoEGate, group_expert_select
from mlx_lm.models.kimi_linear import _group_expert_select as kimi_select
from mlx_lm.models.step3p5 import ClampedSwiGLU
from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU

from ..model_args import ModelArgs
from ..parallel.kind_shard import ShardedByTable
from ..parallel.splits import COLUMNS, ROWS, CacheSpec, SplitTable, TensorSplit
from .feed_forward import FeedForward
from .latent_attention import check_routing, deepseek_v3_args


class MoEFeedForward(ShardedByTable, nn.Module):
    """x (B, L, dim) -> (B, L, dim): `router` (dim -> E, replicated when sharded),
    `switch_mlp` (the E experts), and with `shared_expert_dim` a `shared_expert`
    FeedForward and, if `shared_expert_gated`, its `shared_expert_gate` (dim -> 1)."""

    counts_routes = True  # `record_expert_load` counts its routes in `expert_load`
    # Experts stacked as mlx-lm stores them (Mixtral's block after Qwen's; DeepSeek-V3's
    # shared experts one FeedForward of n_shared_experts experts' width; gpt-oss's router
    # and experts as mlx-lm names them)
    hf_names = (
        ("mlp.gate", "feed_forward.router"),
        ("mlp.switch_mlp", "feed_forward.switch_mlp"),
        ("mlp.shared_expert.gate_proj", "feed_forward.shared_expert.w1"),
        ("mlp.shared_expert.down_proj", "feed_forward.shared_expert.w2"),
        ("mlp.shared_expert.up_proj", "feed_forward.shared_expert.w3"),
        ("mlp.shared_expert_gate", "feed_forward.shared_expert_gate"),
        ("mlp.shared_experts.gate_proj", "feed_forward.shared_expert.w1"),
        ("mlp.shared_experts.down_proj", "feed_forward.shared_expert.w2"),
        ("mlp.shared_experts.up_proj", "feed_forward.shared_expert.w3"),
        ("block_sparse_moe.gate", "feed_forward.router"),
        # Kimi-Linear's release
        ("block_sparse_moe.shared_experts.gate_proj", "feed_forward.shared_expert.w1"),
        ("block_sparse_moe.shared_experts.down_proj", "feed_forward.shared_expert.w2"),
        ("block_sparse_moe.shared_experts.up_proj", "feed_forward.shared_expert.w3"),
        ("block_sparse_moe.switch_mlp", "feed_forward.switch_mlp"),
        ("block_sparse_moe.e_score_correction_bias$", "feed_forward.e_score_correction_bias"),
        ("mlp.e_score_correction_bias$", "feed_forward.e_score_correction_bias"),  # Kimi
        ("mlp.router", "feed_forward.router"),
        ("mlp.experts", "feed_forward.switch_mlp"),
    )
    gguf_names = (
        ("ffn_gate_inp", "feed_forward.router"),
        ("ffn_gate_exps", "feed_forward.switch_mlp.gate_proj"),
        ("ffn_up_exps", "feed_forward.switch_mlp.up_proj"),
        ("ffn_down_exps", "feed_forward.switch_mlp.down_proj"),
        ("ffn_gate_shexp", "feed_forward.shared_expert.w1"),
        ("ffn_up_shexp", "feed_forward.shared_expert.w3"),
        ("ffn_down_shexp", "feed_forward.shared_expert.w2"),
        ("ffn_gate_inp_shexp", "feed_forward.shared_expert_gate"),
        # DeepSeek-V3's routing bias: the name exactly
        ("exp_probs_b.bias$", "feed_forward.router.e_score_correction_bias"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        experts = {
            "switch_mlp.gate_proj": TensorSplit("expert_ffn", ROWS, stacked=True, in_place=True),
            "switch_mlp.up_proj": TensorSplit("expert_ffn", ROWS, stacked=True, in_place=True),
            "switch_mlp.down_proj": TensorSplit("expert_ffn", COLUMNS, stacked=True, in_place=True),
        }
        if args.shared_expert_dim:
            experts |= {
                "shared_expert.w1": TensorSplit("shared_ffn", ROWS, in_place=True),
                "shared_expert.w3": TensorSplit("shared_ffn", ROWS, in_place=True),
                "shared_expert.w2": TensorSplit("shared_ffn", COLUMNS, in_place=True),
            }
        return SplitTable("experts", experts, module="summed", plain_when_even=False)

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        return None

    def __init__(
        self, args: ModelArgs, clamp: float = 0.0, shared: nn.Module | None = None
    ) -> None:
        """`clamp` > 0: the experts' SwiGLU clamped at it (Step-3.5's); `shared`: the
        shared expert (default a FeedForward of `shared_expert_dim`)."""
        super().__init__()
        object.__setattr__(self, "args", args)
        self.n_experts, self.top_k = args.n_experts, args.n_experts_per_tok
        self.softmax_first = args.router == "softmax_topk"
        # Llama 4: the router's sigmoid score scales the expert's input
        self.scaled_input = args.router == "sigmoid_input"
        self.norm_topk_prob = args.norm_topk_prob
        if args.router == "sigmoid_group":
            self.router = MoEGate(deepseek_v3_args(args))
        else:
            self.router = nn.Linear(args.dim, args.n_experts, bias=args.expert_bias)
        if args.router in ("sigmoid_bias", "sigmoid_linear"):
            self.e_score_correction_bias = mx.zeros((args.n_experts,))
        # gpt-oss: the clamped SwiGLU (mlx-lm's), biases on every expert's projections
        act = SwigluOAI(limit=args.swiglu_limit) if args.activation == "swiglu_oai" else SwiGLU()
        if clamp > 0:
            act = ClampedSwiGLU(clamp)
        self.switch_mlp = SwitchGLU(
            args.dim, args.moe_hidden_dim, args.n_experts, activation=act, bias=args.expert_bias
        )
        if args.shared_expert_dim:
            self.shared_expert = shared or FeedForward(args, args.shared_expert_dim)
            if args.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False)
        # Tokens routed to each expert (E,), counted while `record_expert_load` is on.
        object.__setattr__(self, "expert_load", None)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The chosen experts of every token and their weights: (B, L, k) each."""
        if isinstance(self.router, MoEGate):
            return self.router(x)
        if self.args.router == "sigmoid_linear":  # Kimi: mlx-lm's kimi_linear selection
            a = self.args
            bias, groups = self.e_score_correction_bias, (a.n_group, a.topk_group)
            return kimi_select(self.router(x), bias, self.top_k, *groups,
                               a.routed_scaling_factor, a.norm_topk_prob, "sigmoid")  # fmt: skip
        if "e_score_correction_bias" in self:  # MiniMax: float32 gates, no groups
            gates = self.router(x.astype(mx.float32))
            bias, k = self.e_score_correction_bias, self.top_k
            inds, scores = group_expert_select(gates, bias, k, 1, 1, 1.0, False)
            if self.norm_topk_prob:
                scores = scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-20)  # as mlx-lm's
            scores = scores * self.args.routed_scaling_factor  # (Step-3.5's; MiniMax: 1)
            return inds, scores.astype(x.dtype)
        gates = self.router(x)
        k = self.top_k
        if self.scaled_input:  # Llama 4: top-1, its sigmoid score (in float32)
            inds = mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k]
            scores = mx.take_along_axis(gates, inds, axis=-1)
            return mx.stop_gradient(inds), mx.sigmoid(scores.astype(mx.float32)).astype(x.dtype)
        if self.softmax_first:
            gates = mx.softmax(gates, axis=-1, precise=True)
            inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
            scores = mx.take_along_axis(gates, inds, axis=-1)
            if self.norm_topk_prob:
                scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        else:
            inds = mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k]
            scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
        return mx.stop_gradient(inds), scores

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.route(x)
        if self.expert_load is not None:
            counts = mx.zeros((self.n_experts,), mx.int32).at[inds.flatten()].add(1)
            object.__setattr__(self, "expert_load", self.expert_load + counts)
        if self.scaled_input:  # (top-1: scores (B, L, 1) scale x (B, L, dim))
            y = self.switch_mlp(x * scores, inds).sum(axis=-2)
        else:
            y = self.switch_mlp(x, inds)  # (B, L, k, dim)
            y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
        if "shared_expert_gate" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif "shared_expert" in self:
            y = y + self.shared_expert(x)
        return y


def record_expert_load(model: nn.Module, on: bool = True) -> None:
    """Count the tokens routed to each expert of every MoE layer (a kind with
    `counts_routes`: its `expert_load` of `n_experts`) from now on (`on`), or stop
    counting; the counts start at zero."""
    for _, m in model.named_modules():
        if getattr(m, "counts_routes", False):
            zeros = mx.zeros((m.n_experts,), mx.int32) if on else None
            object.__setattr__(m, "expert_load", zeros)


def expert_load(model: nn.Module) -> list[list[int]]:
    """The counts `record_expert_load` has gathered: per MoE layer, tokens per expert."""
    layers = [m.expert_load for _, m in model.named_modules() if getattr(m, "counts_routes", False)]
    layers = [c for c in layers if c is not None]
    mx.eval(layers)
    return [c.tolist() for c in layers]


# -- config fields (the families' registry rows read them) -------------------------


def mixtral_fields(config: dict) -> dict:
    """Mixtral's experts from its config.json (top-k of the router's logits, softmax)."""
    return {
        "n_experts": config.get("num_local_experts", 8),
        "n_experts_per_tok": config.get("num_experts_per_tok", 2),
        "moe_hidden_dim": config["intermediate_size"],
        "router": "topk_softmax",
    }


def qwen_moe_fields(config: dict) -> dict:
    """Qwen2-MoE's and Qwen3-MoE's experts (every `decoder_sparse_step`-th layer but the
    `mlp_only_layers`), shared expert and routing from their config.json."""
    n_layers, step = config["num_hidden_layers"], config.get("decoder_sparse_step", 1) or 1
    dense = set(config.get("mlp_only_layers") or [])
    sparse = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
    return {
        "n_experts": config.get("num_experts", 0),
        "n_experts_per_tok": config.get("num_experts_per_tok", 0),
        "moe_hidden_dim": config.get("moe_intermediate_size", 0),
        # Qwen3-MoE has no shared expert: a config that carries the key anyway loads, as
        # in mlx-lm and transformers, which ignore it
        "shared_expert_dim": 0
        if config.get("model_type") == "qwen3_moe"
        else config.get("shared_expert_intermediate_size", 0),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "sparse_layers": None if len(sparse) == n_layers else sparse,
    }


def glm4_moe_fields(config: dict) -> dict:
    """GLM-4.5's fields: partial rotary, optional q/k norms, DeepSeek-V3's routing and
    shared experts, the first `first_k_dense_replace` layers dense (Hugging Face's
    defaults for the keys a config leaves out)."""
    check_routing(config.get("topk_method", "noaux_tc"), config.get("scoring_func", "sigmoid"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor = config.get("partial_rotary_factor", 0.5)
    routed = config["n_routed_experts"] or 0
    first = config.get("first_k_dense_replace", 1)
    n_layers = config["num_hidden_layers"]
    sparse = [i for i in range(n_layers) if routed and i >= first]
    return {
        "qk_norm": bool(config.get("use_qk_norm", False)),
        "rope_dims": int(head_dim * factor),
        "n_experts": routed,
        "n_experts_per_tok": config["num_experts_per_tok"] if routed else 0,
        "moe_hidden_dim": config["moe_intermediate_size"],
        "shared_expert_dim": (config.get("n_shared_experts", 1) or 0)
        * config["moe_intermediate_size"],
        "shared_expert_gated": False,
        "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
        "router": "sigmoid_group",
        "n_group": config.get("n_group", 1) or 1,
        "topk_group": config.get("topk_group", 1) or 1,
        "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        "sparse_layers": None if len(sparse) == n_layers else sparse,
    }
