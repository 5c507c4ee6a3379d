"""Kimi K3 (`kimi_k3`): fused Kimi delta attention, gated latent attention, SiTU, latent
experts and attention residuals: mlx-lm's `kimi_k3` under the model's names, with each
kind's split table.

What K3 adds to Kimi-Linear (`kimi_delta.py`, docs/kimi-linear.md):

    fused KDA         one `qkv_proj` and one short conv `qkv_conv` over q | k | v (split
                      by heads as segments, as Gated DeltaNet's in_proj_qkv / conv1d:
                      an ArraysCache of two), the decay bounded below
                      (`gated_delta_update(lower_bound=...)`), a full-rank output gate
                      `g_proj` (dim -> heads x d, split by rows) in place of g_a / g_b
    latent attention  queries through `q_lora_rank`, no RoPE, and an output gate:
                      sigmoid(g_proj(x)) times the merged heads before `wo` (g_proj's
                      rows split with the query heads)
    SiTU              in place of SiLU in every feed-forward and expert
                      (`latent_experts.py`)
    latent experts    the routed experts run in `routed_expert_hidden_size` values
                      between `routed_expert_down_proj` and `routed_expert_up_proj`, RMS
                      normed after the routed sum: split (by tensor or by expert), the
                      routed and shared partial sums are all-reduced together (the
                      experts' one all-reduce) *before* that norm (`latent_experts.py`)
    attention         every layer's input is a softmax mix of the block-start hidden
    residuals         states so far and the running partial sum (mlx-lm's
                      `ResidualBlocks`, `_attn_res_mix`), blocks of `attn_res_block_size`
                      layers; the model's output too. The block states go from layer to
                      layer as the layers' side input (`KimiK3Transformer.side_inputs`)

Nothing here knows about ranks: the styles the split tables give do.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.models.kimi_k3 import ResidualBlocks, _attn_res_mix
from mlx_lm.models.kimi_linear import ShortConv1d

from ..model import Transformer
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
from .blocks import TransformerBlock
from .kimi_delta import _CONVS, _NoRope, kimi_linear_fields, kimi_linear_gguf_fields
from .latent_attention import LatentAttention
from .latent_experts import LatentExperts, SituFeedForward


class FusedKimiDeltaAttention(ShardedByTable, nn.Module):
    """x (B, L, dim) -> (B, L, dim), over an ArraysCache [q | k | v conv state (B, K - 1,
    3 H d), delta-rule state (B, H, d, d) float32]: mlx-lm's `KimiK3DeltaAttention`."""

    # its tensors under the attention slot (`self_attn.` -> `attention.`, o_proj -> wo:
    # every attention's names); llama.cpp's (`kimi-k3`): q/k/v and their convs apart,
    # joined by `checkpoints/kimi_k3.py` as the release's
    hf_names = ()
    gguf_names = (
        *((f"ssm_conv1d_{c[0]}", f"attention.{c}.conv") for c in _CONVS),
        ("ssm_f_a", "attention.f_a_proj"),
        ("ssm_f_b", "attention.f_b_proj"),
        ("ssm_beta", "attention.b_proj"),
        ("ssm_g", "attention.g_proj"),
        ("ssm_norm", "attention.o_norm"),
        ("ssm_dt.bias$", "attention.dt_bias"),
        ("ssm_a$", "attention.A_log"),
    )

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        d = args.kda_head_dim
        qkv = (Segment("kda_heads", d),) * 3
        tensors = {
            "qkv_proj": TensorSplit(segments=qkv),
            "qkv_conv.conv": TensorSplit(segments=qkv, dim=CHANNELS),
            "f_b_proj": TensorSplit("kda_heads", ROWS, d),
            "g_proj" if args.kda_full_rank_gate else "g_b_proj": TensorSplit("kda_heads", ROWS, d),
            "b_proj": TensorSplit("kda_heads", ROWS),
            "A_log": TensorSplit("kda_heads", VECTOR),
            "dt_bias": TensorSplit("kda_heads", VECTOR, d),
            "wo": TensorSplit("kda_heads", COLUMNS, d),
        }
        local = {
            "num_heads": (("kda_heads", 1),),
            "projection_dim": (("kda_heads", d),),
            "qkv_conv.conv.groups": (("kda_heads", 3 * d),),
        }
        return SplitTable(
            "Kimi delta attention",
            tensors,
            module="units",
            units=(Unit("kda_heads", args.kda_heads, "Kimi delta attention heads"),),
            local=local,
        )

    @classmethod
    def cache_spec(cls, args: ModelArgs, layer: int) -> CacheSpec | None:
        d, taps = args.kda_head_dim, args.kda_conv_kernel - 1
        return CacheSpec(
            "arrays",
            fixed=(("kda_heads", 3 * d * taps),),
            fixed32=(("kda_heads", d * d),),
            size=2,
            mask="ssm",
            what="Kimi delta attention",
        )

    def __init__(self, args: ModelArgs):
        super().__init__()
        object.__setattr__(self, "args", args)  # (not a parameter) its split table's
        dim = args.dim
        self.num_heads, self.head_dim = h, d = args.kda_heads, args.kda_head_dim
        self.projection_dim = p = h * d
        self.conv_kernel = args.kda_conv_kernel
        self.lower_bound = args.kda_lower_bound
        self.qkv_proj = nn.Linear(dim, 3 * p, bias=False)
        self.qkv_conv = ShortConv1d(3 * p, self.conv_kernel)
        self.f_a_proj = nn.Linear(dim, d, bias=False)
        self.f_b_proj = nn.Linear(d, p, bias=False)
        self.b_proj = nn.Linear(dim, h, bias=False)
        if args.kda_full_rank_gate:
            self.g_proj = nn.Linear(dim, p, bias=False)
        else:
            self.g_a_proj = nn.Linear(dim, d, bias=False)
            self.g_b_proj = nn.Linear(d, p, bias=False)
        self.A_log = mx.zeros((h,))
        self.dt_bias = mx.zeros((p,))
        self.o_norm = nn.RMSNorm(d, eps=args.norm_eps)
        self.wo = nn.Linear(p, dim, bias=False)

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None) -> mx.array:
        B, T, _ = x.shape
        h, d, p = self.num_heads, self.head_dim, self.projection_dim
        lengths = cache.lengths if cache is not None else None
        state = cache[0] if cache is not None else None
        if state is None:
            state = mx.zeros((B, self.conv_kernel - 1, 3 * p), x.dtype)
        qkv, state = self.qkv_conv(self.qkv_proj(x), state, mask, lengths)
        if cache is not None:
            cache[0] = state
        q, k, v = (qkv[..., i * p : (i + 1) * p].reshape(B, T, h, d) for i in range(3))
        q, k = normalize_qk(q, k, inv_scale=d**-0.5, eps=1e-6)
        a = self.f_b_proj(self.f_a_proj(x)).reshape(B, T, h, d)
        out, state = gated_delta_update(
            q,
            k,
            v,
            a,
            self.b_proj(x),
            self.A_log.reshape(h, 1),
            self.dt_bias.reshape(h, d),
            state=cache[1] if cache is not None else None,
            mask=mask,
            use_kernel=not self.training,
            lower_bound=self.lower_bound,
        )
        if cache is not None:
            cache[1] = state
            cache.advance(T)
        gate = self.g_proj(x) if "g_proj" in self else self.g_b_proj(self.g_a_proj(x))
        gate = mx.sigmoid(gate.reshape(B, T, h, d))
        return self.wo((self.o_norm(out.reshape(B, T, h, d)) * gate).reshape(B, T, -1))


