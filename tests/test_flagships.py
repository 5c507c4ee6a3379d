"""2026's flagship families on several ranks (issue 43): one launch per rank count checks
every family's fixtures (`flagship_fixtures.py`: mlx-lm's own classes, float32 and 4-bit)
against one process with `mp_moe.py`: logits, greedy tokens, the KV cache per token
(`plan`'s), bytes read = held = placement, each rank's share of the experts; between
them the launches cover both expert splits, `--split 3:1` (2 ranks) and 2 stages of 2
tensor ranks (4 ranks), each check once.
The same launches check gpt-oss's fixtures (float32, MXFP4 experts, the release layout,
its GGUF file; `gpt_oss_fixtures.py`) under both splits, with their own count of greedy
tokens (`mp_moe.py`'s PATH~N). `serve` on 2 ranks answers concurrent requests as it
answers each alone. These launches
are the family test kit's "every split and mesh" (tests/family_kit.py: its folders,
written once per run for every file that uses them); the kit's one-process checks
against mlx-lm are tests/test_families.py's, what is a family's alone its own file's
(`test_gemma.py`, `test_sparse_attention.py`: each query over the indexer's top 4 keys
of the 10-token prompt, `test_minimax.py`, `test_kimi.py`, `test_kimi_k3.py`,
`test_llama4.py`: chunks of 4, so the 10-token prompt and 8 steps span five,
`test_step3p5.py`, `test_nemotron_h.py`); the next family adds its fixture to
`flagship_fixtures.CONFIGS`, its row to `family_kit.FAMILIES` and its specs to these
launches.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import launch
from family_kit import folders
from flagship_release import packed_k3


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return folders(tmp_path_factory)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> list[str]:
    """gpt-oss's fixtures (gpt_oss_fixtures.py: float32, MXFP4 experts, the release layout)
    and its GGUF file, checked in these launches beside the flagships (test_gpt_oss.py
    holds its one-process checks)."""
    from gpt_oss_fixtures import gguf_release, gpt_oss_models

    root = tmp_path_factory.mktemp("gpt_oss")
    out = gpt_oss_models(root)
    return [*map(str, out.values()), str(gguf_release(out["gpt_oss-hf"], root / "gpt_oss.gguf"))]


def _split_off_gpt_oss(lines: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the flagships' lines, gpt-oss's)."""
    return [x for x in lines if x["model_type"] != "gpt_oss"], [
        x for x in lines if x["model_type"] == "gpt_oss"
    ]


GEMMA = ("gemma4_text", "gemma3_text")
SPARSE = ("deepseek_v32", "glm_moe_dsa")
MINIMAX = ("minimax",)
KIMI = ("kimi_linear", "kimi_k3")
LLAMA4 = ("llama4", "llama4_text")
STEP = ("step3p5",)
NEMOTRON = ("nemotron_h",)


def _lines(r) -> list[dict]:
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines and all(x["ok"] for x in lines), f"{r.stdout}\n{r.stderr[-3000:]}"
    assert r.returncode == 0, r.stderr[-3000:]
    return lines


def _families(lines: list[dict]) -> set[str]:
    return {x["model_type"] for x in lines}


def _check(n: int, specs: list[str]) -> list[dict]:
    """What `mp_moe.py` printed for `specs` on n ranks (8 greedy tokens after the 10-token
    prompt: past Gemma's window of 4 and the indexer's top 4 keys already)."""
    args = ["tests/mp_moe.py", *specs, "--steps", "8", "--dense-once"]
    return _lines(launch(n, args, timeout=900))


