"""Every driver on models that run on mlx-lm's classes (generic/): generate, chat (cache
reuse where the caches rewind, prefill again where they cannot), serve (batching where
every cache merges, one sequence at a time otherwise, said in the log and /v1/status),
perplexity, plan, doctor's path line, convert --shards by stage, bench beside mlx-lm.

Tiny folders of four architectures, each written by mlx-lm's own class
(tests/generic_models.py): Gemma 2 and Phi-3 and Nemotron-H on mlx-lm's classes, and
Llama 4 (native since issue 43; its chunked cache cannot merge into a batch). The
2-rank drivers run in one launch (tests/mp_generic_drivers.py) and one 2-rank server.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ROOT, launch, run_python
from generic_models import write_model
from serve_client import KEY, Server, chat, http

NAMES = ("gemma2", "nemotron_h", "llama4", "phi3")
PROMPTS = ["hello", "Tensor parallel", "abc abc", "The capital"]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from fixtures import train_sentencepiece

    base = tmp_path_factory.mktemp("generic-drivers")
    train_sentencepiece(base / "tokenizer", 389)
    return {n: write_model(n, base / n, base / "tokenizer") for n in NAMES}


def one_process(path: Path, chatted: Path) -> tuple[list[int], float, list]:
    """The greedy tokens and perplexity of `path`, the Chat turns of `chatted`, on one process
    (as the launch's)."""
    import mp_generic_drivers as d

    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.cluster.distributed import world
    from llama_tp.engine.perplexity import perplexity
    from llama_tp.loading.loader import load_model

    toks, _ = d.tokens(path, world())
    model, ckpt = load_model(path)
    ppl = perplexity(model, d.TEXT, context_length=32, stride=16).perplexity
    assert load_tokenizer(ckpt) is not None
    return toks, ppl, d.chat_turns(chatted, world())


def test_two_ranks_run_every_driver_as_one_process(folders, tmp_path):
    split = tmp_path / "split"
    r = run_python(["-m", "llama_tp.convert", "--model", str(folders["gemma2"]),
                    "--shards", "2", "--out", str(split), "--quiet"])  # fmt: skip
    assert r.returncode == 0, r.stderr
    manifest = json.loads((split / "stages.json").read_text())
    assert manifest["pp"] == 2 and manifest["pp_split"] == "3,3"
    args = [str(ROOT / "tests" / "mp_generic_drivers.py"), str(folders["gemma2"]), str(split)]
    p = launch(2, [*args, str(folders["phi3"])], timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("{")))
    toks, ppl, turns = one_process(folders["gemma2"], folders["phi3"])
    assert res["pp"] == toks and res["split"] == toks
    # each rank read its own folder, which holds about half of the layers
    size = (folders["gemma2"] / "model.safetensors").stat().st_size
    assert all(0.3 * size < n < 0.7 * size for n in res["split_read"]), res["split_read"]
    assert res["perplexity"] == pytest.approx(ppl, rel=1e-4)
    assert res["chat"] == turns and turns[1][1] > 0  # Phi-3's second turn reused the cache
    refused = res["refused"]  # every rank raised the same one line
    assert len(refused) == 2 and refused[0] == refused[1] and "\n" not in refused[0], refused
    assert refused[0].startswith("phi3 (mlx_lm.models.phi3): no tensor split"), refused
    assert refused[0].endswith("run --pp 2 instead")


