"""Gemma 3 (`gemma3_text`) and Gemma 4 (`gemma4_text`, dense and MoE): the layer, the
model around it and their config fields.

A Gemma layer is sandwiched: a norm before and after the attention and before and after
the feed-forward (GeGLU: gelu(gate) * up), each added to the residual; Gemma 4 then
scales the layer's output by its `layer_scalar`. Its MoE layers (the 26B) run the dense
GeGLU and the experts side by side, each with its own norms, and add them; the
experts' router (mlx-lm's `Router`: RMS-normed input, softmax over the top-k, a scale
per expert) reads the layer's input itself. The embeddings are scaled by sqrt(dim)
(also the rows the sampler hands on: `embed` takes `input_embeddings` as the lookup),
and Gemma 4 caps the logits (tanh(x / c) * c). Gemma 4's small models add per-layer
inputs: a (vocab, layers * ple) embedding and a projection of the scaled embedding
give every layer `ple` values per token (`side_inputs`), which the layer gates with
its hidden state and projects back (`per_layer_*`); a pipeline's first stage makes them
and hands them on beside h (`side_width`). The attention kinds: `gemma_attention.py`.

Splits: attention by heads, the dense GeGLU by columns (a double-wide layer's twice as
many per rank), the experts by tensor or by expert, one all-reduce each (a MoE layer's
dense and expert halves are normed apart, so they are summed apart: three per layer);
the per-layer embedding by vocabulary rows like the embedding (one all-reduce per
step), the per-layer gates and projections (small) and every norm whole.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma3_text import ModelArgs as Gemma3Args
from mlx_lm.models.gemma3_text import RMSNorm as OnePlusRMSNorm
from mlx_lm.models.gemma3_text import clip_residual
from mlx_lm.models.gemma4_text import GeGLU, Router, logit_softcap
from mlx_lm.models.gemma4_text import ModelArgs as Gemma4Args
from mlx_lm.models.switch_layers import SwitchGLU

from ..model import Transformer
from ..model_args import ModelArgs, layer_values
from ..parallel.splits import LayerSpec, SplitTable
from .feed_forward import FeedForward
from .gemma_attention import GemmaAttention, GemmaGlobalAttention, link_kv_sources
from .moe import MoEFeedForward


class GeGLUFeedForward(FeedForward):
    """x (B, L, dim) -> (B, L, dim): Gemma's gated feed-forward, gelu(w1 x) * w3 x."""

    hf_names = ()  # the core feed-forward's
    gguf_names = ()

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(nn.gelu_approx(self.w1(x)) * self.w3(x))


class WideGeGLUFeedForward(GeGLUFeedForward):
    """Gemma 4's double-wide feed-forward of its KV-shared layers: 2 * hidden_dim columns,
    split as the others' (two per column of theirs, so that one partition serves both)."""

    @classmethod
    def split_table(cls, args: ModelArgs) -> SplitTable:
        table = super().split_table(args)
        return replace(table, tensors={k: replace(e, width=2) for k, e in table.tensors.items()})

    def __init__(self, args: ModelArgs):
        super().__init__(args, 2 * args.hidden_dim)


class GemmaExperts(MoEFeedForward):
    """x (B, L, dim) -> (B, L, dim): Gemma 4's experts (mlx-lm's `Router` on x, GeGLU
    experts on the normed x `pre_norm(x)`), split as any experts (`MoEFeedForward`)."""

    hf_names = ()  # the family's own (`GEMMA_HF_NAMES`)
    gguf_names = ()

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        object.__setattr__(self, "args", args)
        self.n_experts, self.top_k = args.n_experts, args.n_experts_per_tok
        config = Gemma4Args(
            hidden_size=args.dim,
            num_experts=args.n_experts,
            top_k_experts=args.n_experts_per_tok,
            rms_norm_eps=args.norm_eps,
        )
        self.router = Router(config)
        self.pre_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.switch_mlp = SwitchGLU(
            args.dim, args.moe_hidden_dim, args.n_experts, activation=GeGLU(), bias=False
        )
        object.__setattr__(self, "expert_load", None)

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.router(x)

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.route(x)
        if self.expert_load is not None:
            counts = mx.zeros((self.n_experts,), mx.int32).at[inds.flatten()].add(1)
            object.__setattr__(self, "expert_load", self.expert_load + counts)
        y = self.switch_mlp(self.pre_norm(x), inds)
        return (mx.expand_dims(scores, -1) * y).sum(-2)


