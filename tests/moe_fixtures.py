"""The tiny Qwen3 and mixture-of-experts checkpoints the MoE tests load, in every format.

`families(root)` writes the Hugging Face fixtures (float32, per-expert tensors as HF
stores them); `quantized(root)` MLX folders written by mlx-lm's own convert (4- and
8-bit, experts stacked under switch_mlp); `ggufs(root)` GGUF files of several families
written with the gguf package, quantized by gguf-py. Expert counts are odd or uneven
over 2, 3 and 4 ranks; widths split over 4 ranks (on 32-value groups when quantized).
`config_variant(src, path, **changes)` copies a folder with changes to its config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fixtures import glm_config, mla_config, moe_config, write_hf_model
from gguf_writer import Q4_0, Q4_1, Q5_1, Q8_0, gguf_from_hf

FAMILIES = {
    "qwen3": dict(model_type="qwen3", n_heads=4, n_kv_heads=2, head_dim=32, tie=True),
    # norm_topk_prob, and a dense layer (mlp_only_layers) between expert layers
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        **moe_config("qwen3_moe", 7, 2, 48, dense_layers=(1,)),
    ),
    "qwen3_moe_unnormed": dict(
        model_type="qwen3_moe",
        n_heads=4,
        n_kv_heads=2,
        **moe_config("qwen3_moe", 6, 3, 32, norm_topk_prob=False),
    ),
    "mixtral": dict(
        model_type="mixtral",
        n_heads=8,
        n_kv_heads=2,
        hidden_dim=64,
        **moe_config("mixtral", 5, 2, 64),
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        n_heads=4,
        n_kv_heads=4,
        **moe_config("qwen2_moe", 6, 3, 32, shared_dim=64, norm_topk_prob=False),
    ),
    # latent attention (5 heads: uneven over 2, 3, 4), a dense first layer, 9 experts in 3
    # groups (top 3 of the best 2 groups), a shared expert
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        n_layers=3,
        n_heads=5,
        n_kv_heads=5,
        **mla_config(9, 3, 32, n_group=3, topk_group=2),
    ),
    # queries projected directly (no q_lora_rank), no shared expert, every layer experts
    "deepseek_v3_direct_q": dict(
        model_type="deepseek_v3",
        n_heads=3,
        n_kv_heads=3,
        **mla_config(5, 2, 32, shared=0, dense_layers=0, q_lora_rank=None),
    ),
    # GLM-4.5: 10 query and 5 KV heads of 16 (8 rotated), q/k norms, q/k/v biases, a dense first
    # layer, 7 experts of 37 columns and a shared expert; every width uneven over 2, 3 and 4
    "glm4_moe": dict(
        model_type="glm4_moe",
        n_layers=3,
        n_heads=10,
        n_kv_heads=5,
        head_dim=16,
        hidden_dim=61,
        **glm_config(7, 2, 37),
    ),
    # GLM-4.5-Air-like: no q/k norms, no biases, 8 experts in 2 groups (top 1), a quarter of
    # each head rotated, no dense layer
    "glm4_moe_air": dict(
        model_type="glm4_moe",
        n_heads=6,
        n_kv_heads=2,
        head_dim=16,
        **glm_config(
            8, 3, 35, n_group=2, topk_group=1, dense_layers=0, qk_norm=False, bias=False,
            partial_rotary_factor=0.25,
        ),
    ),
}  # fmt: skip
# Widths on 32-value groups (4 of them: 1 per rank on 4), heads of 32 columns.
QUANTIZABLE = {
    "qwen3_moe_g32": dict(
        model_type="qwen3_moe",
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        hidden_dim=128,
        **moe_config("qwen3_moe", 5, 2, 128, dense_layers=(0,)),
    ),
    "mixtral_g32": dict(
        model_type="mixtral",
        dim=128,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=128,
        **moe_config("mixtral", 5, 2, 128),
    ),
    "qwen2_moe_g32": dict(
        model_type="qwen2_moe",
        dim=128,
        n_heads=4,
        n_kv_heads=4,
        **moe_config("qwen2_moe", 6, 3, 128, shared_dim=128, norm_topk_prob=False),
    ),
}
# DeepSeek-V3 on 32-value groups: heads of 32 + 16 query columns, 32 value columns, a latent
# of 64, 6 experts of 128 columns in 2 groups (mlx-lm's convert quantizes it; no GGUF)
DEEPSEEK_G32 = dict(
    model_type="deepseek_v3",
    dim=128,
    n_layers=2,
    n_heads=3,
    n_kv_heads=3,
    hidden_dim=128,
    **mla_config(6, 2, 128, n_group=2, q_lora_rank=64, kv_lora_rank=64, nope=32, rope=16, v=32),
)
# GLM-4.5 on 32-value groups (mlx-lm's convert quantizes it): heads of 32 (16 rotated),
# 5 experts of 128 columns, a shared expert, a dense first layer
GLM_G32 = dict(
    model_type="glm4_moe",
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    hidden_dim=128,
    **glm_config(5, 2, 128),
)
EXPERTS = "blk.*.ffn_{}_exps.weight"


def families(root: Path, names=FAMILIES, tokenizer: bool = False) -> dict[str, Path]:
    return {
        name: write_hf_model(root / name, tokenizer=tokenizer, seed=i, **kw)
        for i, (name, kw) in enumerate(names.items())
    }


def quantized(root: Path) -> dict[str, Path]:
    """mlx-lm's convert of four quantizable fixtures: 4-bit and 8-bit, groups of 32."""
    from mlx_lm import convert

    more = {"deepseek_v3_g32": DEEPSEEK_G32, "glm4_moe_g32": GLM_G32}
    src = families(root / "src", {**QUANTIZABLE, **more}, tokenizer=True)
    out = {}
    names = ("qwen3_moe_g32", 4), ("mixtral_g32", 8), ("deepseek_v3_g32", 4), ("glm4_moe_g32", 4)
    for name, bits in names:
        out[f"{name}-q{bits}"] = root / f"{name}-q{bits}"
        convert(
            str(src[name]), str(out[f"{name}-q{bits}"]), quantize=True, q_bits=bits, q_group_size=32
        )
    return out