class GatedLatentAttention(LatentAttention):
    """K3's latent attention: `LatentAttention` without RoPE (mlx-lm's `KimiK3MLAAttention`,
    `mla_use_nope`), queries through `q_lora_rank`, and with `mla_use_output_gate` the
    merged heads times sigmoid(g_proj(x)) before `wo`."""

    hf_names = ()
    gguf_names = (("attn_gate", "attention.g_proj"),)  # llama.cpp's name of the gate

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        table = LatentAttention.split_table(args)
        if not args.mla_output_gate:
            return table
        gate = TensorSplit("q_heads", ROWS, args.v_head_dim)  # with the heads' outputs
        return replace(table, tensors={**table.tensors, "g_proj": gate})

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.rope = _NoRope()
        if args.mla_output_gate:
            self.g_proj = nn.Linear(args.dim, args.n_heads * args.v_head_dim, bias=False)

    def gate(self, x: mx.array) -> mx.array | None:
        return mx.sigmoid(self.g_proj(x)) if "g_proj" in self else None


def _w_eff(module: nn.Module, prefix: str) -> mx.array:
    """A residual mix's query (dim,), float32: the norm's weight times the projection's,
    or their product as a GGUF holds it (`{prefix}_score`: llama.cpp's converter fuses
    them)."""
    if f"{prefix}_score" in module:
        return module[f"{prefix}_score"].astype(mx.float32)
    norm, proj = module[f"{prefix}_norm"], module[f"{prefix}_proj"]
    return norm.weight.astype(mx.float32) * proj.weight.reshape(-1)