def test_chat_reuses_caches_that_cannot_rewind_only_when_nothing_is_rewound(folders):
    """Nemotron-H's recurrent states cannot step back: a turn reuses its cache when the
    cache holds exactly a prefix of the new conversation; when some of what it holds would
    have to be taken back, at most the state checkpointed at the user's turn end is."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.conversation.chat import Chat
    from llama_tp.loading.loader import load_model

    model, ckpt = load_model(folders["nemotron_h"])
    chat = Chat(model, load_tokenizer(ckpt), max_tokens=8)
    "".join(chat.stream("hello there"))
    assert not can_trim_prompt_cache(chat._cache)
    held, cache = list(chat._held), chat._cache
    assert chat._reuse(held + [5, 6]) == len(held) and chat._cache is cache  # a prefix: kept
    # Not a prefix: the cache is not kept; at most a checkpoint of the state taken at the
    # end of the user's turn (before the reply's tokens) is resumed
    reused = chat._reuse(held[:-3] + [7, 8])
    assert reused <= len(held) - 3, (reused, len(held))


def test_plan_and_verbose_say_which_path_runs(folders):
    r = run_python(["-m", "llama_tp.plan", "--model", str(folders["gemma2"]), "-n", "2",
                    "--pp", "2"])  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == (
        "gemma2: mlx-lm classes: model_type 'gemma2' has no native implementation: "
        "mlx_lm.models.gemma2 (mlx-lm " + lines[0].split("(mlx-lm ")[1]
    )
    assert lines[1] == "2 pipeline stages by llama_tp's stage wrapper"
    assert lines[2].startswith("rank 0: stage 0: layers 0-2 + embedding: ")
    # Gemma 2 ties its head to the embedding: the last stage holds the embedding as its head
    assert lines[3].startswith("rank 1: stage 1: layers 3-5 + embedding: ")
    r = run_python(["-m", "llama_tp.generate", "--model", str(folders["gemma2"]),
                    "--prompt", "hi", "-m", "4", "--verbose"])  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Model: mlx-lm classes: model_type 'gemma2' has no native implementation" in (r.stderr)


def test_serve_batches_where_caches_merge_and_runs_alone_where_not(folders, tmp_path):
    """2 pipeline ranks of Phi-3 answer concurrent requests as they answer each alone;
    Llama 4 (native) on 2 tensor ranks: its chunked cache cannot merge, one sequence at a
    time, said in the log and /v1/status, and its answers are still those alone. Gemma
    2's attention cannot take a batch's mask (it fails in mlx-lm's own batches): one
    sequence at a time too."""
    from llama_tp.engine.batch import BatchEngine
    from llama_tp.loading.loader import load
    from llama_tp.server.runner import batching

    model, tok = load(folders["gemma2"])
    engine = BatchEngine(model, tok)
    why = "one sequence at a time: mlx-lm's gemma2 attention cannot take a batch's mask"
    assert batching(model, None, engine) == why and engine.prompt_cache is None
    two = Server(2, folders["phi3"], tmp_path, "--pp", "2", "--max-batch", "4",
                 launcher="llama_tp")  # fmt: skip
    alone = Server(2, folders["llama4"], tmp_path, "--max-batch", "4")
    try:
        for s in (two, alone):
            s.wait_ready(300)
        ref = {p: chat(two.client(), p, max_tokens=8)[:2] for p in PROMPTS}
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = {p: pool.submit(chat, two.client(), p, max_tokens=8) for p in PROMPTS}
            assert {p: f.result()[:2] for p, f in futures.items()} == ref
        status = json.loads(http(f"{two.base}/v1/status", headers=AUTH)[1])
        assert status["batching"] == "continuous" and status["mesh"]["pp"] == 2, status
        solo = {p: chat(alone.client(), p, max_tokens=8)[:2] for p in PROMPTS}
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = {p: pool.submit(chat, alone.client(), p, max_tokens=8) for p in PROMPTS}
            assert {p: f.result()[:2] for p, f in futures.items()} == solo
        status = json.loads(http(f"{alone.base}/v1/status", headers=AUTH)[1])
        why = "one sequence at a time: its ChunkedCache cannot merge into a batch"
        assert status["batching"] == why and status["max_batch"] == 1, status
        assert f"serve: {why}" in alone.stderr()
    finally:
        for s in (two, alone):
            s.close()


def test_bench_runs_mlx_lm_beside_it(folders):
    r = run_python(["-m", "llama_tp.bench", "--model", str(folders["gemma2"]), "-p", "16",
                    "-g", "4", "-n", "1", "--collective-steps", "0", "--compare", "mlx-lm",
                    "--json", "--quiet"])  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.splitlines()[-1])
    assert res["mlx_lm"]["supported"] and res["same_tokens_as_mlx_lm"] == 4, res


def test_qwen3_moe_config_with_an_unused_key_loads(tmp_path):
    """A qwen3_moe config that carries `shared_expert_intermediate_size` (Qwen3-MoE has no
    shared expert) loads natively, as mlx-lm loads it: the key is ignored."""
    from generic_models import mlx_lm_greedy

    from llama_tp.engine.generation import generate_step
    from llama_tp.engine.sampling import make_sampler
    from llama_tp.loading.loader import load_model

    path = write_model("qwen3_moe", tmp_path / "qwen3_moe")
    assert json.loads((path / "config.json").read_text())["shared_expert_intermediate_size"]
    model, ckpt = load_model(path)
    assert ckpt.route is None  # native
    from generic_models import PROMPT

    ours = [t for t, _ in generate_step(model, PROMPT, make_sampler(0.0), 8)]
    assert ours == mlx_lm_greedy(path)
