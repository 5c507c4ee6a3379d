"""What a mixture-of-experts model llama_tp cannot run says: one `error:` line naming
the architecture (and the supported list), the inconsistent expert config or the GGUF
whose expert tensors disagree with its metadata, with the numbers; on every rank when
the ranks outnumber the experts. The models themselves: test_moe.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import launch, run_python
from fixtures import moe_config
from moe_fixtures import config_variant, families


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The Hugging Face fixtures (as test_moe.py's, without the quantized and GGUF files)."""
    return families(tmp_path_factory.mktemp("moe"), tokenizer=True)


def _one_error(r, expected: str) -> None:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert errors[0] == f"error: {expected}", errors[0]
    assert r.returncode == 1, r.stderr


def _generate(path) -> list[str]:
    return ["-m", "llama_tp.generate", "--model", str(path), "--prompt", "hi", "-m", "2"]


def test_refusals_are_one_line(models, tmp_path):
    """An architecture neither llama_tp nor mlx-lm runs names itself and the native list; an
    inconsistent expert config, or a GGUF whose expert tensors disagree with its
    metadata, is one line with the numbers."""
    from gguf_writer import gguf_from_hf, tiny_llama_gguf

    def variant(name: str, base: str = "qwen3_moe", **changes) -> Path:
        return config_variant(models[base], tmp_path / name, **changes)

    from llama_tp.models.registry import GGUF_FAMILIES, MODEL_TYPES

    gguf_supported = ", ".join(GGUF_FAMILIES)

    supported = ", ".join(MODEL_TYPES)
    assert (
        supported.startswith("llama, mistral, qwen2, qwen3, mixtral") and "gemma4_text" in supported
    )
    import mlx_lm

    path = variant("nonesuch", model_type="nonesuch")  # olmo2 runs on mlx-lm's classes
    _one_error(
        run_python(_generate(path)),
        f"{path / 'config.json'}: unsupported model_type 'nonesuch': not native ({supported}) "
        f"and not in mlx-lm {mlx_lm.__version__}",
    )
    path = variant("topk", num_experts_per_tok=9)
    _one_error(
        run_python(_generate(path)),
        f"{path / 'config.json'}: model config: 9 experts per token (top-k) with 7 experts: "
        "need 1 <= top-k <= experts",
    )
    path = variant("count", num_experts=8)
    _one_error(
        run_python(_generate(path)),
        f"{path}: model.layers.0.mlp.switch_mlp.down_proj.weight holds 7 experts but "
        "config.json's num_experts is 8",
    )
    path = variant("groups", "deepseek_v3", n_group=4)
    _one_error(
        run_python(_generate(path)),
        f"{path / 'config.json'}: model config: 9 experts in 4 groups, top 2 groups, top-k 3: "
        "need groups of at least 2 experts, 1 <= topk_group <= n_group and top-k <= the "
        "experts of topk_group groups",
    )
    path = variant("greedy", "deepseek_v3", topk_method="greedy")
    _one_error(
        run_python(_generate(path)),
        f"{path / 'config.json'}: model config: routing 'greedy' with 'sigmoid' scores is not "
        "supported (DeepSeek-V3's is 'noaux_tc' with 'sigmoid')",
    )
    path = variant("latent", "deepseek_v3", kv_lora_rank=16)
    _one_error(
        run_python(_generate(path)),
        f"{path}: model.layers.0.self_attn.kv_b_proj.weight has shape [160, 32], but 5 heads "
        "of 16 + 16 rows over a latent of 16 need [160, 16]",
    )
    path = variant("rotary", "glm4_moe", partial_rotary_factor=1.5)
    _one_error(
        run_python(_generate(path)),
        f"{path / 'config.json'}: model config: 24 rotary values per head of 16: need an even "
        "count from 2 to head_dim",
    )
    path = variant("glm_count", "glm4_moe", n_routed_experts=6)
    _one_error(
        run_python(_generate(path)),
        f"{path}: model.layers.1.mlp.switch_mlp.down_proj.weight holds 7 experts but "
        "config.json's n_routed_experts is 6",
    )
    gguf = gguf_from_hf(models["qwen3_moe"], tmp_path / "count.gguf", expert_count=8)
    _one_error(
        run_python(_generate(gguf)),
        f"{gguf}: blk.0.ffn_down_exps.weight holds 7 experts but qwen3moe.expert_count is 8",
    )
    gguf = tiny_llama_gguf(tmp_path / "g.gguf", metadata={"general.architecture": "falcon"})
    _one_error(
        run_python(_generate(gguf)),
        f"{gguf}: unsupported GGUF architecture 'falcon' (supported: {gguf_supported})",
    )
    src = models["deepseek_v3"]
    gguf = gguf_from_hf(src, tmp_path / "v2.gguf", expert_gating_func=1)
    _one_error(
        run_python(_generate(gguf)),
        f"{gguf}: deepseek2.expert_gating_func is 1 (softmax routing, DeepSeek-V2's, when "
        "missing or 1): only sigmoid routing (2) is read",
    )
    gguf = gguf_from_hf(src, tmp_path / "kv_b.gguf", {"blk.*.attn_kv_b.weight": 8}, False)
    _one_error(
        run_python(_generate(gguf)),
        f"{gguf}: blk.0.attn_kv_b.weight is Q8_0: a quantized attn_kv_b cannot be split per "
        "head; llama.cpp's newer conversions store attn_k_b and attn_v_b",
    )


def test_refusal_on_every_rank(tmp_path):
    """More ranks than experts, split by expert: every rank stops, one line."""
    two = dict(model_type="mixtral", n_heads=4, n_kv_heads=2, **moe_config("mixtral", 2, 1, 96))
    path = families(tmp_path, {"two_experts": two}, tokenizer=True)["two_experts"]
    r = launch(3, [*_generate(path), "--moe-split", "expert"], timeout=120, ring=True)
    _one_error(
        r,
        "cannot split 2 experts over 3 ranks by expert: at most 2 ranks (split them by "
        "tensor instead)",
    )
    for rank in range(3):
        assert re.search(rf"Node with rank {rank} exited with code (1|-15)\b", r.stderr)