def test_two_ranks_and_a_weighted_split(models, gpt_oss):
    """2 ranks: Gemma 4 by tensor and by expert (3/2 KV groups, 3/2 experts), its 4-bit
    copy, Gemma 3, and Gemma 4 with `--split 3:1` (4/1 of its 5 KV groups, the global KV
    heads those need); DeepSeek-V3.2 both ways (5/5 heads, 3/2 experts), its 4-bit copy,
    GLM-5, and DeepSeek-V3.2 with `--split 3:1` (8/2 heads; the latent and the indexer's
    keys cached whole on both ranks); MiniMax-M2 both ways (1/1 KV heads: each rank's
    q/k norms' sums of squares all-reduced), its 4-bit copy, and `--split 3:1` (2/1 KV
    heads: the shared one counted once); Kimi-Linear with `--split 3:1` (4/1 KDA heads,
    8/2 latent heads; its 4-bit copy on 2 ranks is `serve`'s, by expert the mesh's);
    Llama 4 by expert (3/2 KV heads, each rank's chunked caches), its 4-bit copy by
    tensor, and `--split 3:1` (4/1 KV heads); Step-3.5 by expert (global 3/2 KV heads,
    sliding 4/4 query heads over 1/1 KV heads), its 4-bit copy by tensor, and `--split
    3:1` (sliding 6/2 query heads over 2/1 KV); Nemotron-H by expert (Mamba groups 3/2,
    their heads 6/4), its 4-bit copy by tensor, and `--split 3:1` (Mamba groups 4/1);
    Kimi K3 with `--split 3:1` by tensor (4/1 fused KDA heads, 8/2 latent heads, the
    latent experts' partial sums reduced before their norm)."""
    g4, q4, g3 = (str(models[k]) for k in ("gemma4", "gemma4-q4", "gemma3"))
    ds, dq, glm = (str(models[k]) for k in ("deepseek_v32", "deepseek_v32-q4", "glm5"))
    mm, mq = str(models["minimax"]), str(models["minimax-q4"])
    l4, l4q = str(models["llama4"]), str(models["llama4-q4"])
    specs = [g4, f"{q4}#tensor", g3, f"{g4}%3:1#tensor"]
    specs += [ds, f"{dq}#tensor", f"{glm}#expert", f"{ds}%3:1#tensor"]
    km = str(models["kimi_linear"])
    specs += [mm, f"{mq}#expert", f"{mm}%3:1#tensor", f"{km}%3:1#tensor"]
    st, sq = str(models["step3p5"]), str(models["step3p5-q4"])
    specs += [f"{l4}#expert", f"{l4q}#tensor", f"{l4}%3:1#tensor"]
    specs += [f"{st}#expert", f"{sq}#tensor", f"{st}%3:1#tensor"]
    nh, nq = str(models["nemotron_h"]), str(models["nemotron_h-q4"])
    specs += [f"{nh}#expert", f"{nq}#tensor", f"{nh}%3:1#tensor"]
    oss = [f"{x}~32" for x in gpt_oss]  # gpt-oss: 32 greedy tokens, both splits
    lines = _check(2, [*specs, f"{models['kimi_k3']}%3:1#tensor", *oss])
    lines, oss = _split_off_gpt_oss(lines)
    families = {*GEMMA, *SPARSE, *MINIMAX, *KIMI, "llama4", *STEP, *NEMOTRON}
    assert _families(lines) == families and len(lines) == 25
    # gpt-oss: its three folders and the GGUF file by tensor and by expert (3/2 KV heads,
    # 3/2 experts, 96/64 expert columns: 3/2 MXFP4 blocks); the release's interleaved gate
    # and up rows read once for both, the GGUF's MXFP4 blocks held as stored
    assert len(oss) == 8
    by = {(Path(x["path"]).name, x["split"]): x for x in oss}
    for name in ("gpt_oss-mxfp4", "gpt_oss.gguf"):
        a, b = by[(name, "tensor")]["experts_per_rank"]
        assert a * 2 == b * 3, name  # 3 and 2 blocks of 32 columns of every expert
    weighted = {x["model_type"]: x["cache_per_token"] for x in lines if x["weights"]}
    a, b = weighted["gemma4_text"]
    assert a > 2 * b
    assert weighted["deepseek_v32"][0] == weighted["deepseek_v32"][1]
    assert weighted["minimax"] == [1024, 512]
    # Kimi-Linear: the latent (64 + 16 values) whole, KDA states of 4/1 heads (5248 bytes each)
    assert weighted["kimi_linear"] == [320 + 4 * 5248, 320 + 5248]
    assert weighted["llama4"] == [2048, 512]
    assert weighted["step3p5"] == [2048, 768]
    # Nemotron-H: the attention's 4/1 KV heads (256 bytes a token each), the Mamba layer's
    # conv and scan states of 4/1 groups (2 heads of 32, 16 state values: 5248 bytes each)
    assert weighted["nemotron_h"] == [1024 + 4 * 5248, 256 + 5248]
    # Kimi K3: the latent whole, the fused KDA states of 4/1 heads in each of its 2 layers
    assert weighted["kimi_k3"] == [320 + 8 * 5248, 320 + 2 * 5248]


