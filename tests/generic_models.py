"""The table of mlx-lm architectures llama_tp runs on mlx-lm's own classes, and tiny
random-weight folders of each, written by mlx-lm's own `Model` (the oracle).

    names = architectures()                  # every text architecture of the installed mlx-lm
    write_model("gemma3", out / "gemma3")    # config.json, model.safetensors, a tokenizer

`CONFIG` makes each architecture tiny (hidden 64, 6 layers, 4 query heads, 2 KV heads,
4 experts, a window of 8, a vocabulary of 389); `OVERRIDES` adds what an architecture's
`ModelArgs` requires beyond those. `NOT_RUN` lists the architectures mlx-lm itself cannot
run on this machine, `NO_PIPELINE` those whose forward cannot be cut into stages, each with
its reason; every other architecture must give mlx-lm's greedy tokens on one process and
on 2 and 3 pipeline ranks (tests/test_generic.py). `STYLE_TABLE`: the architectures
without a `shard()` whose layers the style table splits by tensor. docs/models.md is
rendered from this table (`render_models_md`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import shutil
import sys
from pathlib import Path

import mlx.core as mx

_QWEN35_ROPE = {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}

# Keys every tiny config carries (an architecture's ModelArgs takes the ones it knows, as
# mlx-lm's `from_dict` does).
CONFIG = dict(
    hidden_size=64, d_model=64, n_embd=64, model_dim=64,
    num_hidden_layers=6, num_layers=6, n_layer=6, n_layers=6, num_transformer_layers=6,
    intermediate_size=128, ffn_hidden_size=128, n_inner=128, ff_intermediate_size=128,
    intermediate_size_mlp=128,
    num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, num_query_heads=4,
    num_key_value_heads=2, n_kv_heads=2, num_kv_heads=2,
    head_dim=16, vocab_size=389,
    max_position_embeddings=1024, n_positions=1024, n_ctx=1024, block_size=1024,
    model_max_length=1024,
    rms_norm_eps=1e-5, layer_norm_epsilon=1e-5, layer_norm_eps=1e-5, norm_eps=1e-5,
    layernorm_epsilon=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    moe_intermediate_size=32, expert_ffn_hidden_size=32, shared_expert_intermediate_size=32,
    shared_intermediate_size=32, num_experts=4, n_routed_experts=4, num_local_experts=4,
    moe_num_experts=4, num_experts_per_tok=2, moe_topk=2, n_shared_experts=1,
    num_shared_experts=1, num_shared_expert=1, n_group=1, topk_group=1,
    first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    sliding_window=8, attention_window_size=8, sliding_window_size=8,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4,
    state_size=8, conv_kernel=4, time_step_rank=8, ssm_state_size=8, mamba_d_state=8,
    mamba_d_conv=4, mamba_expand=2, n_groups=1, mamba_num_heads=4, mamba_head_dim=16,
    partial_rotary_factor=0.5, rotary_pct=0.5, attention_bias=False, mlp_bias=False,
    use_bias=False,
)  # fmt: skip
_ALTERNATING = ["sliding_attention", "full_attention"] * 3
_GROUPED_ROPE = {kind: {"rope_theta": 10000.0} for kind in ("full_attention", "sliding_attention")}
_LINEAR_ATTN = {
    "kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6], "num_heads": 4, "head_dim": 16,
    "short_conv_kernel_size": 4,
}  # fmt: skip
_LFM2 = dict(
    conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=32,
    block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=128,
    full_attn_idxs=[1, 4],
)  # fmt: skip
_GRANITE = dict(logits_scaling=2.0, attention_multiplier=0.25, embedding_multiplier=2.0,
                residual_multiplier=0.5)  # fmt: skip
_LLAMA4_SCALING = {"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                   "original_max_position_embeddings": 1024}  # fmt: skip
# What an architecture's ModelArgs needs beyond CONFIG ("text_config": merged into the
# text part of a wrapper).
OVERRIDES: dict[str, dict] = {
    "Klear": dict(mlp_only_layers=[], decoder_sparse_step=1),
    "afm7": dict(hidden_dim=64, num_kv_reuse_layers=2),
    "afmoe": dict(layer_types=_ALTERNATING, num_dense_layers=1),
    "apertus": dict(post_norm=False, qk_norm=True),
    "baichuan_m1": dict(sliding_window_layers=[1, 3, 5], conv_window=2),
    "bailing_hybrid": dict(layer_group_size=2, group_norm_size=1),
    "bailing_moe_linear": dict(layer_group_size=2, group_norm_size=1),
    "dbrx": dict(ffn_config={"ffn_hidden_size": 96, "moe_num_experts": 4, "moe_top_k": 2},
                 attn_config={"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 10000}),
    "deepseek_v2": dict(rope_scaling={
        "factor": 1.0, "original_max_position_embeddings": 1024, "type": "yarn", "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    "exaone4": dict(rope_scaling=None, sliding_window_pattern="LLG",
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
    "exaone_moe": dict(layer_types=_ALTERNATING, is_moe_layer=[False] + [True] * 5),
    "gear": dict(layer_types=_ALTERNATING),
    "gemma3n": dict(text_config=dict(
        model_type="gemma3n_text", num_kv_shared_layers=2, vocab_size_per_layer_input=389,
        rope_local_base_freq=10000.0, final_logit_softcapping=30.0, layer_types=_ALTERNATING,
        activation_sparsity_pattern=[0.0] * 6, hidden_size_per_layer_input=8,
        altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
        altup_active_idx=0, laurel_rank=8)),
    "gemma4": dict(text_config=dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                                    global_head_dim=16, sliding_window_pattern=2)),
    "gemma4_text": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                        global_head_dim=16, sliding_window_pattern=2),
    "glm4_moe": dict(rope_scaling=None, use_qk_norm=True),
    "glm_moe_dsa": dict(index_head_dim=16, index_n_heads=2, index_topk=4, topk_method="noaux_tc",
                        scoring_func="sigmoid", moe_layer_freq=1,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
    "gpt_neox": dict(rotary_emb_base=10000),
    "gptj": dict(rotary_dim=8),
    "granite": _GRANITE,
    "granitemoe": _GRANITE,
    "granitemoehybrid": dict(_GRANITE, layer_types=["mamba", "attention"] * 3, mamba_n_heads=8,
                             mamba_d_head=16, mamba_n_groups=1),
    "hunyuan": dict(rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
                    use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=False, cla_share_factor=2),
    "jamba": dict(attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                  expert_layer_period=2),
    "kimi_k3": dict(text_config=dict(
        model_type="kimi_linear", linear_attn_config=_LINEAR_ATTN, activation_situ_beta=1.0,
        activation_situ_linear_beta=1.0, num_experts_per_token=2, num_key_value_heads=4)),
    "kimi_linear": dict(linear_attn_config=_LINEAR_ATTN, num_experts_per_token=2),
    "lfm2": _LFM2,
    "lfm2-vl": dict(text_config=dict(_LFM2, model_type="lfm2")),
    "lfm2_moe": dict(use_expert_bias=True, num_dense_layers=1, conv_bias=False, conv_L_cache=3,
                     full_attn_idxs=[1, 4]),
    "llama4": dict(text_config=dict(
        model_type="llama4_text", attention_chunk_size=8, interleave_moe_layer_step=2,
        rope_scaling=None, use_qk_norm=True, no_rope_layers=[1, 1, 1, 0, 1, 1],
        num_experts_per_tok=1)),
    "llama4_text": dict(no_rope_layers=[1, 1, 1, 0, 1, 1], use_qk_norm=True),
    "longcat_flash": dict(attention_method="MLA", zero_expert_type="identity", zero_expert_num=2,
                          mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "longcat_flash_ngram": dict(zero_expert_num=2, mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "mamba": dict(use_conv_bias=True),
    "mamba2": dict(use_conv_bias=True, time_step_limit=[0.0, 1e9], num_heads=8, head_dim=16),
    "mellum": dict(rope_parameters=_GROUPED_ROPE, layer_types=_ALTERNATING),
    "mimo_v2_flash": dict(
        hybrid_layer_pattern=[0, 1, 1, 0, 1, 1], moe_layer_freq=[0, 1, 1, 1, 1, 1],
        add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
        topk_method="noaux_tc", scoring_func="sigmoid", swa_rope_theta=10000.0,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, swa_v_head_dim=16),
    "minicpm": dict(dim_model_base=32, scale_depth=1.4, scale_emb=2.0),
    "minicpm3": dict(dim_model_base=32, scale_depth=1.4, scale_emb=2.0, rope_scaling={
        "original_max_position_embeddings": 1024, "short_factor": 1.0, "long_factor": 1.0}),
    "minimax": dict(rotary_dim=8),
    "ministral3": dict(rope_parameters=_LLAMA4_SCALING),
    "mistral4": dict(rope_parameters=dict(_LLAMA4_SCALING, rope_type="default")),
    "muse_spark": dict(text_config=dict(
        num_shared_experts=0, post_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        layer_rope_theta=[10000.0, 0, 10000.0, 10000.0, 0, 10000.0], layer_types=_ALTERNATING,
        final_logit_softcapping=30.0, output_multiplier=1.0, moe_hidden_size=64)),
    "nemotron": dict(hidden_act="relu2"),
    "nemotron-nas": dict(block_configs=[{
        "attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
        "ffn": {"ffn_mult": 1.5, "no_op": False, "replace_with_linear": False}}] * 6),
    "nemotron_h": dict(mamba_proj_bias=False, use_conv_bias=True,
                       hybrid_override_pattern=list("M-*M-*"), time_step_limit=[0.0, 1e9]),
    "olmo_hybrid": dict(linear_allow_neg_eigval=True,
                        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2),
    "openelm": dict(ffn_dim_divisor=16, num_query_heads=[4] * 6, num_kv_heads=[2] * 6,
                    ffn_multipliers=[2.0] * 6),
    "phi3small": dict(dense_attention_every_n_layers=2, gegelu_limit=20.0),
    "phixtral": dict(rotary_dim=8, num_vocab=389),
    "plamo": dict(n_shared_head=2),
    "qwen": dict(intermediate_size=256, kv_channels=16),
    # mlx-lm's Qwen2-MoE never renormalizes its top-k (llama_tp's follows the config, as
    # transformers does); the released configs say false
    "qwen2_moe": dict(norm_topk_prob=False),
    # mlx-lm's shard() of Qwen3.5 splits the vocabulary too: an even one. Its RoPE comes
    # from rope_parameters alone (a default one when absent, whatever rope_theta says),
    # which every release has: given, as theirs is
    "qwen3_5": dict(text_config=dict(vocab_size=390, rope_parameters=_QWEN35_ROPE)),
    "qwen3_5_moe": dict(text_config=dict(vocab_size=390, rope_parameters=_QWEN35_ROPE)),
    "qwen3_moe": dict(decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_next": dict(decoder_sparse_step=1, mlp_only_layers=[], full_attention_interval=3),
    "qwen3_vl_moe": dict(text_config=dict(model_type="qwen3_vl_moe", decoder_sparse_step=1,
                                          mlp_only_layers=[])),
    "recurrent_gemma": dict(conv1d_width=4, logits_soft_cap=30.0,
                            block_types=["recurrent", "recurrent", "attention"]),
    "rwkv7": dict(a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8, decay_low_rank_dim=8),
    "spark2_5": dict(rope_parameters={
        "full_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        layer_types=_ALTERNATING),
    "stablelm": dict(use_qkv_bias=False),
    "step3p5": dict(num_attention_groups=2, moe_num_experts=4, moe_top_k=2,
                    moe_intermediate_size=32, share_expert_dim=32, layer_types=_ALTERNATING),
}  # fmt: skip
# The architectures mlx-lm itself cannot run on this machine (not counted as failures of
# llama_tp's, but they stay in the denominator of docs/models.md's share).
NOT_RUN: dict[str, str] = {
    "bitnet": "its BitLinear kernel is Metal-only (mlx-lm fails on a CPU)",
    "muse_spark": "its kernels are Metal-only (mlx-lm fails on a CPU)",
    "olmo": "needs the ai2-olmo package (mlx-lm exits on import without it)",
    "phi3small": "mlx-lm's block-sparse attention corrupts memory on a CPU (the process aborts)",
    "prism_hadamard_qwen35": "a Hadamard-rotated quantized pack, not a model one can write",
}
# Architectures whose forward cannot be cut into pipeline stages, with the reason.
NO_PIPELINE: dict[str, str] = {
    "afm7": "its last layers reuse the keys and values of an earlier one (a second list)",
    "gemma3n": "layers reuse the keys and values of earlier layers",
    "iquestloopcoder": "its forward runs the layers' parts itself, in two loops",
    "rwkv7": "the first layer's values feed every later layer",
}
# Architectures without a shard() whose every layer the style table splits by tensor.
STYLE_TABLE: tuple[str, ...] = (
    "cohere", "cohere2", "deepseek", "ernie4_5", "ernie4_5_moe", "exaone4", "gear", "gemma",
    "gemma2", "gemma3", "gemma3_text", "granite", "helium", "hunyuan_v1_dense", "internlm3",
    "mellum", "mimo", "minicpm", "mistral3", "nanbeige", "nemotron", "nemotron-nas", "pixtral",
    "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "seed_oss", "smollm3", "stablelm", "telechat3",
)  # fmt: skip

# A folder of an architecture's own keys only ("<name>+own": its ModelArgs' fields, as a
# release's config.json holds them) beside CONFIG's, for the architectures that name the
# hidden width otherwise (d_model, n_embd, model_dim) and have an output head of their own:
# CONFIG's hidden_size hid that a later stage read the width from the embedding it had
# dropped ("tuple index out of range" on rank 1). They run on one process and on 2
# pipeline ranks (dbrx, gpt_bigcode, gptj, phixtral).
OWN_KEYS = "+own"

PROMPT = [1, 5, 9, 33, 70, 12, 100, 7, 250, 3]
NEW_TOKENS = 8


def architectures() -> list[str]:
    """Every architecture module of the installed mlx-lm (a `Model` and a `ModelArgs`)."""
    import mlx_lm.models as models

    out = []
    for m in sorted(pkgutil.iter_modules(models.__path__), key=lambda m: m.name):
        if m.name in NOT_RUN:
            out.append(m.name)
            continue
        try:
            module = importlib.import_module(f"mlx_lm.models.{m.name}")
        except (ImportError, SystemExit):
            continue
        if hasattr(module, "Model") and hasattr(module, "ModelArgs"):
            out.append(m.name)
    return out


def runnable() -> list[str]:
    """The architectures this machine runs (mlx-lm can): on mlx-lm's classes, or natively."""
    return [a for a in architectures() if a not in NOT_RUN]


