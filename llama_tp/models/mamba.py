"""The Mamba-2 mixer (Nemotron-H's recurrent layers): mlx-lm's `NemotronHMamba2Mixer`
under the model's names, with its split table and its recurrent-state cache.

Per token, one fused projection `in_proj` gives three sections, [z | xBC | dt]: the gate
z (nh heads of hd values), xBC = [x | B | C] (x: the same heads' values; B and C: ds
values per group of `n_groups`, each group serving nh / n_groups consecutive heads),
and one dt per head. xBC goes through a causal depthwise convolution of K taps (its
last K - 1 inputs are the conv state); each head then runs the selective scan over an
(hd, ds) state with its group's B and C (mlx-lm's `ssm_update`: on the CPU its chunked
`ssm_attn`); a gated RMSNorm per group (`MambaRMSNormGated`: silu(z) * y, normalised
over each group's nh / n_groups * hd values) and `out_proj` bring the heads back to the
model width. The state is fixed-size: (K - 1) x (nh hd + 2 n_groups ds) conv values
and nh x hd x ds float32 scan values per sequence (an `ArraysCache` of two).

Split by heads (`Mamba2Mixer.split_table`), groups kept whole: a rank holds whole groups
and the heads of those groups (the unit `ssm_heads` in steps of a group's heads), so
its rows of each section of `in_proj` (segments: its z, x, B, C and dt rows), the conv
channels of its x, B and C, `A_log` / `D` / `dt_bias` and the gated norm's weights of
its heads, `out_proj` by the same heads' columns (one all-reduce). The gated norm's
groups are then all on the rank: exact with no collective. With one group
(`n_groups` 1), heads split anywhere and every rank holds the group's B and C; the
norm's one group then spans the ranks: each rank's sum of squares is all-reduced (one
small collective per layer, `take_units`). Apart from the styles its table gives and
that sum, nothing here knows about ranks.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.nemotron_h import MambaRMSNormGated, NemotronHMamba2Mixer

from ..model_args import ModelArgs
from ..parallel.kind_shard import ShardedByTable
from ..parallel.splits import (
    CHANNELS,
    COLUMNS,
    VECTOR,
    CacheSpec,
    Segment,
    SplitTable,
    TensorSplit,
    Unit,
)


class GroupNorm(MambaRMSNormGated):
    """mlx-lm's gated RMSNorm per group; with `group` set (one group split over the
    ranks), the group's sum of squares all-reduced over it and divided by `width`."""

    def __init__(self, hidden_size: int, eps: float, group_size: int):
        super().__init__(hidden_size, eps, group_size)
        object.__setattr__(self, "group", None)

    def __call__(self, x: mx.array, gate: mx.array | None = None) -> mx.array:
        if self.group is None:
            return super().__call__(x, gate)
        x = swiglu(gate, x)  # (B, L, local heads * hd), of the one group
        x32 = x.astype(mx.float32)
        sums = mx.distributed.all_sum(x32.square().sum(-1, keepdims=True), group=self.group)
        normed = (x32 * mx.rsqrt(sums / self.group_size + self.eps)).astype(x.dtype)
        return self.weight * normed