def layer_kinds(args: ModelArgs, i: int) -> dict[str, type[nn.Module]]:
    """Layer `i`'s mixer kinds by slot (`registry.layer_kinds` for a Gemma family)."""
    global_ = args.gemma == 4 and args.layer_types[i] == "full_attention"
    kinds: dict[str, type[nn.Module]] = {
        "attention": GemmaGlobalAttention if global_ else GemmaAttention,
        "feed_forward": WideGeGLUFeedForward if args.wide[i] else GeGLUFeedForward,
    }
    if args.n_experts:
        kinds["experts"] = GemmaExperts
    return kinds


class GemmaBlock(nn.Module):
    """One Gemma layer (see the module docstring). Its tensors by their Hugging Face
    (mlx-lm) names, the family's own (`hf_names`: they mean other things elsewhere,
    e.g. post_attention_layernorm is Llama's feed-forward norm): input_layernorm
    `attention_norm`, post_attention_layernorm `post_attention_norm`,
    pre_feedforward_layernorm `ffn_norm`, post_feedforward_layernorm `post_ffn_norm`."""

    hf_names = (
        ("post_attention_layernorm", "post_attention_norm"),
        ("pre_feedforward_layernorm", "ffn_norm"),
        ("post_feedforward_layernorm", "post_ffn_norm"),
        ("post_feedforward_layernorm_1", "post_ffn_norm_1"),
        ("post_feedforward_layernorm_2", "post_ffn_norm_2"),
        ("pre_feedforward_layernorm_2", "experts.pre_norm"),
        ("router", "experts.router"),
        ("experts.switch_glu", "experts.switch_mlp"),
        ("per_layer_input_gate", "per_layer_gate"),
        ("per_layer_projection", "per_layer_projection"),
        ("post_per_layer_input_norm", "per_layer_norm"),
        ("layer_scalar$", "layer_scalar"),
    )
    gguf_names = (
        ("post_attention_norm", "post_attention_norm"),
        ("ffn_norm", "ffn_norm"),
        ("post_ffw_norm", "post_ffn_norm"),
        # Gemma 4's (llama.cpp's `gemma4` names): the experts' and per-layer inputs'
        ("post_ffw_norm_1", "post_ffn_norm_1"),
        ("post_ffw_norm_2", "post_ffn_norm_2"),
        ("pre_ffw_norm_2", "experts.pre_norm"),
        ("ffn_gate_inp.scale$", "experts.router.scale"),
        ("ffn_gate_inp", "experts.router.proj"),
        ("ffn_down_exps.scale$", "experts.router.per_expert_scale"),
        ("ffn_gate_up_exps", "experts.switch_mlp.gate_up_proj"),  # split: gguf_gemma.py
        ("ffn_down_exps", "experts.switch_mlp.down_proj"),
        ("inp_gate", "per_layer_gate"),
        ("proj", "per_layer_projection"),
        ("post_norm", "per_layer_norm"),
        ("layer_output_scale.weight$", "layer_scalar"),
    )

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        kinds = layer_kinds(args, layer)
        norm = OnePlusRMSNorm if args.gemma == 3 else nn.RMSNorm
        self.attention = kinds["attention"](args, layer)
        self.feed_forward = kinds["feed_forward"](args)
        names = ["attention_norm", "post_attention_norm", "ffn_norm", "post_ffn_norm"]
        if "experts" in kinds:
            self.experts = kinds["experts"](args)
            names += ["post_ffn_norm_1", "post_ffn_norm_2"]
        for name in names:
            setattr(self, name, norm(args.dim, eps=args.norm_eps))
        if args.gemma == 4 and args.ple_dim:
            self.per_layer_gate = nn.Linear(args.dim, args.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(args.ple_dim, args.dim, bias=False)
            self.per_layer_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if args.gemma == 4:
            self.layer_scalar = mx.ones((1,))
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "ple_dim", args.ple_dim if args.gemma == 4 else 0)
        object.__setattr__(self, "add", clip_residual if args.gemma == 3 else mx.add)
        object.__setattr__(self, "spec", LayerSpec.of(self.mixers(), args, layer))

    def mixers(self) -> dict[str, nn.Module]:
        out = {"attention": self.attention, "feed_forward": self.feed_forward}
        return out | ({"experts": self.experts} if "experts" in self else {})

    def __call__(
        self, x: mx.array, mask: Any = None, cache: Any = None, side: mx.array | None = None
    ) -> mx.array:
        """x (B, L, dim); `side` (B, L, layers * ple): every layer's per-layer inputs."""
        r = self.attention(self.attention_norm(x), mask, cache)
        h = self.add(x, self.post_attention_norm(r))
        r = self.feed_forward(self.ffn_norm(h))
        if "experts" in self:
            r = self.post_ffn_norm_1(r) + self.post_ffn_norm_2(self.experts(h))
        h = self.add(h, self.post_ffn_norm(r))
        if self.ple_dim and side is not None:
            a = self.layer * self.ple_dim
            gate = nn.gelu_approx(self.per_layer_gate(h)) * side[..., a : a + self.ple_dim]
            h = h + self.per_layer_norm(self.per_layer_projection(gate))
        if "layer_scalar" in self:
            h = h * self.layer_scalar
        return h