class KimiK3Layer(TransformerBlock):
    """Attention (fused KDA or gated latent) then SiTU feed-forward or latent experts;
    with `attn_res_block_size`, each half's input is mlx-lm's attention-residual mix of
    the block states so far (`blocks`, the layers' side input) and the running partial
    sum, and a block's first layer adds the partial sum it was given to the blocks."""

    # mlx-lm's names, and the release's (`self_attention_res.proj_weight`)
    hf_names = tuple(
        pair
        for r in ("self_attention_res", "mlp_res")
        for x in ("proj", "norm")
        for pair in ((f"{r}_{x}", f"{r}_{x}"), (f"{r}.{x}_weight$", f"{r}_{x}.weight"))
    )
    # llama.cpp's: each norm * proj as one vector (`args.attn_res_scores`)
    gguf_names = (
        ("attn_res_score.weight$", "self_attention_res_score"),
        ("ffn_res_score.weight$", "mlp_res_score"),
    )

    def __init__(self, args: ModelArgs, i: int):
        kinds = layer_kinds(args, i)
        super().__init__(args, kinds["attention"](args), kinds["feed_forward"](args), layer=i)
        self.eps = args.norm_eps
        size = args.attn_res_block_size
        self.is_block_start = bool(size) and i % size == 0
        if size and args.extra.get("attn_res_scores"):
            self.self_attention_res_score = mx.zeros((args.dim,))
            self.mlp_res_score = mx.zeros((args.dim,))
        elif size:
            self.self_attention_res_proj = nn.Linear(args.dim, 1, bias=False)
            self.self_attention_res_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
            self.mlp_res_proj = nn.Linear(args.dim, 1, bias=False)
            self.mlp_res_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def _feed_forward(self, x: mx.array) -> mx.array:
        ff = self.feed_forward
        return ff.finish(ff(x)) if isinstance(ff, LatentExperts) else ff(x)

    def __call__(
        self, x: mx.array, mask: Any = None, cache: Any = None, blocks: Any = None
    ) -> mx.array:
        if blocks is None:
            h = x + self.attention(self.attention_norm(x), mask, cache)
            return h + self._feed_forward(self.ffn_norm(h))
        w = _w_eff(self, "self_attention_res")
        h = _attn_res_mix(blocks, x, w, self.eps)
        partial = x
        if self.is_block_start:
            blocks.append(x)
            partial = None
        y = self.attention(self.attention_norm(h), mask, cache)
        partial = y if partial is None else partial + y
        w = _w_eff(self, "mlp_res")
        h = _attn_res_mix(blocks, partial, w, self.eps)
        return partial + self._feed_forward(self.ffn_norm(h))