# DeepSeek-V3's attention and GLM-4.5's in gguf-py's exact types where the widths allow
ROUTED_TYPES = {
    "blk.*.attn_q_b.weight": Q4_1,
    "blk.*.attn_k_b.weight": Q8_0,
    "blk.*.attn_v_b.weight": Q4_0,
    "blk.*.attn_kv_a_mqa.weight": Q8_0,
    "blk.*.attn_output.weight": Q8_0,
    "blk.*.ffn_gate.weight": Q4_0,
}
# DeepSeek-V3 with YaRN (DeepSeek-V3's own scaling: mscale = mscale_all_dim = 1)
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def ggufs(root: Path) -> dict[str, Path]:
    """GGUF files: qwen3 (float32), and qwen3moe, llama with experts (Mixtral) and
    qwen2moe with their experts and attention in gguf-py's exact types; deepseek2 (its
    attn_k_b / attn_v_b, and an older conversion's attn_kv_b; one with YaRN) and glm4moe
    (a multi-token prediction layer after the last) in float32, and quantized. The
    Hugging Face folder each was written from is `root / "src" / NAME`."""
    routed = {
        "deepseek_v3": FAMILIES["deepseek_v3"],
        "deepseek_v3_yarn": {**FAMILIES["deepseek_v3"], "rope_scaling": YARN},
        "glm4_moe": FAMILIES["glm4_moe"],
        "deepseek_v3_g32": DEEPSEEK_G32,
        "glm4_moe_g32": GLM_G32,
    }
    src = families(root / "src", {"qwen3": FAMILIES["qwen3"], **QUANTIZABLE, **routed})
    types = {
        EXPERTS.format("gate"): Q8_0,
        EXPERTS.format("up"): Q5_1,
        EXPERTS.format("down"): Q4_0,
        "blk.*.attn_q.weight": Q4_1,
        "blk.*.ffn_down_shexp.weight": Q8_0,
    }
    out = {"qwen3.gguf": gguf_from_hf(src["qwen3"], root / "qwen3.gguf")}
    for name in QUANTIZABLE:
        out[f"{name}.gguf"] = gguf_from_hf(src[name], root / f"{name}.gguf", types)
    for name in ("deepseek_v3", "deepseek_v3_yarn", "glm4_moe"):
        out[f"{name}.gguf"] = gguf_from_hf(src[name], root / f"{name}.gguf")
    kv_b = root / "deepseek_v3_kv_b.gguf"
    out[kv_b.name] = gguf_from_hf(src["deepseek_v3"], kv_b, split_kv_b=False)
    for name in ("deepseek_v3_g32", "glm4_moe_g32"):
        out[f"{name}.gguf"] = gguf_from_hf(src[name], root / f"{name}.gguf", types | ROUTED_TYPES)
    return out


def config_variant(src: Path, path: Path, **changes) -> Path:
    """A copy of the folder `src` with `changes` to its config.json."""
    shutil.copytree(src, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path