def own_keys() -> list[str]:
    """The "<name>+own" folders (`OWN_KEYS`): every architecture on mlx-lm's classes that
    splits into stages, whose ModelArgs has no hidden_size (nor a text_config) and whose
    output head is not the embedding (tied, the last of 2 stages holds it)."""
    from llama_tp.generic.structure import find_structure

    out = []
    for a in runnable():
        if native(a) or a in NO_PIPELINE:
            continue
        module = _module(a)
        if {f.name for f in dataclasses.fields(module.ModelArgs)} & {"hidden_size", "text_config"}:
            continue
        model = module.Model(module.ModelArgs.from_dict(config_for(a + OWN_KEYS)))
        if find_structure(model, CONFIG["vocab_size"]).head is not None:
            out.append(a + OWN_KEYS)
    return out


def _module(name: str):
    return importlib.import_module(f"mlx_lm.models.{name.removesuffix(OWN_KEYS)}")


def native(name: str) -> bool:
    """llama_tp implements `name`: a registry row, or a multimodal wrapper of one whose
    text model the HF reader takes (gemma3 -> gemma3_text)."""
    from llama_tp.checkpoints.hf import WRAPPED
    from llama_tp.models.registry import MODEL_TYPES

    return name in MODEL_TYPES or name in WRAPPED


