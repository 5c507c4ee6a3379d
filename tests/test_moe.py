"""Qwen3 and mixture-of-experts models (issue 26): Qwen3, Qwen3-MoE (with and without
norm_topk_prob, a dense layer among expert layers), Mixtral and Qwen2-MoE (a shared
expert); DeepSeek-V3 (issue 30: multi-head latent attention, grouped sigmoid routing with
the score-correction bias, shared experts, dense first layers). mlx-lm's own
implementations of the same architectures, loaded from the same folders, are the oracle
in one process; GGUF files are held to the float64 reference
(`reference64.py`); every multi-rank launch checks several models under both expert
splits against one process (`mp_moe.py`), and what each rank's loader held. What
llama_tp refuses to run, and how it says so: test_moe_refusals.py.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import ROOT, launch, run_python
from family_kit import greedy, greedy_mlx_lm
from moe_fixtures import FAMILIES, config_variant, families, ggufs, quantized

DATA = ROOT / "tests" / "data"
ATOL = 1e-4
K_QUANT = DATA / "llamacpp-qwen3moe-Q4_K_M.gguf"  # llama.cpp's quantizer (make_llama_cpp_ggufs)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    out = families(root, tokenizer=True)  # convert and serve need one
    out |= quantized(root / "mlx")
    out |= ggufs(root / "gguf")
    return out


def test_one_process_equals_mlx_lm(models, tmp_path):
    """Logits within 1e-4 (float32) and 32 greedy tokens identical to mlx-lm's model of
    the same folder: Hugging Face (per-expert tensors, DeepSeek's kv_b_proj), mlx-lm's
    4/8-bit folders, llama_tp's convert of a DeepSeek-V3 to 4 bits and of a GLM-4.5."""
    from mlx_lm.utils import MODEL_REMAPPING, load_model

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.convert import convert

    quantized = ("qwen3_moe_g32-q4", "mixtral_g32-q8", "deepseek_v3_g32-q4", "glm4_moe_g32-q4")
    paths = {k: models[k] for k in (*FAMILIES, *quantized)}
    paths["converted"] = convert(
        models["deepseek_v3"], tmp_path / "converted", quantize=4, group_size=32, progress=False
    )
    paths["glm4_converted"] = convert(models["glm4_moe"], tmp_path / "glm", progress=False)
    paths["kimi_k2"] = config_variant(
        models["deepseek_v3"], tmp_path / "kimi_k2", model_type="kimi_k2"
    )
    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    for name, path in paths.items():
        ours, theirs = build_model(open_checkpoint(path)), load_model(path)[0]
        model_type = json.loads((path / "config.json").read_text())["model_type"]
        assert type(theirs).__module__.endswith(MODEL_REMAPPING.get(model_type, model_type))
        diff = mx.abs(ours(x) - theirs(x)).max().item()
        assert diff <= ATOL, (name, diff)
        prompt = x[0].tolist()
        assert greedy(ours, prompt, 32) == greedy_mlx_lm(theirs, prompt, 32), name


def test_gguf_files_match_the_float64_reference(models):
    """GGUF files of every family (qwen3, qwen3moe, llama with experts, qwen2moe, deepseek2
    in both conversions, glm4moe; experts stacked, in gguf-py's Q8_0/Q5_1/Q4_0 and Q4_1
    attention: converted exactly) and llama.cpp's own Q4_K_M of a Qwen3-MoE: next-token
    log-probabilities against float64 over gguf-py's dequantization of the same bytes."""
    import reference64

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    tokens = [1, 5, 9, 22, 7, 100, 3, 250, 11, 12]
    yarn = "deepseek_v3_yarn.gguf"  # the reference has no YaRN: against safetensors above
    files = [p for name, p in models.items() if name.endswith(".gguf") and name != yarn]
    files.append(K_QUANT)
    for path in files:
        ckpt = open_checkpoint(path)
        got = np.array(build_model(ckpt)(mx.array([tokens]))[0])
        ref = reference64.logits(str(path), tokens)
        gap = reference64.top5_gap(got, ref)
        # Q6_K (in llama.cpp's Q4_K_M mix) is requantized to 8 bits: test_gguf_fidelity's bound
        assert gap <= (0.03 if path == K_QUANT else 1e-4), (path.name, gap)


def test_deepseek2_and_glm4moe_ggufs_equal_their_safetensors(models):
    """llama.cpp's deepseek2 (attn_k_b / attn_v_b, an older conversion's attn_kv_b, YaRN
    from its rope.scaling metadata) and glm4moe (partial RoPE from rope.dimension_count,
    its multi-token prediction layer dropped) files in float32: the logits and 32 greedy
    tokens of the same weights read from the Hugging Face folder."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    x = mx.array(np.random.default_rng(0).integers(0, 389, (1, 12)), mx.int32)
    names = ("deepseek_v3", "deepseek_v3_kv_b", "deepseek_v3_yarn", "glm4_moe")
    for name in names:
        path = models[f"{name}.gguf"]
        src = path.parent / "src" / name.removesuffix("_kv_b")
        ours, theirs = build_model(open_checkpoint(path)), build_model(open_checkpoint(src))
        assert ours.args.rope_scaling == theirs.args.rope_scaling, name
        diff = mx.abs(ours(x) - theirs(x)).max().item()
        assert diff <= ATOL, (name, diff)
        prompt = x[0].tolist()
        assert greedy(ours, prompt, 32) == greedy(theirs, prompt, 32), name


def _lines(r) -> list[dict]:
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines and all(x["ok"] for x in lines), f"{r.stdout}\n{r.stderr[-3000:]}"
    assert r.returncode == 0, r.stderr[-3000:]
    return lines


def test_two_ranks_every_format_both_splits(models, tmp_path):
    """Every model and format (llama.cpp's Q4_K_M of a Qwen3-MoE included: its 256-wide
    Q6_K down projections split inside a block), split by tensor and by expert, plus
    speculative decoding, sequence parallelism and perplexity; a folder pre-split by
    expert (convert --shards)."""
    from llama_tp.checkpoints.convert import convert

    skip = ("converted", "deepseek_v3_yarn.gguf")  # YaRN: the one-process test above
    specs = [str(p) for k, p in models.items() if k not in skip] + [str(K_QUANT)]
    for name in ("qwen3_moe", "deepseek_v3", "glm4_moe"):
        split = convert(models[name], tmp_path / name, shards=2, moe_split="expert", progress=False)
        specs.append(f"{split}={models[name]}")
    lines = _lines(launch(2, ["tests/mp_moe.py", *specs, "--extras"], timeout=600))
    assert len(lines) == 2 * len(specs) + 1
    by = {(Path(x["path"]).name, x["split"]): x for x in lines if "split" in x}
    # 7 experts by expert over 2 ranks: 4 and 3 of them (equal bytes each)
    a, b = by[("qwen3_moe", "expert")]["experts_per_rank"]
    assert a * 3 == b * 4


def test_three_ranks_both_splits(models):
    """Odd expert counts (5, 6, 7, 9) over 3 ranks: uneven by expert and by columns;
    DeepSeek-V3's 5 heads as 2, 2 and 1; GLM-4.5's 5 KV heads as 2, 2 and 1."""
    quantized = ("qwen3_moe_g32-q4", "qwen2_moe_g32.gguf", "deepseek_v3_g32-q4", "glm4_moe_g32-q4")
    ggufs = ("deepseek_v3_g32.gguf", "glm4_moe_g32.gguf")  # attn_kv_b: on 2 ranks
    names = (*FAMILIES, *quantized, *ggufs)
    specs = [str(models[k]) for k in names]
    r = launch(3, ["tests/mp_moe.py", *specs, "--steps", "8"], timeout=600)
    assert len(_lines(r)) == 2 * len(specs)


def test_four_ranks_and_a_tp2_x_pp2_mesh(models, tmp_path):
    """4 ranks, both splits, and the same models as 2 stages of 2 tensor ranks (a
    dense layer in one stage, expert layers in both), also pre-split for that mesh."""
    from llama_tp.loading.mesh_split import convert_mesh

    src = models["qwen3_moe"]
    folders = convert_mesh(
        src, tmp_path / "mesh", shards=4, tp=2, pp=2, moe_split="expert", progress=False
    )
    # Mixtral and Qwen2-MoE split over 2 and 3 ranks above (Mixtral also in the mesh)
    names = ("qwen3_moe", "deepseek_v3", "glm4_moe")
    specs = [str(models[k]) for k in names]
    meshes = ("qwen3_moe", "deepseek_v3", "glm4_moe", "mixtral_g32.gguf")
    specs += [f"{models[k]}@2,2" for k in meshes]
    specs.append(f"{folders}={src}@2,2")
    r = launch(4, ["tests/mp_moe.py", *specs, "--steps", "8"], timeout=600)
    lines = _lines(r)
    assert len(lines) == 2 * len(specs)
    assert sum(x["mesh"] == [2, 2] for x in lines) == 10


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_serve_concurrent_requests_on_two_ranks(tmp_path, family):
    """A MoE model on 2 ranks answers concurrent requests exactly as it answers each alone
    (batches route every row's tokens to the experts, and DeepSeek-V3's latent caches
    take the batch's masks; the prompt cache is on)."""
    from serve_client import Server, chat

    path = families(tmp_path, {family: FAMILIES[family]}, tokenizer=True)[family]
    server = Server(2, path, tmp_path, "--max-batch", "8", "--moe-split", "expert")
    try:
        server.wait_ready()
        c = server.client()
        prompts = ["hello", "The quick brown fox", "Tensor parallel", "abc", "xyz 0123"]
        alone = [chat(c, p, max_tokens=16)[0] for p in prompts]
        with ThreadPoolExecutor(5) as pool:
            together = list(pool.map(lambda p: chat(c, p, stream=True, max_tokens=16)[0], prompts))
        assert together == alone
    finally:
        server.close()


def test_plan_shows_experts_and_bytes_per_rank(models):
    """`plan` prints each rank's experts (or columns of each expert) and bytes: the
    placement the loader reads (the launches above assert the loader held exactly it)."""
    path = str(models["qwen3_moe"])
    by = run_python(["-m", "llama_tp.plan", "-n", "3", "--model", path, "--moe-split", "expert"])
    assert by.returncode == 0, by.stderr
    rows = [line.split() for line in by.stdout.splitlines() if line[:2] in ("0 ", "1 ", "2 ")]
    assert [r[7:9] for r in rows] == [["0-2", "[3]"], ["3-4", "[2]"], ["5-6", "[2]"]]
    assert "7 experts of 48 columns, split by expert" in by.stdout
    assert all(r[-1] in ("KiB", "MiB") for r in rows)
    assert "ShardInPlace(dim='experts', ranges)  experts 0-2 [3]" in by.stdout
    by = run_python(["-m", "llama_tp.plan", "-n", "3", "--model", path])
    rows = [line.split() for line in by.stdout.splitlines() if line[:2] in ("0 ", "1 ", "2 ")]
    assert [r[7:11] for r in rows][0] == ["0-6", "[7]", "0-15", "[16]"]


def test_plan_of_a_gguf_mix_from_a_config_is_the_files(tmp_path):
    """`plan --model DIR/config.json --gguf-quant Q4_K_M` gives every tensor the type
    llama.cpp's quantizer gave it in its own Q4_K_M files (tests/data), and prints, for
    the config of llama.cpp's Qwen3-MoE Q4_K_M, what `plan` of that file prints: the
    bytes each rank holds (converted to MLX) and its KV cache."""
    import gguf

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import skeleton
    from llama_tp.checkpoints.gguf import to_model_name
    from llama_tp.checkpoints.gguf_recipe import quantized_by, tensor_type
    from llama_tp.checkpoints.hf_config import hf_config

    for path in (K_QUANT, DATA / "llamacpp-Q4_K_M.gguf"):
        args = open_checkpoint(path).args
        for t in gguf.GGUFReader(path).tensors:
            module = to_model_name(t.name).removesuffix(".weight")
            if len(t.shape) < 2 or not quantized_by(module):
                continue
            kind = tensor_type(
                module, int(t.shape[0]), "Q4_K_M", args.n_layers, args.n_experts, False
            )
            assert kind == t.tensor_type.name, (path.name, t.name, kind)
    ckpt = open_checkpoint(K_QUANT)
    config = hf_config(ckpt, skeleton(ckpt))
    (tmp_path / "config.json").write_text(json.dumps(config))
    plans = [
        run_python(["-m", "llama_tp.plan", "-n", "3", "--model", *m])
        for m in ([str(K_QUANT)], [str(tmp_path / "config.json"), "--gguf-quant", "Q4_K_M"])
    ]
    assert all(p.returncode == 0 for p in plans), plans[1].stderr
    file, alone = (p.stdout.split("3 ranks:")[1].split("KV cache")[1] for p in plans)
    assert alone.splitlines()[0] == file.splitlines()[0]
    file, alone = (p.stdout.split("3 ranks:")[1].split("KV cache")[0] for p in plans)
    assert alone == file


def test_plan_of_a_config_alone_is_the_checkpoints(models):
    """`plan --model DIR/config.json` (nothing downloaded) prints what the checkpoint's own
    plan prints: heads, experts, bytes and KV cache per rank; DeepSeek-V3's cache line
    says every rank holds the whole latent."""
    out = {}
    for name, split in (
        ("deepseek_v3", "expert"),
        ("deepseek_v3_g32-q4", "tensor"),
        ("qwen3_moe", "tensor"),
        ("glm4_moe", "expert"),
        ("glm4_moe_g32-q4", "tensor"),
    ):
        folder = models[name]
        plans = [
            run_python(["-m", "llama_tp.plan", "-n", "3", "--model", str(m), "--moe-split", split])
            for m in (folder, folder / "config.json")
        ]
        assert all(p.returncode == 0 for p in plans), plans[1].stderr
        whole, alone = (p.stdout.split(f"{folder.name}:\n")[-1] for p in plans)
        assert alone == whole, (name, split, alone)
        out[name] = alone
    # 3 layers of a 32-value latent and an 8-value RoPE key, float32: 480 bytes per token
    assert (
        "KV cache per 1,000 tokens: rank 0 468.75 KiB, rank 1 468.75 KiB, rank 2 468.75 KiB "
        "(every rank caches the whole latent, 32 + 8 RoPE values" in out["deepseek_v3"]
    )
    assert "(keys and values of its KV heads)" in out["qwen3_moe"]