def test_three_ranks(models, gpt_oss, tmp_path):
    """10 query heads in 5 KV groups as 4/4/2, Gemma 4's 2 global KV heads as 1/2/1 (the
    middle rank's query heads straddle both; float32 by tensor from its `gemma4` GGUF:
    llama.cpp's layout, the experts' fused gate and up rows read in slices); the 4-bit
    copy's 5 experts as 2/2/1;
    DeepSeek-V3.2's 10 latent heads as 4/3/3, its 4-bit copy's 5 experts as 2/2/1,
    GLM-5's 7 as 3/2/2 (from its float32 GGUF: llama.cpp's `glm-dsa` layout, the latent
    and indexer read whole, the heads and experts in slices); MiniMax-M2's 10 query heads
    over 2 KV heads as 4/3/3 (the middle rank holds both KV heads, each counted in the k
    norm's sum by its first rank only),
    float32 by tensor from its GGUF (llama.cpp's `minimax-m2` layout, read in slices) and
    4-bit by expert; Kimi-Linear's 5 KDA heads as 2/2/1 (each
    rank's conv and delta-rule states for its heads only), from its float32 GGUF
    (llama.cpp's layout, read in slices; the folder it was written from is one process's);
    Llama 4's 5 KV heads as 2/2/1 (float32 by tensor from its `llama4` GGUF: llama.cpp's
    layout, read in slices; 4-bit's 5 experts as 2/2/1) and llama4_text; Step-3.5's
    sliding layers' 8 query heads as 3/3/2 over 2 KV heads (the middle rank holds both;
    float32 by tensor from its `step35` GGUF, read in slices);
    Nemotron-H's 5 Mamba groups as 2/2/1 (float32 by tensor, from its `nemotron_h_moe`
    GGUF: llama.cpp's layout, read in slices), and
    its one-group copy's 5 Mamba heads as 2/2/1 (the group's B and C on every rank, its
    gated norm's sum of squares all-reduced); Kimi K3 by expert (5 KDA heads as 2/2/1),
    from its release's layout (q, k, v projections and convs apart, read in slices as the
    fused ones) with its routed experts packed as the release ships them (per-expert
    `weight_packed` / `weight_scale`, `flagship_fixtures.packed_k3`: held as MLX mxfp4,
    each rank reading its 2/2/1 experts' bytes)."""
    q4, g3 = (str(models[k]) for k in ("gemma4-q4", "gemma3"))
    ds, dq, glm = (str(models[k]) for k in ("deepseek_v32", "deepseek_v32-q4", "glm5-gguf"))
    mq = str(models["minimax-q4"])
    l4q, l4t = (str(models[k]) for k in ("llama4-q4", "llama4_text"))
    g4g = str(models["gemma4-gguf"])
    specs = [f"{g4g}#tensor", f"{q4}#expert", g3, f"{ds}#tensor", f"{dq}#expert", f"{glm}#expert"]
    kg, mg = str(models["kimi_linear-gguf"]), str(models["minimax-gguf"])
    specs += [f"{mg}#tensor", f"{mq}#expert", f"{kg}#tensor"]
    st, sq = str(models["step3p5-gguf"]), str(models["step3p5-q4"])
    specs += [f"{models['llama4-gguf']}#tensor", f"{l4q}#expert", l4t]
    specs += [f"{st}#tensor", f"{sq}#expert"]
    nh, g1 = str(models["nemotron_h-gguf"]), str(models["nemotron_g1"])
    k3 = packed_k3(models["kimi_k3-release"], tmp_path / "kimi_k3-packed")
    oss = [f"{x}~16" for x in gpt_oss]  # gpt-oss: 16 greedy tokens, both splits
    lines = _check(3, [*specs, f"{nh}#tensor", g1, f"{k3}#expert", *oss])
    lines, oss = _split_off_gpt_oss(lines)
    families = {*GEMMA, *SPARSE, *MINIMAX, *KIMI, *LLAMA4, *STEP, *NEMOTRON}
    assert _families(lines) == families and len(lines) == 17
    # gpt-oss: 10 query / 5 KV heads as 4/4/2 and 2/2/1 (as gpt-oss-120b's 64 / 8 over 3
    # are 24/24/16 and 3/3/2), 5 experts as 2/2/1, 160 columns as 64/64/32 (the GGUF's too)
    assert len(oss) == 8 and all(x["cache_per_token"] == [1024, 1024, 512] for x in oss)
    assert [x["cache_per_token"] for x in lines if x["model_type"] == "step3p5"] == [
        [1024, 1536, 768]
    ] * 2
    assert [x["cache_per_token"] for x in lines if x["model_type"] == "minimax"] == [
        [512, 1024, 512]
    ] * 2
    kimi = [x["cache_per_token"] for x in lines if x["model_type"] == "kimi_linear"]
    assert kimi == [[320 + 2 * 5248, 320 + 2 * 5248, 320 + 5248]]  # 5 KDA heads as 2/2/1
    # Nemotron-H: KV heads 2/2/1 (256 bytes a token each) and Mamba groups 2/2/1 (5248
    # bytes of state each); the one-group copy's heads 2/2/1 (2432 bytes each) beside the
    # group's conv state (384 bytes) on every rank
    nemotron = [x["cache_per_token"] for x in lines if x["model_type"] == "nemotron_h"]
    assert nemotron == [
        [512 + 10496, 512 + 10496, 256 + 5248],
        [512 + 5248, 512 + 5248, 256 + 2816],
    ]
    k3 = [x["cache_per_token"] for x in lines if x["model_type"] == "kimi_k3"]
    assert k3 == [[320 + 4 * 5248, 320 + 4 * 5248, 320 + 2 * 5248]]  # 2/2/1 heads, 2 layers