class Mamba2Mixer(ShardedByTable, NemotronHMamba2Mixer):
    """x (B, L, dim) -> (B, L, dim), over an ArraysCache [conv state (B, K - 1, conv_dim),
    scan state (B, nh, hd, ds) float32] (see the module docstring); mlx-lm's forward."""

    # mlx-lm / Hugging Face: `backbone.layers.N.mixer.*` and the block's `norm`, as the
    # model names them (this and the family's other one-mixer kinds: mlx-lm's names;
    # tried after the attention's own, `Family.kinds`)
    hf_names = (("mixer", "mixer"), ("norm", "norm"))
    # llama.cpp's (gguf-py's NEMOTRON_H tensors); the reader turns ssm_conv1d (C, K),
    # ssm_a (-exp(A_log)) and ssm_d (nh, 1) and ssm_norm (groups, width) back
    # (`checkpoints/gguf_mamba.py`)
    gguf_names = (
        ("attn_norm", "norm"),
        ("ssm_in", "mixer.in_proj"),
        ("ssm_conv1d", "mixer.conv1d"),
        ("ssm_dt.bias$", "mixer.dt_bias"),
        ("ssm_a$", "mixer.A_log"),
        ("ssm_d$", "mixer.D"),
        ("ssm_norm", "mixer.norm"),
        ("ssm_out", "mixer.out_proj"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        nh, hd, ng, ds = args.mamba_num_heads, args.mamba_head_dim, args.n_groups, args.ssm_state
        xbc = (Segment("ssm_heads", hd), Segment("ssm_groups", ds), Segment("ssm_groups", ds))
        tensors = {
            # [z | x | B | C | dt]: each section by this rank's heads or groups
            "in_proj": TensorSplit(segments=(Segment("ssm_heads", hd), *xbc, Segment("ssm_heads"))),
            "conv1d": TensorSplit(segments=xbc, dim=CHANNELS),
            "A_log": TensorSplit("ssm_heads", VECTOR),
            "D": TensorSplit("ssm_heads", VECTOR),
            "dt_bias": TensorSplit("ssm_heads", VECTOR),
            "norm.weight": TensorSplit("ssm_heads", VECTOR, hd),
            "out_proj": TensorSplit("ssm_heads", COLUMNS, hd),
        }
        conv = (("ssm_heads", hd), ("ssm_groups", 2 * ds))
        return SplitTable(
            "Mamba-2",
            tensors,
            module="units",
            units=(
                # whole groups per rank (a group's heads a step); one group: any heads
                Unit("ssm_heads", nh, "Mamba heads", step=nh // ng if ng > 1 else 1),
                Unit("ssm_groups", ng, "Mamba groups", follows="ssm_heads"),
            ),
            local={
                "num_heads": (("ssm_heads", 1),),
                "n_groups": (("ssm_groups", 1),),
                "intermediate_size": (("ssm_heads", hd),),
                "conv_dim": conv,
                "conv1d.groups": conv,
            },
        )

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        hd, ds, taps = args.mamba_head_dim, args.ssm_state, args.conv_kernel - 1
        return CacheSpec(
            "arrays",
            fixed=(("ssm_heads", hd * taps), ("ssm_groups", 2 * ds * taps)),
            fixed32=(("ssm_heads", hd * ds),),
            size=2,
            mask="ssm",
            what="Mamba-2",
        )

    def __init__(self, args: ModelArgs):
        super().__init__(mlx_lm_args(args))
        object.__setattr__(self, "args", args)  # (not a parameter) its split table's
        self.norm = GroupNorm(self.intermediate_size, args.norm_eps, self.norm.group_size)
        object.__setattr__(self, "total_heads", args.mamba_num_heads)
        object.__setattr__(self, "total_groups", args.n_groups)

    def take_units(self, group: mx.distributed.Group) -> None:
        """After the split (`LocalUnits`): one group whose heads this rank holds only
        some of normalises over the ranks' sum."""
        if self.total_groups == 1 and self.num_heads < self.total_heads:
            object.__setattr__(self.norm, "group", group)

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        return super().__call__(x, mask, cache)


def mlx_lm_args(args: ModelArgs) -> SimpleNamespace:
    """The attributes mlx-lm's Nemotron-H classes read, from `args`."""
    return SimpleNamespace(
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        mamba_num_heads=args.mamba_num_heads,
        mamba_head_dim=args.mamba_head_dim,
        mamba_proj_bias=args.mamba_proj_bias,
        ssm_state_size=args.ssm_state,
        conv_kernel=args.conv_kernel,
        n_groups=args.n_groups,
        use_conv_bias=args.use_conv_bias,
        layer_norm_epsilon=args.norm_eps,
        time_step_limit=tuple(args.time_step_limit),
        mlp_bias=args.mlp_bias,
        moe_intermediate_size=args.moe_hidden_dim,
        moe_shared_expert_intermediate_size=args.shared_expert_dim,
        n_shared_experts=1 if args.shared_expert_dim else None,
        moe_latent_size=None,
        n_routed_experts=args.n_experts,
        num_experts_per_tok=args.n_experts_per_tok,
        norm_topk_prob=args.norm_topk_prob,
        routed_scaling_factor=args.routed_scaling_factor,
        n_group=args.n_group,
        topk_group=args.topk_group,
    )