class GemmaTransformer(Transformer):
    """The Gemma model: scaled embeddings, Gemma 4's per-layer inputs and capped logits
    around the layers (`embed`, `side_inputs`, `head`, which a pipeline stage runs on
    what it holds: only `args` and the modules named here)."""

    # made on a pipeline's first stage beside the embedding
    embedding_modules = ("per_layer_embeddings", "per_layer_projection", "per_layer_norm")

    def __init__(self, args: ModelArgs):
        layers = [GemmaBlock(args, i) for i in range(args.n_layers)]
        super().__init__(args, layers)
        link_kv_sources(self.layers, args)
        if args.gemma == 3:
            self.norm = OnePlusRMSNorm(args.dim, eps=args.norm_eps)
        ple = args.ple_dim if args.gemma == 4 else 0
        if ple:
            n = args.n_layers
            self.per_layer_embeddings = nn.Embedding(args.vocab_size, n * ple)
            self.per_layer_projection = nn.Linear(args.dim, n * ple, bias=False)
            self.per_layer_norm = nn.RMSNorm(ple, eps=args.norm_eps)
        object.__setattr__(self, "side_width", args.n_layers * ple)

    def embed(self, tokens: mx.array, input_embeddings: mx.array | None = None) -> mx.array:
        h = Transformer.embed(self, tokens, input_embeddings)
        if self.args.gemma == 3:  # mlx-lm's: the scale rounded to bfloat16
            return h * mx.array(self.args.dim**0.5, mx.bfloat16).astype(h.dtype)
        return h * self.args.dim**0.5

    def side_inputs(self, tokens: mx.array, h: mx.array) -> mx.array | None:
        """Every layer's `ple` inputs (B, L, layers * ple): the per-layer embedding rows,
        scaled, plus the normed projection of the scaled embedding h, over sqrt(2)."""
        a = self.args
        if a.gemma != 4 or not a.ple_dim:
            return None
        B, L, _ = h.shape
        rows = self.per_layer_embeddings(tokens) * a.ple_dim**0.5
        proj = self.per_layer_projection(h) * a.dim**-0.5
        proj = self.per_layer_norm(proj.reshape(B, L, a.n_layers, a.ple_dim))
        out = (proj + rows.reshape(B, L, a.n_layers, a.ple_dim)) * 2.0**-0.5
        return out.reshape(B, L, -1)

    def head(self, h: mx.array) -> mx.array:
        logits = Transformer.head(self, h)
        cap = self.args.final_logit_softcapping if self.args.gemma == 4 else None
        return logits if not cap else logit_softcap(cap, logits)


