"""The model families llama_tp runs, and building one from its `ModelArgs`.

Every family is the Llama core (`llama_tp/model.py`, of `blocks.py`'s layers) with a
different attention or feed-forward in some layers, chosen by the args, not by name:

    family      model_type         GGUF architecture        attention     feed-forward
    Llama       llama, mistral     llama                    core          core
    Qwen2       qwen2              qwen2                    + q/k/v bias  core
    Qwen3       qwen3              qwen3                    qk-norm       core
    Mixtral     mixtral            llama (expert_count > 0) core          experts (top-k, softmax)
    Qwen2-MoE   qwen2_moe          qwen2moe                 + q/k/v bias  experts + shared expert
    Qwen3-MoE   qwen3_moe          qwen3moe                 qk-norm       experts (softmax, top-k)
                                                                          or dense by layer
    DeepSeek-V3 deepseek_v3,       deepseek2                latent (MLA)  experts (sigmoid, groups)
    Kimi K2     kimi_k2                                                   + shared experts;
                                                                          dense first layers
    gpt-oss     gpt_oss            gpt-oss                  sinks, bias,  experts (top-k,
                                                            sliding window softmax), biased,
                                                            layers        clamped SwiGLU
    DeepSeek-   deepseek_v32,      deepseek32, glm-dsa      sparse: MLA   as DeepSeek-V3
    V3.2, GLM-5 glm_moe_dsa                                 over the
                                                            indexer's
                                                            top-k keys
    Step-3.5    step3p5            step35                   sliding and   experts (sigmoid +
                                                            global, own   bias, scaled) +
                                                            heads, gated  shared expert;
                                                            per head      clamped SwiGLU
    MiniMax-M2  minimax            minimax-m2               q/k norms     experts (sigmoid +
                                                            over all      bias, no groups)
                                                            heads,
                                                            partial RoPE
    Llama 4     llama4,            llama4 (the text model)  chunked on    experts (top-1,
                llama4_text                                 RoPE layers,  sigmoid, input
                                                            global NoPE   scaled) + shared
                                                            layers        expert; dense
                                                                          (llama4_text)
    Nemotron-H  nemotron_h         nemotron_h,              one mixer per layer: Mamba-2,
                                   nemotron_h_moe           attention (no RoPE), relu2
                                                            feed-forward or experts
    Kimi-Linear kimi_linear        kimi-linear              KDA (3 of 4), experts (sigmoid +
                                                            latent (MLA)  bias, groups) +
                                                            without RoPE  shared experts
    Kimi K3     kimi_k3            kimi-k3                  fused KDA,    SiTU; latent
                                                            gated latent  experts + shared;
                                                            attention;    attention
                                                            no RoPE       residuals
    GLM-4.5     glm4_moe           glm4moe                  + q/k/v bias, as DeepSeek-V3
                                                            partial RoPE,
                                                            qk-norm if set
    Qwen3.5,    qwen3_5,           qwen35, qwen35moe        gated delta   core, or experts +
    Qwen3.6     qwen3_5_moe                                 (3 of 4),     gated shared expert
                                                            output-gated
                                                            attention
    Qwen3-Next  qwen3_next         qwen3next                as Qwen3.5    experts + gated
                                                                          shared expert
    Gemma 3     gemma3_text        gemma3                   sliding and   GeGLU; sandwich
                                                            global, q/k   norms, scaled
                                                            norms         embeddings
    Gemma 4     gemma4_text        gemma4                   + global      + experts beside
                                                            heads, k = v, it; per-layer
                                                            KV-shared     inputs, capped
                                                            layers        logits

A family is a registry row (`FAMILIES`, `GGUF_FAMILIES`); a mixer kind is one class
in its own module that declares its split table, its cache, its checkpoint names
(`KINDS`, `checkpoint_names`) and reads its config fields. The readers
(`checkpoints/hf.py`, `checkpoints/gguf.py`) turn a config into `ModelArgs`;
`layer_kinds` says each layer's mixer kinds, from which `build` makes the
model and `layer_specs` the placement's view of it (each kind's split table and cache,
`parallel/splits.py`) without building anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from ..model import Transformer
from ..model_args import ModelArgs
from ..parallel.splits import LayerSpec
from . import gemma, headwise_gate, kimi_k3, nemotron_h
from .attention import Attention
from .blocks import MixerBlock, TransformerBlock
from .chunked_attention import (
    ChunkedAttention,
    Llama4Layer,
    llama4_fields,
    llama4_gguf_fields,
    llama4_text_fields,
)
from .feed_forward import FeedForward
from .gated_attention import GatedAttention
from .gated_delta import GatedDeltaNet, qwen3_5_config, qwen3_5_fields, qwen3_5_gguf_fields
from .gemma import (
    GemmaBlock,
    GemmaTransformer,
    gemma3_fields,
    gemma3_gguf_fields,
    gemma4_fields,
    gemma4_gguf_fields,
    gemma_config_keys,
)
from .gpt_oss import SinkAttention, gpt_oss_fields
from .headwise_gate import (
    GatedHeadsAttention,
    SlidingGatedHeadsAttention,
    StepLayer,
    step3p5_fields,
    step3p5_gguf_fields,
)
from .kimi_delta import (
    KimiDeltaAttention,
    NopeLatentAttention,
    kimi_linear_config,
    kimi_linear_fields,
    kimi_linear_gguf_fields,
)
from .kimi_k3 import (
    FusedKimiDeltaAttention,
    GatedLatentAttention,
    KimiK3Layer,
    KimiK3Transformer,
    kimi_k3_fields,
    kimi_k3_gguf_fields,
)
from .latent_attention import LatentAttention, deepseek_v3_fields
from .latent_experts import LatentExperts
from .mamba import Mamba2Mixer
from .moe import MoEFeedForward, glm4_moe_fields, mixtral_fields, qwen_moe_fields
from .nemotron_h import (
    NoRopeAttention,
    Relu2Experts,
    Relu2FeedForward,
    nemotron_h_config,
    nemotron_h_fields,
    nemotron_h_gguf_fields,
)
from .qk_norm import QKNormAttention
from .sparse_attention import SparseAttention, deepseek_v32_fields, glm_moe_dsa_fields
from .wide_qk_norm import (
    WideQKNormAttention,
    minimax_config,
    minimax_fields,
    minimax_gguf_fields,
)


@dataclass(frozen=True)
class Family:
    """A registry row: one Hugging Face `model_type`. `architecture`: the class `convert`
    names in the config.json it writes (None: not written); `fields`: the family's
    ModelArgs fields from its config.json beyond the common ones (its kinds' readers;
    a ValueError names a bad value); `qk_norm`: its attention normalises q and k per
    head; `config_keys`: the config.json keys `convert` writes for the family beyond
    the common ones (None: `checkpoints/hf_config.py`'s for the families before);
    `prefix`: what mlx-lm's model puts before the Hugging Face names (a language model
    beside a vision tower: "language_model.")."""

    architecture: str | None = None
    fields: Callable[[dict], dict] | None = None
    qk_norm: bool = False
    config_keys: Callable[[ModelArgs], dict] | None = None
    prefix: str = ""
    # kinds whose checkpoint names only this family reads, tried before every kind's
    # (Gemma's post_attention_layernorm is not Llama's feed-forward norm)
    kinds: tuple[type[nn.Module], ...] = ()
    # the family's own model (None: the Llama core, `Transformer`, of `block`s)
    model: Callable[[ModelArgs], Transformer] | None = None
    # how its releases mark reasoning (`conversation/reasoning.py` MARKERS), first the
    # default; `<think>` where no release reasons (a fine-tune's tokenizer that holds it)
    reasoning: tuple[str, ...] = ("think",)
    # the tool-call formats its releases' chat templates teach, the default first
    # (`conversation/tool_formats`: names of its `FORMATS`)
    tools: tuple[str, ...] = ()


@dataclass(frozen=True)
class GgufFamily:
    """A registry row for a GGUF `general.architecture`: the family's `model_type`;
    `neox`: RoPE on the halves of each head (llama.cpp's NEOX: q/k rows not permuted for
    interleaved pairs); `fields`: the family's ModelArgs fields from the metadata beyond
    the common ones, given `get(key, default)` of `{arch}.*` (None: `checkpoints/gguf.py`'s
    for the families before; a ValueError names a bad value)."""

    model_type: str
    neox: bool = False
    fields: Callable[[Callable[..., Any]], dict] | None = None
    kinds: tuple[type[nn.Module], ...] = ()  # as `Family.kinds`


FAMILIES = {
    "llama": Family("LlamaForCausalLM", tools=("llama3_json",)),
    "mistral": Family(
        "MistralForCausalLM",
        tools=("mistral_args", "mistral_json"),
        reasoning=("mistral_think", "think"),
    ),
    "qwen2": Family("Qwen2ForCausalLM", tools=("hermes",)),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, tools=("hermes",)),
    "mixtral": Family("MixtralForCausalLM", mixtral_fields, tools=("mistral_json",)),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", qwen_moe_fields, tools=("hermes",)),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM", qwen_moe_fields, qk_norm=True, tools=("hermes", "qwen3_coder")
    ),
    "deepseek_v3": Family(
        "DeepseekV3ForCausalLM", deepseek_v3_fields, tools=("deepseek_v3_1", "deepseek_v3")
    ),
    "kimi_k2": Family("DeepseekV3ForCausalLM", deepseek_v3_fields, tools=("kimi_k2",)),
    "deepseek_v32": Family(
        "DeepseekV32ForCausalLM",
        deepseek_v32_fields,
        kinds=(SparseAttention,),
        tools=("deepseek_v3_2",),
    ),
    "glm_moe_dsa": Family(
        "GlmMoeDsaForCausalLM", glm_moe_dsa_fields, kinds=(SparseAttention,), tools=("glm47",)
    ),
    "gpt_oss": Family(None, gpt_oss_fields, tools=("harmony",), reasoning=("harmony",)),
    "minimax": Family(
        "MiniMaxM2ForCausalLM",
        minimax_fields,
        config_keys=minimax_config,
        kinds=(WideQKNormAttention,),
        tools=("minimax_m2",),
    ),
    "glm4_moe": Family("Glm4MoeForCausalLM", glm4_moe_fields, tools=("glm47", "glm45")),
    "llama4": Family(
        None, llama4_fields, prefix="language_model.", kinds=(Llama4Layer,), tools=("llama4_json",)
    ),
    "llama4_text": Family(None, llama4_text_fields, kinds=(Llama4Layer,), tools=("llama4_json",)),
    "step3p5": Family(
        None, step3p5_fields, qk_norm=True, kinds=(StepLayer,), tools=("qwen3_coder",)
    ),
    "nemotron_h": Family(
        "NemotronHForCausalLM",
        nemotron_h_fields,
        config_keys=nemotron_h_config,
        kinds=(NoRopeAttention, Mamba2Mixer, Relu2FeedForward, Relu2Experts),
        tools=("qwen3_coder", "nemotron_v2"),
    ),
    "kimi_linear": Family(
        "KimiLinearForCausalLM",
        kimi_linear_fields,
        config_keys=kimi_linear_config,
        kinds=(KimiDeltaAttention,),
        tools=("kimi_k2",),
    ),
    "kimi_k3": Family(
        None,
        kimi_k3_fields,
        prefix="language_model.",
        kinds=(KimiK3Layer, LatentExperts, FusedKimiDeltaAttention, GatedLatentAttention),
        model=KimiK3Transformer,
        reasoning=("kimi_xtml", "think"),
        tools=("kimi_k3",),
    ),
    "qwen3_5": Family(
        "Qwen3_5ForConditionalGeneration",
        qwen3_5_fields,
        True,
        qwen3_5_config,
        "language_model.",
        tools=("qwen3_coder",),
    ),
    "qwen3_5_moe": Family(
        "Qwen3_5MoeForConditionalGeneration",
        qwen3_5_fields,
        True,
        qwen3_5_config,
        "language_model.",
        tools=("qwen3_coder",),
    ),  # fmt: skip
    "qwen3_next": Family(
        "Qwen3NextForCausalLM",
        qwen3_5_fields,
        True,
        qwen3_5_config,
        tools=("hermes", "qwen3_coder"),
    ),
    "gemma3_text": Family(
        "Gemma3ForCausalLM",
        gemma3_fields,
        True,
        gemma_config_keys,
        kinds=(GemmaBlock,),
        model=GemmaTransformer,
        tools=("function_gemma",),
    ),
    "gemma4_text": Family(
        "Gemma4ForCausalLM",
        gemma4_fields,
        True,
        gemma_config_keys,
        kinds=(GemmaBlock,),
        model=GemmaTransformer,
        reasoning=("gemma4_channel",),
        tools=("gemma4",),
    ),
}
MODEL_TYPES = tuple(FAMILIES)
# GGUF `general.architecture` -> its row (llama with experts is Mixtral: `checkpoints/gguf.py`)
GGUF_FAMILIES = {
    "llama": GgufFamily("llama"),
    "qwen2": GgufFamily("qwen2", neox=True),
    "qwen3": GgufFamily("qwen3", neox=True),
    "qwen2moe": GgufFamily("qwen2_moe", neox=True),
    "qwen3moe": GgufFamily("qwen3_moe", neox=True),
    "deepseek2": GgufFamily("deepseek_v3"),
    "glm4moe": GgufFamily("glm4_moe", neox=True),
    "gpt-oss": GgufFamily("gpt_oss", neox=True),
    "qwen35": GgufFamily(
        "qwen3_5", neox=True, fields=lambda get: qwen3_5_gguf_fields(get, "qwen35")
    ),
    "qwen35moe": GgufFamily(
        "qwen3_5_moe", neox=True, fields=lambda get: qwen3_5_gguf_fields(get, "qwen35moe")
    ),
    "qwen3next": GgufFamily(
        "qwen3_next", neox=True, fields=lambda get: qwen3_5_gguf_fields(get, "qwen3next")
    ),
    "kimi-linear": GgufFamily("kimi_linear", fields=kimi_linear_gguf_fields),
    "nemotron_h": GgufFamily("nemotron_h", fields=nemotron_h_gguf_fields),
    "nemotron_h_moe": GgufFamily("nemotron_h", fields=nemotron_h_gguf_fields),
    "minimax-m2": GgufFamily("minimax", neox=True, fields=minimax_gguf_fields),
}
# deepseek2's reader and the indexer's names (`checkpoints/gguf_routed.py`, SparseAttention)
GGUF_FAMILIES |= {"glm-dsa": GgufFamily("glm_moe_dsa"), "deepseek32": GgufFamily("deepseek_v32")}
GGUF_FAMILIES |= {"llama4": GgufFamily("llama4", fields=llama4_gguf_fields)}
GGUF_FAMILIES |= {"step35": GgufFamily("step3p5", neox=True, fields=step3p5_gguf_fields)}
GGUF_FAMILIES |= {
    "gemma3": GgufFamily("gemma3_text", neox=True, fields=gemma3_gguf_fields),
    "gemma4": GgufFamily("gemma4_text", neox=True, fields=gemma4_gguf_fields),
}
# Kimi-Linear's reader, the layer's kinds' names (`checkpoints/kimi_k3.py`'s `k3_gguf`)
GGUF_FAMILIES |= {"kimi-k3": GgufFamily("kimi_k3", fields=kimi_k3_gguf_fields)}
GGUF_ARCHITECTURES = tuple(GGUF_FAMILIES)
# Every mixer kind (and the layer's own norms), in the order their checkpoint names are
# tried: a kind's later, broader names (latent attention's) after the others'.
KINDS: tuple[type[nn.Module], ...] = (
    Attention,
    FeedForward,
    TransformerBlock,
    QKNormAttention,
    SinkAttention,
    MoEFeedForward,
    GatedDeltaNet,
    GatedAttention,
    LatentAttention,
)


def checkpoint_names(fmt: str, model_type: str | None = None) -> list[tuple[str, str]]:
    """Every kind's tensor names in `fmt` ("hf" or "gguf") checkpoints: (checkpoint path
    under a layer, the model's path under the layer), the family's own kinds' first
    (`Family.kinds`), then in `KINDS` order. A path ending in "$" is a whole tensor's
    name; the others are module prefixes."""
    own: tuple[type[nn.Module], ...] = ()
    if model_type in FAMILIES:
        own = FAMILIES[model_type].kinds
    elif model_type in GGUF_FAMILIES:
        own = GGUF_FAMILIES[model_type].kinds
    return [pair for kind in (*own, *KINDS) for pair in vars(kind).get(f"{fmt}_names", ())]


def unsupported(kind: str, name: object, supported: tuple[str, ...]) -> str:
    """`unsupported model_type 'gemma3' (supported: llama, ...)`: one line."""
    return f"unsupported {kind} {name!r} (supported: {', '.join(supported)})"


def layer_kinds(args: ModelArgs, i: int) -> dict[str, type[nn.Module]]:
    """The mixer kinds of layer `i` of the family `args` describe, by path in the layer."""
    if args.model_type in ("gemma3_text", "gemma4_text"):
        return gemma.layer_kinds(args, i)
    if args.model_type == "nemotron_h":  # one mixer per layer, by its pattern
        return nemotron_h.layer_kinds(args, i)
    if args.model_type == "kimi_k3":  # fused KDA, gated latent attention, latent experts
        return kimi_k3.layer_kinds(args, i)
    feed_forward = MoEFeedForward if args.is_sparse(i) else FeedForward
    if "linear_layers" in args.extra:  # Qwen3.5 / Qwen3-Next: 3 of 4 layers linear
        linear = i in args.linear_layers
        return {
            "attention": GatedDeltaNet if linear else GatedAttention,
            "feed_forward": feed_forward,
        }
    if "swa_heads" in args.extra:  # Step-3.5: sliding and global layers, gated heads
        sliding = args.window(i) is not None
        attention = SlidingGatedHeadsAttention if sliding else GatedHeadsAttention
        return {"attention": attention, "feed_forward": feed_forward}
    if "rope_layers" in args.extra:  # Llama 4: chunked RoPE layers, global NoPE ones
        attention: type[nn.Module] = ChunkedAttention
    elif "kda_layers" in args.extra:  # Kimi-Linear: KDA, latent attention without RoPE
        attention = KimiDeltaAttention if i in args.kda_layers else NopeLatentAttention
    elif "index_topk" in args.extra:  # DeepSeek-V3.2, GLM-5: the indexer's picks
        attention = SparseAttention
    elif args.kv_lora_rank:
        attention = LatentAttention
    elif "wide_qk_norm" in args.extra:  # MiniMax-M2: q/k norms across all heads
        attention = WideQKNormAttention
    elif args.attention_sinks:
        attention = SinkAttention
    else:
        attention = QKNormAttention if args.qk_norm else Attention
    return {"attention": attention, "feed_forward": feed_forward}


def block(args: ModelArgs, i: int) -> TransformerBlock | MixerBlock:
    """Layer `i` of the family `args` describe."""
    kinds = layer_kinds(args, i)
    if "mixer" in kinds:  # one mixer (Nemotron-H)
        return MixerBlock(args, kinds["mixer"](args), layer=i)
    if "swa_heads" in args.extra:  # Step-3.5: each layer's SwiGLU clamps
        clamp, shared = headwise_gate.limits(args, i)
        ff = headwise_gate.feed_forward(args, i, shared)
        if args.is_sparse(i):
            ff = MoEFeedForward(args, clamp, ff)
        return TransformerBlock(args, kinds["attention"](args, i), ff, layer=i)
    attention = kinds["attention"]
    if attention is SinkAttention:
        mixer = attention(args, args.window(i))
    elif attention is ChunkedAttention:
        mixer = attention(args, i)
    else:
        mixer = attention(args)
    return TransformerBlock(args, mixer, kinds["feed_forward"](args), layer=i)


def layer_specs(args: ModelArgs) -> tuple[LayerSpec, ...]:
    """Every layer's split tables and cache, from its kinds (nothing built)."""
    return tuple(LayerSpec.of(layer_kinds(args, i), args, i) for i in range(args.n_layers))


def build(args: ModelArgs) -> Transformer:
    """The model `args` describe (lazily initialized weights: the loader replaces them)."""
    family = FAMILIES.get(args.model_type)
    if family is not None and family.model is not None:
        return family.model(args)
    return Transformer(args, [block(args, i) for i in range(args.n_layers)])