def test_four_ranks_and_a_tp2_x_pp2_mesh(models, gpt_oss):
    """4 ranks (the 4-bit Gemma 4's KV groups 2/1/1/1), and both families as 2 stages of
    2 tensor ranks (Gemma 4: its KV-shared layers on their sources' stage, the per-layer
    inputs handed on beside h; Gemma 3: none of those); DeepSeek-V3.2's 4-bit copy on 4
    ranks (3/3/2/2 heads) and GLM-5 as 2 stages of 2 (each stage's layers' latent and
    indexer caches); MiniMax-M2's 4-bit copy on 4 ranks (KV heads 1/2/1/1) and as 2
    stages of 2 (each stage's tensor group reducing its q/k norms' sums); Kimi-Linear's
    4-bit copy on 4 ranks (KDA heads 2/1/1/1) and as 2 stages of 2 (the KDA layer's states
    on the first stage, the latent on the second); Llama 4's 4-bit copy on 4 ranks (KV
    heads 2/1/1/1) and as 2 stages of 2 (each stage's chunked caches and masks);
    Step-3.5's 4-bit copy on 4 ranks and as 2 stages of 2; Nemotron-H's 4-bit copy on 4
    ranks (Mamba groups 2/1/1/1) and as 2 stages of 2 (the Mamba layer's state on the
    first stage's ranks, the attention's cache on the second's); Kimi K3's 4-bit copy on 4
    ranks (KDA heads 2/1/1/1) and as 2 stages of 2 from its float32 GGUF (llama.cpp's
    `kimi-k3` layout, read in slices: its attention residuals' first block state handed on
    beside h, the fused output query on the last stage)."""
    g4, q4, g3 = (str(models[k]) for k in ("gemma4", "gemma4-q4", "gemma3"))
    dq, glm = (str(models[k]) for k in ("deepseek_v32-q4", "glm5"))
    mm, mq = str(models["minimax"]), str(models["minimax-q4"])
    l4, l4q = str(models["llama4"]), str(models["llama4-q4"])
    specs = [f"{q4}#tensor", f"{g4}@2,2#tensor", f"{g3}@2,2", f"{dq}#tensor", f"{glm}@2,2#tensor"]
    km, kq = str(models["kimi_linear"]), str(models["kimi_linear-q4"])
    specs += [f"{mq}#tensor", f"{mm}@2,2#expert", f"{kq}#tensor", f"{km}@2,2#expert"]
    st, sq = str(models["step3p5"]), str(models["step3p5-q4"])
    specs += [f"{l4q}#tensor", f"{l4}@2,2#expert"]
    specs += [f"{sq}#tensor", f"{st}@2,2#expert"]
    nh, nq = str(models["nemotron_h"]), str(models["nemotron_h-q4"])
    k3, k3q = str(models["kimi_k3-gguf"]), str(models["kimi_k3-q4"])
    mxfp4, release = (x for x in gpt_oss if x.endswith(("gpt_oss-mxfp4", "gpt_oss-hf")))
    oss = [f"{mxfp4}~16", f"{release}@2,2~16"]  # both splits each
    lines = _check(
        4,
        [*specs, f"{nq}#tensor", f"{nh}@2,2#expert", f"{k3q}#tensor", f"{k3}@2,2#expert", *oss],
    )
    lines, oss = _split_off_gpt_oss(lines)
    # gpt-oss: 4 ranks (2/1/1/1 KV heads, 2/1/1/1 experts or MXFP4 blocks) both splits,
    # and the release layout as 2 stages of 2 (each stage a sliding and a full layer)
    assert len(oss) == 4 and sum(x["mesh"] == [2, 2] for x in oss) == 2
    meshes = [None, [2, 2], [2, 2], None, [2, 2], None, [2, 2], None, [2, 2]]
    assert [x["mesh"] for x in lines] == meshes + [None, [2, 2]] * 4
    assert _families(lines) == {*GEMMA, *SPARSE, *MINIMAX, *KIMI, "llama4", *STEP, *NEMOTRON}
    assert lines[-3]["cache_per_token"] == [15744, 10496, 768, 512]  # Mamba | attention
    # Kimi-Linear's stages: the KDA layer's state (3/2 heads) on the first, the latent on
    # the second; on 4 tensor ranks its 5 KDA heads as 2/1/1/1
    kimi = [x["cache_per_token"] for x in lines if x["model_type"] == "kimi_linear"]
    assert kimi == [[320 + 2 * 5248] + [320 + 5248] * 3, [3 * 5248, 2 * 5248, 320, 320]]
    # Kimi K3 on 4 ranks (KDA heads 2/1/1/1 in both KDA layers), and as 2 stages of 2 (the
    # first KDA and the latent layer on the first stage, the second KDA layer on the
    # second, which receives the attention residuals' first block state beside h)
    k3 = [x["cache_per_token"] for x in lines if x["model_type"] == "kimi_k3"]
    mesh = [320 + 3 * 5248, 320 + 2 * 5248, 3 * 5248, 2 * 5248]
    assert k3 == [[320 + 4 * 5248] + [320 + 2 * 5248] * 3, mesh]


