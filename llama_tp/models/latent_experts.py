"""Kimi K3's feed-forward kinds: the SiTU feed-forward and the latent experts (mlx-lm's
`kimi_k3` `KimiK3MLP` and `KimiK3SparseMoE` under the model's names).

SiTU (mlx-lm's `_situ` / `SiTU`): beta tanh(gate / beta) sigmoid(gate) times linear_beta
tanh(up / linear_beta), in place of SwiGLU's silu(gate) * up, in the dense feed-forward,
the shared experts and the routed ones (in `SwitchGLU`'s activation slot).

Latent experts: the routed experts run in `routed_expert_hidden_size` values between
`routed_expert_down_proj` (dim -> latent) and `routed_expert_up_proj`, their weighted sum
RMS-normed (`routed_expert_norm`) before the up projection; a shared expert on x beside
them. Split (by tensor or by expert: `MoEFeedForward`'s table and style), each rank's
routed sum is a partial sum, and the norm needs the whole sum: `LatentExperts` returns
the routed and shared partial sums side by side, which the experts' style all-reduces
once, and `finish` norms, projects and adds them (mlx-lm's `shard()` reduces the same
two in one all-reduce). The projections and the norm are whole on every rank.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.kimi_k3 import SiTU, _situ
from mlx_lm.models.kimi_k3 import _group_expert_select as k3_select
from mlx_lm.models.switch_layers import SwitchGLU

from ..model_args import ModelArgs
from ..parallel.fused import GATE_UP, fused
from .feed_forward import FeedForward
from .moe import MoEFeedForward


class SituFeedForward(FeedForward):
    """x (B, L, dim) -> (B, L, dim): the gated feed-forward with SiTU (mlx-lm's `_situ`)
    in place of SiLU; split as the core's (`FeedForward`)."""

    hf_names = ()
    gguf_names = ()

    def __init__(self, args: ModelArgs, hidden_dim: int | None = None):
        super().__init__(args, hidden_dim)
        self.beta, self.linear_beta = args.situ_beta, args.situ_linear_beta

    def __call__(self, x: mx.array) -> mx.array:
        gate_up = fused(self, GATE_UP, x)  # one product when fused (parallel/fused.py)
        gate, up = gate_up if gate_up is not None else (self.w1(x), self.w3(x))
        return self.w2(_situ(up, gate, self.beta, self.linear_beta))


class LatentExperts(MoEFeedForward):
    """x (B, L, dim) -> the experts' partial sums (B, L, latent [+ dim]): the routed
    experts' weighted sum in the latent width (after `routed_expert_down_proj`) beside
    the shared experts' output, which the experts' style sums over the ranks; `finish`
    then norms the routed part (`routed_expert_norm`), projects it up and adds the
    shared part. Routing as mlx-lm's `KimiK3SparseMoE` (sigmoid + correction bias,
    groups, renormalised, scaled); SiTU experts. Without a latent width it is the plain
    routed sum plus the shared experts."""

    # under `mlp.` (mlx-lm's) or `block_sparse_moe.` (the release's; its routing bias in
    # its gate; the rest of the release's names are `MoEFeedForward`'s)
    hf_names = (
        ("block_sparse_moe.gate.e_score_correction_bias$", "feed_forward.e_score_correction_bias"),
        *(
            (f"{block}.{n}", f"feed_forward.{n}")
            for block in ("mlp", "block_sparse_moe")
            for n in ("routed_expert_down_proj", "routed_expert_up_proj", "routed_expert_norm")
        ),
    )
    # llama.cpp's (`kimi-k3`); the experts' and shared experts' are MoEFeedForward's
    gguf_names = (
        ("exp_probs_b.bias$", "feed_forward.e_score_correction_bias"),
        ("ffn_routed_down", "feed_forward.routed_expert_down_proj"),
        ("ffn_routed_up", "feed_forward.routed_expert_up_proj"),
        ("ffn_routed_norm", "feed_forward.routed_expert_norm"),
    )

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        object.__setattr__(self, "args", args)
        dim, latent = args.dim, args.routed_expert_hidden_size
        self.n_experts, self.top_k = args.n_experts, args.n_experts_per_tok
        self.router = nn.Linear(dim, args.n_experts, bias=False)
        self.e_score_correction_bias = mx.zeros((args.n_experts,))
        act = SiTU(args.situ_beta, args.situ_linear_beta)
        self.switch_mlp = SwitchGLU(latent or dim, args.moe_hidden_dim, args.n_experts, act)
        if latent:
            self.routed_expert_down_proj = nn.Linear(dim, latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent, dim, bias=False)
            if args.latent_moe_norm:
                self.routed_expert_norm = nn.RMSNorm(latent, eps=args.norm_eps)
        if args.shared_expert_dim:
            self.shared_expert = SituFeedForward(args, args.shared_expert_dim)
        object.__setattr__(self, "expert_load", None)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        a = self.args
        return k3_select(self.router(x), self.e_score_correction_bias, self.top_k, a.n_group,
                         a.topk_group, a.routed_scaling_factor, a.norm_topk_prob)  # fmt: skip

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.route(x)
        if self.expert_load is not None:
            counts = mx.zeros((self.n_experts,), mx.int32).at[inds.flatten()].add(1)
            object.__setattr__(self, "expert_load", self.expert_load + counts)
        y = self.routed_expert_down_proj(x) if "routed_expert_down_proj" in self else x
        y = (self.switch_mlp(y, inds) * scores[..., None]).sum(axis=-2)
        if "shared_expert" not in self:
            return y
        return mx.concatenate([y, self.shared_expert(x)], axis=-1)

    def finish(self, y: mx.array) -> mx.array:
        """The summed partials (B, L, latent [+ dim]) -> the block's output (B, L, dim)."""
        shared = None
        if "shared_expert" in self:
            y, shared = mx.split(y, [self.args.routed_expert_hidden_size or self.args.dim], -1)
        if "routed_expert_norm" in self:
            y = self.routed_expert_norm(y)
        if "routed_expert_up_proj" in self:
            y = self.routed_expert_up_proj(y)
        return y if shared is None else y + shared