# -- config fields (the families' registry rows read them) ---------------------------


def _rope(params: dict | None, theta: float) -> tuple[float, dict | None]:
    return (params or {}).get("rope_theta", theta), params


def gemma4_fields(config: dict) -> dict:
    """Gemma 4's fields with mlx-lm's defaults (`gemma4_text.ModelArgs`): its layer types
    and window, the global layers' heads, the KV-shared layers' sources, per-layer
    inputs, the MoE block, the logit cap."""
    d = Gemma4Args.from_dict({k: v for k, v in config.items() if k != "model_type"})
    n = d.num_hidden_layers
    first = n - d.num_kv_shared_layers
    sources: list[int | None] = [None] * n
    if d.num_kv_shared_layers > 0:
        last = {d.layer_types[i]: i for i in range(first)}
        for j in range(first, n):
            if d.layer_types[j] not in last:
                raise ValueError(
                    f"KV-shared layer {j} is {d.layer_types[j]} but no earlier layer is"
                )
            sources[j] = last[d.layer_types[j]]
    ple = d.hidden_size_per_layer_input or 0
    if ple and d.vocab_size_per_layer_input != d.vocab_size:
        raise ValueError(
            f"vocab_size_per_layer_input {d.vocab_size_per_layer_input} differs from "
            f"vocab_size {d.vocab_size}: not supported"
        )
    rope = {
        kind: _rope(d.rope_parameters.get(kind), 10000.0)
        for kind in ("sliding_attention", "full_attention")
    }
    moe = bool(d.enable_moe_block)
    return {
        "n_kv_heads": d.num_key_value_heads,
        "head_dim": d.head_dim,
        "norm_eps": d.rms_norm_eps,
        "max_position_embeddings": d.max_position_embeddings,
        "tie_word_embeddings": d.tie_word_embeddings,
        "rope_traditional": d.rope_traditional,
        "layer_types": list(d.layer_types),
        "sliding_window": d.sliding_window,
        "n_experts": (d.num_experts or 0) if moe else 0,
        "n_experts_per_tok": (d.top_k_experts or 0) if moe else 0,
        "moe_hidden_dim": (d.moe_intermediate_size or 0) if moe else 0,
        "extra": {
            "gemma": 4,
            "global_head_dim": d.global_head_dim or d.head_dim,
            "k_eq_v": bool(d.attention_k_eq_v),
            "global_kv_heads": (d.num_global_key_value_heads or 0) if d.attention_k_eq_v else 0,
            "kv_sources": sources,
            "wide": [bool(d.use_double_wide_mlp) and 0 < first <= i for i in range(n)],
            "ple_dim": ple,
            "final_logit_softcapping": d.final_logit_softcapping,
            "rope": rope,
        },
    }


