"""The model families llama_tp runs, and building one from its `ModelArgs`.

Every family is the Llama core (`llama_tp/model.py`) with a different attention or
feed-forward in some layers, chosen by the args, not by name:

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
    GLM-4.5     glm4_moe           glm4moe                  + q/k/v bias, as DeepSeek-V3
                                                            partial RoPE,
                                                            qk-norm if set

The readers (`checkpoints/hf.py`, `checkpoints/gguf.py`) turn a config into
`ModelArgs`; `layer_kinds` says each layer's mixer kinds, from which `build` makes the
model and `layer_specs` the placement's view of it (each kind's split table and cache,
`parallel/splits.py`) without building anything.
"""

from __future__ import annotations

import mlx.nn as nn

from ..model import Attention, FeedForward, Transformer, TransformerBlock
from ..model_args import ModelArgs
from ..parallel.splits import LayerSpec
from .gpt_oss import SinkAttention
from .latent_attention import LatentAttention
from .moe import MoEFeedForward
from .qk_norm import QKNormAttention

MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "kimi_k2",
    "gpt_oss",
    "glm4_moe",
)
GGUF_ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "deepseek2", "glm4moe", "gpt-oss",
)  # fmt: skip


def unsupported(kind: str, name: object, supported: tuple[str, ...]) -> str:
    """`unsupported model_type 'gemma3' (supported: llama, ...)`: one line."""
    return f"unsupported {kind} {name!r} (supported: {', '.join(supported)})"


def layer_kinds(args: ModelArgs, i: int) -> dict[str, type[nn.Module]]:
    """The mixer kinds of layer `i` of the family `args` describe, by path in the layer."""
    if args.kv_lora_rank:
        attention: type[nn.Module] = LatentAttention
    elif args.attention_sinks:
        attention = SinkAttention
    else:
        attention = QKNormAttention if args.qk_norm else Attention
    feed_forward = MoEFeedForward if args.is_sparse(i) else FeedForward
    return {"attention": attention, "feed_forward": feed_forward}


def block(args: ModelArgs, i: int) -> TransformerBlock:
    """Layer `i` of the family `args` describe."""
    kinds = layer_kinds(args, i)
    attention = kinds["attention"]
    mixer = attention(args, args.window(i)) if attention is SinkAttention else attention(args)
    return TransformerBlock(args, mixer, kinds["feed_forward"](args), layer=i)


def layer_specs(args: ModelArgs) -> tuple[LayerSpec, ...]:
    """Every layer's split tables and cache, from its kinds (nothing built)."""
    return tuple(LayerSpec.of(layer_kinds(args, i), args, i) for i in range(args.n_layers))


def build(args: ModelArgs) -> Transformer:
    """The model `args` describe (lazily initialized weights: the loader replaces them)."""
    return Transformer(args, [block(args, i) for i in range(args.n_layers)])
