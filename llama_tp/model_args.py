"""`ModelArgs`: the configuration every checkpoint reader yields and every model is
built from (sizes, RoPE, the family's variations: qk-norm, experts and their routing,
latent attention, sliding windows and sinks), checked once when it is made: a bad
config is a ValueError naming the field and its numbers.

Nothing here imports the package: the checkpoint readers, the model and its families read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int  # feed-forward intermediate size
    vocab_size: int
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # True: rotate interleaved pairs (Meta / GGUF weight layout);
    # False: rotate the two halves of each head (Hugging Face layout).
    rope_traditional: bool = False
    rope_scaling: dict | None = None
    # Rotated values of each head, the first `rope_dims` (GLM-4.5's partial rotary: half);
    # 0: all of head_dim
    rope_dims: int = 0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2-style checkpoints
    o_bias: bool = False
    mlp_bias: bool = False
    # The family (`llama_tp/models/registry.py`); the blocks follow the fields below.
    model_type: str = "llama"
    qk_norm: bool = False  # Qwen3: RMSNorm on every query and key head before RoPE
    # Mixture-of-experts layers (`models/moe.py`); n_experts 0: a dense model.
    n_experts: int = 0
    n_experts_per_tok: int = 0  # top-k
    moe_hidden_dim: int = 0  # each expert's intermediate size
    shared_expert_dim: int = 0  # Qwen2-MoE's shared expert (0: none)
    norm_topk_prob: bool = False  # renormalise the k router weights to sum to 1
    # Qwen: softmax over all, top-k; Mixtral: "topk_softmax"; DeepSeek-V3: "sigmoid_group"
    # (sigmoid scores plus a correction bias pick the experts, in `n_group` groups of which
    # the best `topk_group` compete; the weights are the sigmoid scores, renormalised with
    # norm_topk_prob, times `routed_scaling_factor`)
    # MiniMax: "sigmoid_bias" (DeepSeek-V3's selection, no groups, behind a linear gate)
    # Llama 4: "sigmoid_input" (top-1, its sigmoid score scaling the expert's input)
    # Kimi-Linear: "sigmoid_linear" (DeepSeek-V3's selection, groups, behind a linear gate)
    router: str = "softmax_topk"
    sparse_layers: list[int] | None = None  # the layers with experts (None: all of them)
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate (DeepSeek: none)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (DeepSeek-V3, `models/latent_attention.py`); kv_lora_rank
    # 0: not MLA. head_dim is then v_head_dim (the columns of each head in the output).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: queries projected directly (q_proj)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # gpt-oss (`models/gpt_oss.py`): a learned logit per query head in every softmax's
    # denominator (attention sinks); layers of `layer_types` "sliding_attention" attend to
    # the last `sliding_window` positions only; biases on the router and every expert's
    # projections; the clamped SwiGLU ("swiglu_oai": alpha 1.702, limit `swiglu_limit`)
    attention_sinks: bool = False
    sliding_window: int = 0
    layer_types: list[str] | None = None  # "sliding_attention" | "full_attention" per layer
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_limit: float = 7.0
    # The fields a mixer kind declares for itself (`llama_tp/models/`: its registry row's
    # config reader fills them), read as attributes (`args.linear_num_key_heads`), so that
    # a new kind adds none here.
    extra: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        extra = self.__dict__.get("extra") or {}
        if name in extra:
            return extra[name]
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")

    def __post_init__(self) -> None:
        if self.kv_lora_rank:
            dims = (self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
            if min(dims) <= 0 or self.kv_lora_rank < 0 or self.q_lora_rank < 0:
                raise ValueError(
                    f"model config: latent attention needs positive qk_nope_head_dim, "
                    f"qk_rope_head_dim and v_head_dim, got {', '.join(map(str, dims))}"
                )
            self.head_dim = self.v_head_dim
            self.n_kv_heads = self.n_heads  # one latent for all heads: no KV head groups
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.rope_dims and not (0 < self.rope_dims <= self.head_dim and self.rope_dims % 2 == 0):
            raise ValueError(
                f"model config: {self.rope_dims} rotary values per head of {self.head_dim}: "
                "need an even count from 2 to head_dim"
            )
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"model config: {name} must be positive, got {getattr(self, name)}"
                )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model config: {self.n_heads} query heads are not a multiple of "
                f"{self.n_kv_heads} KV heads"
            )
        if self.n_experts:
            self._check_experts()
        if self.layer_types is not None:
            self._check_layer_types()

    def _check_layer_types(self) -> None:
        kinds = ("sliding_attention", "full_attention")
        if len(self.layer_types) != self.n_layers:
            raise ValueError(
                f"model config: {len(self.layer_types)} layer_types for {self.n_layers} layers"
            )
        bad = [t for t in self.layer_types if t not in kinds]
        if bad:
            raise ValueError(f"model config: layer type {bad[0]!r} (supported: {', '.join(kinds)})")
        if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
            raise ValueError(
                f"model config: sliding-window layers with sliding_window {self.sliding_window}"
            )

    def window(self, layer: int) -> int | None:
        """The positions layer `layer` attends to (None: all of them)."""
        if self.layer_types is None or self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    def _check_experts(self) -> None:
        e, k = self.n_experts, self.n_experts_per_tok
        if e < 0 or not 1 <= k <= e:
            raise ValueError(
                f"model config: {k} experts per token (top-k) with {e} experts: "
                "need 1 <= top-k <= experts"
            )
        if self.moe_hidden_dim <= 0:
            raise ValueError(
                f"model config: expert intermediate size must be positive, got "
                f"{self.moe_hidden_dim}"
            )
        if self.router not in (
            "softmax_topk",
            "topk_softmax",
            "sigmoid_group",
            "sigmoid_bias",
            "sigmoid_input",
            "sigmoid_linear",
        ):
            raise ValueError(f"model config: unknown router {self.router!r}")
        g, tg = self.n_group, self.topk_group
        if g < 1 or e % g or not 1 <= tg <= g or k > tg * (e // g) or (g > 1 and e // g < 2):
            raise ValueError(
                f"model config: {e} experts in {g} groups, top {tg} groups, top-k {k}: need "
                "groups of at least 2 experts, 1 <= topk_group <= n_group and top-k <= the "
                "experts of topk_group groups"
            )
        bad = [i for i in self.sparse_layers or [] if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(
                f"model config: expert layer {bad[0]} of a {self.n_layers}-layer model"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is a mixture of experts."""
        return self.n_experts > 0 and (self.sparse_layers is None or layer in self.sparse_layers)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def layer_values(value: Any, n: int) -> list[int]:
    """A GGUF metadata value that is one number for every layer or an array of one per
    layer (head counts, widths), as n ints."""
    return [int(v) for v in value] if hasattr(value, "__len__") else [value] * n
