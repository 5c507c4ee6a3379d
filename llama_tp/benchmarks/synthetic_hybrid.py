"""Synthetic Gated DeltaNet hybrids (Qwen3.5 / 3.6, Qwen3-Next) for benchmarks: the released
shapes scaled down, written by mlx-lm's own model classes with random weights (mlx-lm's
names, as its `convert` stores them), so that `llama_tp.load` and `mlx_lm.load` run the
same weights.

    qwen35-tiny   4 layers of 64, 5 key / 10 value heads of 16 (doc and test runs)
    qwen35        Qwen3.5-27B scaled down: 64 -> 8 layers, 5120 -> 1024 wide, 24 / 4 ->
                  8 / 2 query / KV heads of 128, 16 key / 48 -> 32 value heads of 128 -> 64,
                  a 17408 -> 3072 column SwiGLU
    qwen35-moe    Qwen3.6-35B-A3B scaled down: 40 -> 8 layers, 2048 -> 1024 wide, 16 / 2 ->
                  8 / 2 query / KV heads of 256 -> 128, 16 key / 32 value heads of 128 -> 64,
                  256 -> 64 experts (8 per token) of 512 -> 256 and a shared expert of 256
    qwen3-next    Qwen3-Next-80B-A3B scaled down: the same widths as qwen35-moe, 512 -> 64
                  experts (10 -> 8 per token), the Qwen3-Next projection layout

Every 4th layer full attention, the others linear attention, as released. DTYPE fp16,
bf16, fp32 or q4 (MLX 4-bit in groups of 64, mlx-lm's predicate: routers 8-bit).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import mlx.core as mx

_TEXT = dict(
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    tie_word_embeddings=False,
)
_ROPE = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}
_MOE = dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
            shared_expert_intermediate_size=256)  # fmt: skip
_WIDE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=128, vocab_size=32000, linear_num_key_heads=16, linear_num_value_heads=32,
             linear_key_head_dim=64, linear_value_head_dim=64)  # fmt: skip

# name -> (model_type, its text config)
HYBRIDS: dict[str, tuple[str, dict]] = {
    "qwen35-tiny": ("qwen3_5", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, intermediate_size=96, linear_num_key_heads=5,
        linear_num_value_heads=10, linear_key_head_dim=16, linear_value_head_dim=16,
    )),
    "qwen35": ("qwen3_5", dict(_WIDE, intermediate_size=3072)),
    "qwen35-moe": ("qwen3_5_moe", dict(_WIDE, intermediate_size=3072, **_MOE)),
    "qwen3-next": ("qwen3_next", dict(_WIDE, intermediate_size=3072, decoder_sparse_step=1,
                                      mlp_only_layers=[], norm_topk_prob=True, **_MOE)),
}  # fmt: skip


def hybrid_config(name: str, dtype_name: str) -> dict:
    """The config.json of hybrid `name`: Qwen3.5's nested in `text_config` as released,
    Qwen3-Next's flat."""
    model_type, text = HYBRIDS[name]
    torch_dtype = {"fp16": "float16", "bf16": "bfloat16"}.get(dtype_name, "float32")
    text = {**_TEXT, **text, "torch_dtype": torch_dtype}
    if model_type == "qwen3_next":
        config = {**text, "model_type": model_type, **_ROPE}
        config.pop("rope_type")
    else:
        text = {**text, "model_type": f"{model_type}_text", "rope_parameters": _ROPE}
        config = {"model_type": model_type, "text_config": text, "tie_word_embeddings": False}
    return {**config, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": torch_dtype}


def write_hybrid(name: str, dtype_name: str, dtype: mx.Dtype, out: Path, seed: int) -> dict:
    """Write hybrid `name`'s weights into `out` (mlx-lm's model, random weights scaled so
    that activations stay O(1), then cast or quantized) and return its config.json."""
    from mlx.utils import tree_flatten, tree_unflatten

    config = hybrid_config(name, dtype_name)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    key = mx.random.key(seed)
    params = []
    for path, v in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        if path.endswith("A_log"):
            w = mx.log(mx.random.uniform(1.0, 16.0, v.shape, key=sub))
        elif path.endswith("dt_bias"):
            w = 0.5 * mx.random.normal(v.shape, key=sub)
        elif "conv1d" in path:
            w = 0.5 * mx.random.normal(v.shape, key=sub)
        elif "norm" in path:
            w = mx.ones(v.shape)
        else:
            w = mx.random.normal(v.shape, key=sub) * v.shape[-1] ** -0.5
        params.append((path, w.astype(mx.float32 if "A_log" in path else dtype)))
        mx.eval(params[-1][1])
    model.update(tree_unflatten(params))
    if dtype_name == "q4":
        from mlx_lm.utils import quantize_model

        predicate = getattr(model, "quant_predicate", None)
        model, config = quantize_model(model, config, 64, 4, quant_predicate=predicate)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return config
