"""Gated DeltaNet linear attention (Qwen3.5, Qwen3.6, Qwen3-Next): mlx-lm's layer under the
model's names, with its split table and its recurrent-state cache.

Per token, a fused projection gives the queries and keys of `nk` key heads (`dk` values
each) and the values of `nv` value heads (`dv` each, `nv / nk` per key head), a gate `z`
per value and two scalars per value head (`b`: the write strength, `a`: the decay).
q | k | v go through a causal depthwise convolution of `K` taps (its last K - 1 inputs
are the conv state), then each value head runs the gated delta rule over a (dv, dk)
matrix state S (mlx-lm's `gated_delta_update`: `S <- g S + k (beta (v - S k))^T`,
output `S q`); a gated RMSNorm and `out_proj` bring the heads back to the model width.
The state is fixed-size: (K - 1) x (2 nk dk + nv dv) conv values and nv x dv x dk
float32 delta-rule values per sequence, whatever its length (an `ArraysCache` of two).

Three projection layouts, chosen by the checkpoint (`args.linear_projections`):

    "qkv"     in_proj_qkv (q | k | v sections), in_proj_z, in_proj_b, in_proj_a  (Qwen3.5)
    "qkvz"    in_proj_qkvz, in_proj_ba, interleaved per key head               (Qwen3-Next)
    "qkv_ba"  in_proj_qkv, in_proj_z, in_proj_ba  (llama.cpp's qwen3next GGUF: attn_qkv,
              attn_gate, ssm_ba)

Split by heads (`GatedDeltaNet.split_table`): every rank holds whole key heads and the
value heads that follow them: its rows of each section of the fused projection
(segments), the conv channels of the same heads, `A_log` / `dt_bias` of its value heads,
`out_proj` by the same value heads' columns (one all-reduce), the gated norm whole. Its
conv and delta-rule state then hold only its heads. Apart from the styles its table
gives, nothing here knows about ranks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet, Qwen3NextRMSNormGated

from ..model_args import ModelArgs
from ..parallel.kind_shard import ShardedByTable
from ..parallel.splits import (
    CHANNELS,
    COLUMNS,
    ROWS,
    VECTOR,
    CacheSpec,
    Segment,
    SplitTable,
    TensorSplit,
    Unit,
)

LAYOUTS = ("qkv", "qkvz", "qkv_ba")


class GatedDeltaNet(ShardedByTable, nn.Module):
    """x (B, L, dim) -> (B, L, dim), over an ArraysCache [conv state (B, K - 1, conv_dim),
    delta-rule state (B, nv, dv, dk) float32] (see the module docstring)."""

    # Hugging Face / MLX: `linear_attn.*` in the attention slot of the layer
    hf_names = (("linear_attn", "attention"),)
    # llama.cpp's names (gguf-py's MODEL_TENSOR.SSM_* and ATTN_QKV / ATTN_GATE); the
    # readers turn ssm_a (-exp(A_log)) and the (C, K) conv back (`checkpoints/gated_delta`)
    gguf_names = (
        ("attn_qkv", "attention.in_proj_qkv"),
        ("attn_gate", "attention.in_proj_z"),
        ("ssm_beta", "attention.in_proj_b"),
        ("ssm_alpha", "attention.in_proj_a"),
        ("ssm_ba", "attention.in_proj_ba"),
        ("ssm_conv1d", "attention.conv1d"),
        ("ssm_dt.bias$", "attention.dt_bias"),
        ("ssm_a$", "attention.A_log"),
        ("ssm_norm", "attention.norm"),
        ("ssm_out", "attention.out_proj"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        nk, nv = args.linear_num_key_heads, args.linear_num_value_heads
        dk, dv, r = args.linear_key_head_dim, args.linear_value_head_dim, nv // nk
        qkv = (Segment("lin_k", dk), Segment("lin_k", dk), Segment("lin_v", dv))
        tensors = {
            "conv1d": TensorSplit(segments=qkv, dim=CHANNELS),
            "A_log": TensorSplit("lin_v", VECTOR),
            "dt_bias": TensorSplit("lin_v", VECTOR),
            "out_proj": TensorSplit("lin_v", COLUMNS, dv),
        }
        layout = args.linear_projections
        if layout == "qkvz":  # each key head's q, k, its values' v and z, together
            tensors["in_proj_qkvz"] = TensorSplit("lin_k", ROWS, 2 * dk + 2 * dv * r)
        else:
            tensors["in_proj_qkv"] = TensorSplit(segments=qkv)
            tensors["in_proj_z"] = TensorSplit("lin_v", ROWS, dv)
        if layout == "qkv":
            tensors["in_proj_b"] = TensorSplit("lin_v", ROWS)
            tensors["in_proj_a"] = TensorSplit("lin_v", ROWS)
        else:  # each key head's b then a, of its value heads
            tensors["in_proj_ba"] = TensorSplit("lin_k", ROWS, 2 * r)
        return SplitTable(
            "linear attention",
            tensors,
            module="units",
            units=(
                Unit("lin_k", nk, "linear-attention key heads"),
                Unit("lin_v", nv, "linear-attention value heads", follows="lin_k"),
            ),
            local={
                "num_k_heads": (("lin_k", 1),),
                "num_v_heads": (("lin_v", 1),),
                "key_dim": (("lin_k", dk),),
                "value_dim": (("lin_v", dv),),
                "conv_dim": (("lin_k", 2 * dk), ("lin_v", dv)),
                "conv1d.groups": (("lin_k", 2 * dk), ("lin_v", dv)),
            },
        )

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
        taps = args.linear_conv_kernel_dim - 1  # the conv state: its last K - 1 inputs
        return CacheSpec(
            "arrays",
            fixed=(("lin_k", 2 * dk * taps), ("lin_v", dv * taps)),
            fixed32=(("lin_v", dv * dk),),
            size=2,
            mask="ssm",
            what="Gated DeltaNet linear attention",
        )

    def __init__(self, args: ModelArgs):
        super().__init__()
        object.__setattr__(self, "args", args)  # (not a parameter) its split table's
        self.hidden_size = dim = args.dim
        self.num_k_heads = nk = args.linear_num_key_heads
        self.num_v_heads = nv = args.linear_num_value_heads
        self.head_k_dim = dk = args.linear_key_head_dim
        self.head_v_dim = dv = args.linear_value_head_dim
        self.key_dim, self.value_dim = dk * nk, dv * nv
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=0,
            bias=False,
        )
        layout = args.linear_projections
        if layout == "qkvz":
            self.in_proj_qkvz = nn.Linear(dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(dim, 2 * self.key_dim + self.value_dim, bias=False)
            self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
        if layout == "qkv":
            self.in_proj_b = nn.Linear(dim, nv, bias=False)
            self.in_proj_a = nn.Linear(dim, nv, bias=False)
        else:
            self.in_proj_ba = nn.Linear(dim, 2 * nv, bias=False)
        self.dt_bias = mx.ones(nv)
        self.A_log = mx.zeros(nv)
        self.norm = Qwen3NextRMSNormGated(dv, eps=args.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """x (B, S, dim) -> q | k | v (B, S, conv_dim), z (B, S, nv, dv), b and a (B, S, nv),
        the head counts the local ones."""
        B, S, _ = x.shape
        nk, nv, dv = self.num_k_heads, self.num_v_heads, self.head_v_dim
        if "in_proj_qkvz" in self:  # mlx-lm's Qwen3-Next ordering, on the local heads
            order = Qwen3NextGatedDeltaNet.fix_query_key_value_ordering
            q, k, v, z, b, a = order(self, self.in_proj_qkvz(x), self.in_proj_ba(x))
            qkv = mx.concatenate([t.reshape(B, S, -1) for t in (q, k, v)], axis=-1)
            return qkv, z, b, a
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(B, S, nv, dv)
        if "in_proj_ba" in self:  # per key head: its value heads' b, then their a
            b, a = mx.split(self.in_proj_ba(x).reshape(B, S, nk, -1), 2, axis=-1)
            return qkv, z, b.reshape(B, S, nv), a.reshape(B, S, nv)
        return qkv, z, self.in_proj_b(x), self.in_proj_a(x)

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        B, S, _ = x.shape
        qkv, z, b, a = self._project(x)
        taps = self.conv_kernel_size - 1
        if cache is not None and cache[0] is not None:
            conv_state = cache[0]
        else:
            conv_state = mx.zeros((B, taps, self.conv_dim), dtype=x.dtype)
        if mask is not None:  # left padding of a batch: nothing enters the conv
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        if cache is not None:
            if cache.lengths is not None:
                ends = mx.clip(cache.lengths, 0, S)
                positions = (ends[:, None] + mx.arange(taps))[..., None]
                cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
            else:
                cache[0] = mx.contiguous(conv_input[:, -taps:, :])
        conv_out = nn.silu(self.conv1d(conv_input))
        heads = (self.num_k_heads, self.num_k_heads, self.num_v_heads)
        dims = (self.head_k_dim, self.head_k_dim, self.head_v_dim)
        q, k, v = (
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1), heads, dims, strict=True
            )
        )
        state = cache[1] if cache else None
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        out, state = gated_delta_update(
            q, k, v, a, b, self.A_log, self.dt_bias, state, mask, use_kernel=not self.training
        )
        if cache is not None:
            cache[1] = state
            cache.advance(S)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))


# -- config fields (the families' registry rows read them) -------------------------


def _linear_layers(n_layers: int, interval: int, types: list[str] | None) -> list[int]:
    """The linear-attention layers: `layer_types` "linear_attention", or all but every
    `full_attention_interval`-th (mlx-lm's rule)."""
    if types is not None:
        if len(types) != n_layers:
            raise ValueError(f"model config: {len(types)} layer_types for {n_layers} layers")
        kinds = ("linear_attention", "full_attention")
        bad = [t for t in types if t not in kinds]
        if bad:
            raise ValueError(f"model config: layer type {bad[0]!r} (supported: {', '.join(kinds)})")
        return [i for i, t in enumerate(types) if t == "linear_attention"]
    if interval < 1:
        raise ValueError(f"model config: full_attention_interval {interval}: need at least 1")
    return [i for i in range(n_layers) if (i + 1) % interval]


def linear_fields(
    nk: int, nv: int, dk: int, dv: int, kernel: int, layers: list[int], layout: str
) -> dict:
    """The kind's own fields (`ModelArgs.extra`), checked: one line with the numbers."""
    if min(nk, nv, dk, dv, kernel) < 1:
        raise ValueError(
            f"model config: linear attention needs positive head counts, head dims and conv "
            f"kernel, got {nk} key / {nv} value heads of {dk} / {dv}, kernel {kernel}"
        )
    if nv % nk:
        raise ValueError(
            f"model config: {nv} linear-attention value heads are not a multiple of {nk} key heads"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"linear attention projections {layout!r}: expected one of {LAYOUTS}")
    return {
        "linear_num_key_heads": nk,
        "linear_num_value_heads": nv,
        "linear_key_head_dim": dk,
        "linear_value_head_dim": dv,
        "linear_conv_kernel_dim": kernel,
        "linear_layers": layers,
        "linear_projections": layout,
    }


def qwen3_5_fields(config: dict) -> dict:
    """Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`) and Qwen3-Next (`qwen3_next`) from their
    config.json (its language model's, `text_config`, already lifted): the linear-attention
    layers, the output-gated full attention's partial RoPE, the experts (every layer's of
    Qwen3.5; Qwen3-Next's by `decoder_sparse_step` and `mlp_only_layers`) and their
    shared expert behind a sigmoid gate, with mlx-lm's defaults."""
    from .moe import qwen_moe_fields

    n_layers = config["num_hidden_layers"]
    next_ = config["model_type"] == "qwen3_next"
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    layers = _linear_layers(
        n_layers, config.get("full_attention_interval", 4), config.get("layer_types")
    )
    extra = linear_fields(
        config.get("linear_num_key_heads", 16),
        config.get("linear_num_value_heads", 32 if next_ else 64),
        config.get("linear_key_head_dim", 128 if next_ else 192),
        config.get("linear_value_head_dim", 128),
        config.get("linear_conv_kernel_dim", 4),
        layers,
        "qkvz" if next_ else "qkv",
    )
    out = {"rope_dims": int(head_dim * factor), "qk_norm": True, "extra": extra}
    if config.get("num_experts"):
        moe = qwen_moe_fields({"norm_topk_prob": not next_, **config})
        if not next_:  # mlx-lm's qwen3_5: experts in every layer
            moe["sparse_layers"] = None
        out |= moe
    return out


def qwen3_5_gguf_fields(get: Any, arch: str) -> dict:
    """The same fields from a GGUF file's `{arch}.*` metadata (llama.cpp's converter:
    ssm.group_count key heads, ssm.time_step_rank value heads, ssm.state_size their
    key width, ssm.inner_size all values, ssm.conv_kernel, full_attention_interval,
    rope.dimension_count)."""
    nk, nv = get("ssm.group_count") or 0, get("ssm.time_step_rank") or 0
    dk, inner = get("ssm.state_size") or 0, get("ssm.inner_size") or 0
    n_layers = (get("block_count") or 0) - (get("nextn_predict_layers") or 0)
    layers = _linear_layers(n_layers, get("full_attention_interval", 4), None)
    layout = "qkv_ba" if arch == "qwen3next" else "qkv"
    extra = linear_fields(nk, nv, dk, inner // nv if nv else 0, get("ssm.conv_kernel") or 0,
                          layers, layout)  # fmt: skip
    return {"rope_dims": get("rope.dimension_count") or 0, "qk_norm": True, "extra": extra}


def qwen3_5_config(a: ModelArgs) -> dict:
    """The family's config.json keys `convert` writes (mlx-lm's qwen3_5 / qwen3_next read
    them): the linear attention's, the layer pattern, partial RoPE, the experts'."""
    n, linear = a.n_layers, a.linear_layers
    if a.linear_projections == "qkv_ba":
        raise ValueError(
            "a qwen3next GGUF's linear attention (attn_qkv, attn_gate, ssm_ba) has no "
            "mlx-lm layout to write: run the GGUF file itself, or pre-split it with --shards"
        )
    interval = next(
        (k for k in range(1, n + 1) if linear == [i for i in range(n) if (i + 1) % k]), None
    )
    if interval is None:  # mlx-lm reads full_attention_interval only
        raise ValueError(f"linear-attention layers {linear} are not every layer but each k-th")
    out = {
        "linear_num_key_heads": a.linear_num_key_heads,
        "linear_num_value_heads": a.linear_num_value_heads,
        "linear_key_head_dim": a.linear_key_head_dim,
        "linear_value_head_dim": a.linear_value_head_dim,
        "linear_conv_kernel_dim": a.linear_conv_kernel_dim,
        "full_attention_interval": interval,
        "layer_types": ["linear_attention" if i in linear else "full_attention" for i in range(n)],
        "partial_rotary_factor": a.rope_dims / a.head_dim,
    }
    if a.model_type != "qwen3_next":
        factor = a.rope_dims / a.head_dim
        out["rope_parameters"] = {"type": "default", "rope_theta": a.rope_theta,
                                  "partial_rotary_factor": factor}  # fmt: skip
    if a.n_experts:
        sparse = [i for i in range(n) if a.is_sparse(i)]
        out |= {
            "num_experts": a.n_experts,
            "num_experts_per_tok": a.n_experts_per_tok,
            "moe_intermediate_size": a.moe_hidden_dim,
            "shared_expert_intermediate_size": a.shared_expert_dim,
            "norm_topk_prob": a.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(n) if i not in sparse],
        }
    return out