def gemma3_fields(config: dict) -> dict:
    """Gemma 3's fields with mlx-lm's defaults (`gemma3_text.ModelArgs`): every
    `sliding_window_pattern`-th layer global, the others sliding with their own RoPE
    base; attention scaled by query_pre_attn_scalar."""
    d = Gemma3Args.from_dict(config)
    n, p = d.num_hidden_layers, d.sliding_window_pattern
    types = ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]
    return {
        "n_kv_heads": d.num_key_value_heads,
        "head_dim": d.head_dim,
        "norm_eps": d.rms_norm_eps,
        "max_position_embeddings": d.max_position_embeddings,
        "layer_types": types,
        "sliding_window": d.sliding_window,
        "extra": {
            "gemma": 3,
            "query_pre_attn_scalar": d.query_pre_attn_scalar,
            "wide": [False] * n,
            "rope": {
                "sliding_attention": (d.rope_local_base_freq, None),
                "full_attention": (d.rope_theta, d.rope_scaling),
            },
        },
    }


def gemma_config_keys(a: ModelArgs) -> dict:
    """The config.json keys `convert` writes for a Gemma model beyond the common ones."""
    x = a.extra
    out: dict[str, Any] = {
        "head_dim": a.head_dim,
        "num_key_value_heads": a.n_kv_heads,
        "sliding_window": a.sliding_window,
        "layer_types": a.layer_types,
        "max_position_embeddings": a.max_position_embeddings,
    }
    if x["gemma"] == 3:
        full = x["rope"]["full_attention"]
        pattern = (
            a.layer_types.index("full_attention") + 1
            if "full_attention" in a.layer_types
            else a.n_layers + 1
        )
        return out | {
            "sliding_window_pattern": pattern,
            "query_pre_attn_scalar": x["query_pre_attn_scalar"],
            "rope_local_base_freq": x["rope"]["sliding_attention"][0],
            "rope_theta": full[0],
            "rope_scaling": full[1],
        }
    shared = sum(s is not None for s in x["kv_sources"])
    return out | {
        "global_head_dim": x["global_head_dim"],
        "attention_k_eq_v": x["k_eq_v"],
        "num_global_key_value_heads": x["global_kv_heads"] or None,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": any(x["wide"]),
        "hidden_size_per_layer_input": x["ple_dim"],
        "vocab_size_per_layer_input": a.vocab_size,
        "final_logit_softcapping": x["final_logit_softcapping"],
        "rope_parameters": {k: v[1] for k, v in x["rope"].items()},
        "enable_moe_block": bool(a.n_experts),
        "num_experts": a.n_experts or None,
        "top_k_experts": a.n_experts_per_tok or None,
        "moe_intermediate_size": a.moe_hidden_dim or None,
        "tie_word_embeddings": a.tie_word_embeddings,
    }


# what the GGUF reader sets from the metadata and tensors itself (`checkpoints/gguf.py`)
_READERS = ("tie_word_embeddings", "norm_eps", "max_position_embeddings", "rope_traditional")