def tensor_split(name: str) -> str | None:
    """What splits architecture `name` by tensor: "the native plan", "mlx-lm's shard()", "the
    style table" (STYLE_TABLE), or None (a tensor split is refused: --pp instead)."""
    if native(name):
        return "the native plan"
    module = importlib.import_module(f"mlx_lm.models.{name}")
    if callable(getattr(module.Model, "shard", None)):
        return "mlx-lm's shard()"
    return "the style table" if name in STYLE_TABLE else None


def render_models_md() -> str:
    """docs/models.md's table: every architecture of the installed mlx-lm, the path it runs
    on, and how it splits (rendered from this table; tests/test_generic.py checks both)."""
    import mlx_lm

    every = architectures()
    stages = [a for a in every if a not in NOT_RUN and a not in NO_PIPELINE]
    lines = [
        f"mlx-lm {mlx_lm.__version__} has {len(every)} text architectures; {len(stages)} of them "
        f"({100 * len(stages) // len(every)}%) split into pipeline stages here, each giving "
        "mlx-lm's greedy tokens on one process and on 2 and 3 launched pipeline ranks "
        "(tests/test_generic.py).",
        "",
        "| architecture | runs on | pipeline stages (`--pp N`) | tensor split (`-n N`) |",
        "| --- | --- | --- | --- |",
    ]
    for a in every:
        if a in NOT_RUN:
            lines.append(f"| `{a}` | not run here: {NOT_RUN[a]} | | |")
            continue
        path = "native" if native(a) else "mlx-lm's classes"
        pp = "yes" if a not in NO_PIPELINE else f"no: {NO_PIPELINE[a]}"
        tp = tensor_split(a) or "no (`--pp N` instead)"
        lines.append(f"| `{a}` | {path} | {pp} | {tp} |")
    return "\n".join(lines) + "\n"