SERVED = ["gemma4-q4", "deepseek_v32-q4", "minimax-q4", "kimi_linear-q4", "step3p5-q4"]
SERVED += ["nemotron_h-q4", "kimi_k3-q4"]


@pytest.mark.ranks
@pytest.mark.parametrize("name", SERVED)
def test_serve_concurrent_requests_on_two_ranks(models, tmp_path, name):
    """A family on 2 ranks answers concurrent requests exactly as it answers each alone
    (batches merge each layer's cache kind; Gemma 4's KV-shared layers have none;
    DeepSeek-V3.2's CacheList of the latent and the indexer's keys, each query of a
    left-padded batch over its own top-k keys; MiniMax-M2's q/k norms reduced over a
    batch's rows; Kimi-Linear's KDA states, a left-padded row's short convs fed no padding;
    Step-3.5's sliding layers' windows and their own heads in a batch; Nemotron-H's Mamba
    states merged, left padding kept out of its conv and scan; Kimi K3's fused KDA states
    and attention residuals over a batch's rows). Llama 4's (its
    chunked caches do not merge: one sequence at a time) is `test_generic_drivers.py`'s
    2-rank server."""
    from serve_client import Server, chat

    server = Server(2, models[name], tmp_path, "--max-batch", "8")
    try:
        server.wait_ready()
        c = server.client()
        prompts = ["hello", "The quick brown fox", "Tensor parallel", "abc xyz 0123"]
        # 6 tokens: past the prompts' prefill, each row decoding beside the others
        alone = [chat(c, p, max_tokens=6)[0] for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: chat(c, p, stream=True, max_tokens=6)[0], prompts))
        assert together == alone
    finally:
        server.close()