def gemma4_gguf_fields(get) -> dict:
    """The same fields from a GGUF file's `gemma4.*` metadata (llama.cpp's converter): the
    layer types from attention.sliding_window_pattern (true: sliding), the sliding
    layers' heads from key_length_swa and the global ones' from key_length, KV heads per
    layer (the global layers' entries: their own KV heads), feed-forward widths per layer
    (the KV-shared layers' doubled: double-wide), shared_kv_layers, the per-layer input
    width, rope.freq_base (global) and freq_base_swa. Keys = values and the global
    layers' partial RoPE come from the tensors (`checkpoints/gguf_gemma.py`)."""
    swa = get("attention.sliding_window_pattern")
    n = get("block_count")
    if swa is None or len(swa) != n:
        raise ValueError(f"attention.sliding_window_pattern {swa} is not one flag per layer")
    types = ["sliding_attention" if s else "full_attention" for s in swa]
    kv, ff = get("attention.head_count_kv"), get("feed_forward_length")
    kv, ff = layer_values(kv, n), layer_values(ff, n)
    sliding = [kv[i] for i in range(n) if swa[i]] or kv
    shared = get("attention.shared_kv_layers") or 0
    width = min(ff)
    if any(w not in (width, 2 * width) for w in ff) or any(
        w != width for w in ff[: n - shared]
    ):  # mlx-lm's double-wide feed-forward: only the KV-shared layers', doubled
        raise ValueError(f"feed_forward_length {ff}: not one width (doubled in KV-shared layers)")
    head, head_swa = get("attention.key_length"), get("attention.key_length_swa")
    experts = get("expert_count") or 0
    config = {
        "hidden_size": get("embedding_length"),
        "num_hidden_layers": n,
        "intermediate_size": width,
        "num_attention_heads": get("attention.head_count"),
        "head_dim": head_swa or head,
        "global_head_dim": head,
        "num_key_value_heads": sliding[0],
        "num_global_key_value_heads": None,
        "attention_k_eq_v": False,  # from the tensors
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": get("embedding_length_per_layer_input") or 0,
        "vocab_size_per_layer_input": get("vocab_size"),
        "vocab_size": get("vocab_size"),
        "sliding_window": get("attention.sliding_window"),
        "layer_types": types,
        "enable_moe_block": bool(experts),
        "num_experts": experts or None,
        "top_k_experts": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "use_double_wide_mlp": max(ff) > width,
        "final_logit_softcapping": get("final_logit_softcapping"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": get("context_length", 4096),
        "rope_parameters": {
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 1.0,  # rope_freqs' (`gguf_gemma.py`)
                "rope_theta": get("rope.freq_base", 1e6),
            },
            "sliding_attention": {
                "rope_type": "default",
                "partial_rotary_factor": 1.0,
                "rope_theta": get("rope.freq_base_swa", 1e4),
            },
        },
    }
    out = gemma4_fields({k: v for k, v in config.items() if v is not None})
    for key in _READERS:
        out.pop(key, None)
    return out | {"model_type": "gemma4_text", "hidden_dim": width, "qk_norm": True}


def gemma3_gguf_fields(get) -> dict:
    """The same fields from a GGUF file's `gemma3.*` metadata as llama.cpp reads them: the
    layer types from attention.sliding_window_pattern (flags per layer, or every n-th
    layer global; 6 when absent, as llama.cpp), the sliding layers' RoPE base
    rope.freq_base_swa (10000 when absent), the global ones' rope.freq_base and linear
    scaling; queries scaled by 1/sqrt(head_dim) (the 62-layer 27B: 1/sqrt(dim / heads)),
    llama.cpp's rule for what the config's query_pre_attn_scalar said. The norms' +1 the
    converter added: `checkpoints/gguf_gemma.py`."""
    n, dim, heads = get("block_count"), get("embedding_length"), get("attention.head_count")
    head = get("attention.key_length") or dim // heads
    pattern = get("attention.sliding_window_pattern", 6)
    if hasattr(pattern, "__len__"):
        if len(pattern) != n:
            raise ValueError(
                f"attention.sliding_window_pattern {pattern} is not one flag per layer"
            )
        flags = [bool(s) for s in pattern]
    else:
        flags = [pattern == 0 or i % pattern < pattern - 1 for i in range(n)]
    if get("attention.sliding_window") is None:
        flags = [False] * n  # llama.cpp: no window, every layer global
    scaling = None
    if get("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor", 1.0)}
    config = {
        "model_type": "gemma3_text",
        "hidden_size": dim,
        "num_hidden_layers": n,
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": heads,
        "head_dim": head,
        "num_key_value_heads": get("attention.head_count_kv") or heads,
        "sliding_window": get("attention.sliding_window") or 0,
        "query_pre_attn_scalar": dim // heads if n == 62 else head,
        "rope_theta": get("rope.freq_base", 1e6),
        "rope_local_base_freq": get("rope.freq_base_swa", 1e4),
        "rope_scaling": scaling,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": get("context_length", 4096),
    }
    out = gemma3_fields(config)
    for key in _READERS:
        out.pop(key, None)
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in flags]
    return out | {"model_type": "gemma3_text", "qk_norm": True}