class KimiK3Transformer(Transformer):
    """The K3 model: the layers' side input is the attention residuals' block states
    (`side_inputs`: empty ones, filled by the layers), and the final norm's input their
    mix with the last partial sum (`finish`, `output_attn_res_*`)."""

    # the last stage's (a GGUF's fused query: `output_attn_res_score`)
    head_modules = ("output_attn_res_proj", "output_attn_res_norm", "output_attn_res_score")

    def __init__(self, args: ModelArgs):
        super().__init__(args, [KimiK3Layer(args, i) for i in range(args.n_layers)])
        if args.attn_res_block_size and args.extra.get("attn_res_scores"):
            self.output_attn_res_score = mx.zeros((args.dim,))
        elif args.attn_res_block_size:
            self.output_attn_res_proj = nn.Linear(args.dim, 1, bias=False)
            self.output_attn_res_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def side_inputs(self, tokens: mx.array, h: mx.array) -> Any:
        return ResidualBlocks(self.args.norm_eps) if self.args.attn_res_block_size else None

    # A pipeline stage hands on h and every block state so far, (B, L, (1 + K) dim) as
    # mlx-lm packs them (its (K + 1, B, L, dim) send), K = the blocks begun before the
    # next stage's first layer; the receiver recomputes their inverse RMS, as mlx-lm's.

    def hand_off_width(self, layer: int) -> int:
        size = self.args.attn_res_block_size
        return -(-layer // size) * self.args.dim if size else 0

    def hand_off(self, h: mx.array, blocks: Any) -> mx.array:
        if blocks is None or blocks.raw is None:
            return h
        K, B, L, dim = blocks.raw.shape
        raw = blocks.raw.astype(h.dtype).moveaxis(0, 2).reshape(B, L, K * dim)
        return mx.concatenate([h, raw], axis=-1)

    def take_over(self, x: mx.array) -> tuple[mx.array, Any]:
        a = self.args
        if not a.attn_res_block_size:
            return x, None
        blocks, (B, L, width) = ResidualBlocks(a.norm_eps), x.shape
        if width > a.dim:
            raw = x[..., a.dim :].reshape(B, L, width // a.dim - 1, a.dim).moveaxis(2, 0)
            xf = raw.astype(mx.float32)
            blocks.raw, blocks.inv_rms = raw, mx.rsqrt((xf * xf).mean(axis=-1) + a.norm_eps)
        return x[..., : a.dim], blocks

    def finish(self, h: mx.array, blocks: Any) -> mx.array:
        """The last layer's partial sum h (B, L, dim) -> the final norm's input."""
        if blocks is None:
            return h
        w = _w_eff(self, "output_attn_res")
        return _attn_res_mix(blocks, h, w, self.args.norm_eps)

    # The forward is Transformer's (`hidden` runs `side_inputs`, the layers and `finish`).


def layer_kinds(args: ModelArgs, i: int) -> dict[str, type[nn.Module]]:
    """Layer `i`'s kinds: fused KDA in `kda_layers`, gated latent attention elsewhere;
    latent experts in the sparse layers, the SiTU feed-forward in the others."""
    attention = FusedKimiDeltaAttention if i in args.kda_layers else GatedLatentAttention
    feed_forward = LatentExperts if args.is_sparse(i) else SituFeedForward
    return {"attention": attention, "feed_forward": feed_forward}


# -- config fields (the family's registry row reads them) --------------------------


def kimi_k3_fields(config: dict) -> dict:
    """Kimi K3's fields from its config.json (or its `text_config`; mlx-lm's kimi_k3
    defaults): Kimi-Linear's (`kimi_linear_fields`) plus the queries' rank, the KDA
    decay's lower bound and full-rank gate, the latent attention's output gate, SiTU's
    betas, the latent experts' width and norm, the attention residuals' block size."""
    act = config.get("hidden_act", "situ")
    if act != "situ":
        raise ValueError(f"model config: hidden_act {act!r} (Kimi K3's is 'situ')")
    if not config.get("mla_use_nope", True):
        raise ValueError("model config: mla_use_nope false (Kimi K3's latent attention has none)")
    lin = config.get("linear_attn_config") or {}
    out = kimi_linear_fields({"num_experts_per_token": 16, **config})
    latent = config.get("routed_expert_hidden_size") or 0
    block = config.get("attn_res_block_size") or 0
    if block < 0:
        raise ValueError(f"model config: attn_res_block_size {block} (need a positive count)")
    out["q_lora_rank"] = config.get("q_lora_rank") or 0
    out["norm_eps"] = config.get("rms_norm_eps", 1e-5)  # mlx-lm's kimi_k3 default, not 1e-6
    out["extra"] |= {
        "kda_lower_bound": lin.get("gate_lower_bound"),
        "kda_full_rank_gate": bool(lin.get("use_full_rank_gate", False)),
        "mla_output_gate": bool(config.get("mla_use_output_gate", False)),
        "situ_beta": float(config.get("activation_situ_beta") or 1.0),
        "situ_linear_beta": config.get("activation_situ_linear_beta"),
        "routed_expert_hidden_size": latent,
        "latent_moe_norm": bool(latent and config.get("latent_moe_use_norm", False)),
        "attn_res_block_size": block,
    }
    return out


def kimi_k3_gguf_fields(get: Any) -> dict:
    """The same fields from a GGUF file's `kimi-k3.*` metadata (llama.cpp's converter):
    Kimi-Linear's (`kimi_linear_gguf_fields`: a KV head count per layer, 0 in a KDA layer)
    plus kda.gate_lower_bound, activation.situ_beta / situ_linear_beta (0 or less: none),
    expert_latent_length, attn_res.block_size; the residual queries as the converter's
    fused norm * proj vectors. The full-rank KDA gate is the only one llama.cpp reads;
    the latent attention's output gate and the latent norm are the reader's to confirm
    from the tensors (`checkpoints/kimi_k3.py`'s `k3_gguf`)."""
    gating = get("expert_gating_func")
    if get("expert_count") and gating not in (None, 2):  # 2: sigmoid
        raise ValueError(f"expert_gating_func {gating} (Kimi K3 routes by sigmoid, 2)")
    out = kimi_linear_gguf_fields(get)
    latent, linear = get("expert_latent_length") or 0, get("activation.situ_linear_beta")
    out["extra"] |= {
        "kda_lower_bound": get("kda.gate_lower_bound"),
        "kda_full_rank_gate": True,
        "mla_output_gate": True,
        "situ_beta": float(get("activation.situ_beta") or 1.0),
        "situ_linear_beta": float(linear) if linear is not None and linear > 0 else None,
        "routed_expert_hidden_size": latent,
        "latent_moe_norm": bool(latent),
        "attn_res_block_size": get("attn_res.block_size") or 0,
        "attn_res_scores": True,
    }
    return out