def config_for(name: str) -> dict:
    """The tiny config of `name` (CONFIG and its OVERRIDES; a "+own" name: only the keys its
    ModelArgs takes)."""
    base, module = name.removesuffix(OWN_KEYS), _module(name)
    fields = {f.name for f in dataclasses.fields(module.ModelArgs)}
    config = dict(CONFIG, model_type=base)
    if "text_config" in fields:
        config["text_config"] = dict(CONFIG, model_type=base)
    extra = dict(OVERRIDES.get(base, {}))
    if "text_config" in extra:
        config["text_config"] = dict(config["text_config"], **extra.pop("text_config"))
    config |= extra
    if name.endswith(OWN_KEYS):
        config = {k: v for k, v in config.items() if k in fields or k == "model_type"}
    return config


def write_model(name: str, out: Path, tokenizer: Path | None = None, seed: int = 0) -> Path:
    """A tiny random-weight mlx-lm folder of architecture `name` at `out` (config.json,
    model.safetensors as mlx_lm.convert writes them, and `tokenizer`'s files if given).
    The weights are mlx-lm's initializers, made less regular so that the greedy tokens vary
    (norms off one, projections scaled up)."""
    from mlx.utils import tree_flatten

    module = _module(name)
    config = config_for(name)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for k, v in weights.items():
        if not mx.issubdtype(v.dtype, mx.floating):
            continue
        if v.size > 1 and mx.all(v == v.reshape(-1)[0]).item():
            weights[k] = v + 0.2 * mx.random.normal(v.shape).astype(v.dtype)
        elif v.ndim >= 2:
            weights[k] = v * 2.5
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in tokenizer.iterdir() if tokenizer else ():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)
    return out


def mlx_lm_greedy(path: Path, prompt: list[int] = PROMPT, n: int = NEW_TOKENS) -> list[int]:
    """mlx-lm's own greedy tokens for `prompt` (its load_model and generate_step)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    return [int(t) for t, _ in steps]


if __name__ == "__main__":
    # python tests/generic_models.py --models-md: docs/models.md's table
    # python tests/generic_models.py OUT [NAME...]: write the folders
    if sys.argv[1] == "--models-md":
        print(render_models_md(), end="")
    else:
        for name in sys.argv[2:] or runnable():
            print(write_model(name, Path(sys.argv[1]) / name))
