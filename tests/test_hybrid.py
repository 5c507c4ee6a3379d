"""Gated DeltaNet hybrids (issue 38): Qwen3.5 (dense, nested in `text_config` beside a
vision config), Qwen3.5-MoE and Qwen3-Next, written by mlx-lm's own classes (float32 and
4-bit), the dense one also in the Hugging Face release layout, and as GGUF files the way
llama.cpp's converter writes them (`hybrid_fixtures.py`).

One process against mlx-lm (logits within 1e-4, 32 greedy tokens, each layer's cache
kind and the state bytes `plan` says); the GGUF files against a float64 computation as
llama.cpp's (`reference64_hybrid.py`) and the folders they came from. One launch per
rank count runs the variants through `mp_hybrid.py`: 2 ranks (the release layout,
Qwen3-Next, --split 3:1, GGUF, a pre-split folder, speculative decoding, perplexity, the
sequence-parallel refusal), 3 ranks (the MLX folders; 4 and 5 key heads as 2/1/1 and
2/2/1), 4 ranks and a tp2 x pp2 mesh
(a stage of linear-attention layers only). The launches take MLX's own quantized
products (LLAMA_TP_KERNELS=mlx): the native kernels round activations to int16 per 32
values and differ from MLX's by up to 7e-3 on these fixtures in one process, which would
hide a sharding error of that size. Then `serve` on 2 ranks (8 concurrent requests as
alone; a chat's second turn prefills only what the prompt cache lacks) and `Chat` (its
second turn prefills only its new tokens).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import launch, run_python
from family_kit import greedy, greedy_mlx_lm
from hybrid_fixtures import gguf_hybrid, hybrids, random_tokens, release

ATOL = 1e-4
Q8_0 = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    out = hybrids(root)
    out["qwen3_5-release"] = release(out["qwen3_5"], root / "qwen3_5-release")
    out["qwen3_5.gguf"] = gguf_hybrid(out["qwen3_5"], root / "qwen3_5.gguf")  # tiled values
    q8 = {"blk.*.attn_qkv.weight": Q8_0, "blk.*.ssm_out.weight": Q8_0,
          "blk.*.ffn_down_exps.weight": Q8_0}  # fmt: skip
    out["qwen3_5_moe-q8.gguf"] = gguf_hybrid(out["qwen3_5_moe"], root / "moe-q8.gguf", q8)
    out["qwen3_next.gguf"] = gguf_hybrid(out["qwen3_next"], root / "qwen3_next.gguf")
    return out


@pytest.fixture(autouse=True)
def mlx_products(monkeypatch):
    """MLX's products (see the module docstring): in the processes a test starts (the
    environment) and in this one (kernels.off: the path is chosen once per process, so
    the variable alone would stay with this worker's later modules, or come too late)."""
    from llama_tp import kernels

    monkeypatch.setenv("LLAMA_TP_KERNELS", "mlx")
    with kernels.off():
        yield


def test_one_process_equals_mlx_lm(models, monkeypatch, capsys):
    """Every folder (the release layout against mlx-lm on the MLX one): logits within 1e-4
    of mlx-lm's qwen3_5 / qwen3_5_moe / qwen3_next and the same 32 greedy tokens; each
    layer's cache the kind mlx-lm's model makes; what the recurrent states hold, the
    bytes `plan` says (the delta-rule state in float32), and `plan` prints them."""
    from mlx_lm.utils import load_model

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.slices import model_shape
    from llama_tp.engine import caches
    from llama_tp.parallel.placement import kv_cache_bytes, place, state_bytes

    x = mx.array([random_tokens(12)])
    for name, path in models.items():
        if name.endswith(".gguf"):
            continue
        ckpt = open_checkpoint(path)
        ours = build_model(ckpt)
        theirs = load_model(models[name.removesuffix("-release")])[0]
        assert type(theirs).__module__.rsplit(".", 1)[1] == ckpt.args.model_type
        diff = mx.abs(ours(x) - theirs(x)).max().item()
        assert diff <= ATOL, (name, diff)
        prompt = x[0].tolist()
        assert greedy(ours, prompt, 32) == greedy_mlx_lm(theirs, prompt, 32), name
        cache = caches.new(ours)
        kinds = [type(c).__bases__[0].__name__ if caches.recurrent([c]) else type(c).__name__
                 for c in cache]  # fmt: skip
        assert kinds == [type(c).__name__ for c in theirs.make_cache()]
        assert kinds == ["ArraysCache"] * 3 + ["KVCache"]
        mx.eval(ours(x, cache=cache))
        state = sum(a.nbytes for a in caches.arrays(cache[:3]))
        kv = sum(c.keys[..., : c.offset, :].nbytes * 2 for c in cache[3:])
        shape = model_shape(ckpt)
        mine = place(shape).ranks[0]
        assert state == state_bytes(shape, mine) and state + kv == kv_cache_bytes(shape, mine, 12)
        assert caches.held(cache) == 12
    # `plan` prints each rank's linear-attention heads and its state beside the KV cache
    from llama_tp.parallel.plan_text import human_bytes
    from llama_tp.plan import main as plan

    ckpt = open_checkpoint(models["qwen3_5_moe"])
    placement = place(model_shape(ckpt), 3)
    monkeypatch.setattr("sys.argv", ["plan", "-n", "3", "--model", str(models["qwen3_5_moe"])])
    assert plan() == 0
    out = capsys.readouterr().out.splitlines()
    states = [state_bytes(model_shape(ckpt), r) for r in placement.ranks]
    assert ("Recurrent state per sequence: " + ", ".join(
        f"rank {i} {human_bytes(b)}" for i, b in enumerate(states))) in next(
        x for x in out if x.startswith("Recurrent"))  # fmt: skip
    rows = [x.split() for x in out if x[:2] in ("0 ", "1 ", "2 ")]
    assert [r[-7] for r in rows] == ["[2]", "[2]", "[1]"]  # 5 key heads: 2/2/1
    notes = open_checkpoint(models["qwen3_5-release"]).notes
    assert notes == [
        "its multi-token prediction layers are not used (skipped)",
        "the vision tower is not loaded (text generation only)",
    ]


def test_gguf_equals_float64_and_the_folders(models):
    """The GGUF files (qwen35 with its value heads tiled, qwen35moe with Q8_0 tensors,
    qwen3next with attn_qkv / attn_gate / ssm_ba): next-token log-probabilities within
    1e-4 nats of llama.cpp's computation in float64 over gguf-py's dequantization; the
    float ones the logits and 32 greedy tokens of the folder they were written from; the
    multi-token prediction layer left out with a note."""
    import reference64
    import reference64_hybrid

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model

    tokens = random_tokens(10, seed=3)
    x = mx.array([tokens])
    for name, folder in (("qwen3_5.gguf", "qwen3_5"), ("qwen3_5_moe-q8.gguf", None),
                         ("qwen3_next.gguf", "qwen3_next")):  # fmt: skip
        ckpt = open_checkpoint(models[name])
        ours = build_model(ckpt)
        got = np.array(ours(x)[0])
        ref = reference64_hybrid.logits(str(models[name]), tokens)
        assert reference64.top5_gap(got, ref) <= 1e-4, name
        assert ckpt.args.n_layers == 4  # of block_count 5: the prediction layer dropped
        if folder is not None:
            theirs = build_model(open_checkpoint(models[folder]))
            assert mx.abs(ours(x) - theirs(x)).max().item() <= ATOL, name
            assert greedy(ours, tokens, 32) == greedy(theirs, tokens, 32), name


def _lines(r) -> list[dict]:
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines and all(x["ok"] for x in lines), f"{r.stdout}\n{r.stderr[-3000:]}"
    assert r.returncode == 0, r.stderr[-3000:]
    return lines


def test_two_ranks(models, tmp_path):
    """On 2 ranks the release layout, Qwen3-Next, the GGUF files, the MoE 4-bit one weighted
    3:1 and a folder pre-split by `convert --shards 2` (the MLX folders of Qwen3.5 and its
    MoE: on 3 ranks): logits, 32 greedy tokens, each rank's caches and
    recurrent state as planned (its key heads' only), bytes read = held = placement; and
    speculative decoding, perplexity and the sequence-parallel refusal."""
    split = tmp_path / "split"
    r = run_python(["-m", "llama_tp.convert", "--model", str(models["qwen3_next-4bit"]),
                    "--out", str(split), "--shards", "2", "--quiet"])  # fmt: skip
    assert r.returncode == 0, r.stderr
    specs = [str(models[k]) for k in ("qwen3_5-release", "qwen3_next", "qwen3_5.gguf",
                                      "qwen3_5_moe-q8.gguf", "qwen3_next.gguf")]  # fmt: skip
    specs += [f"{models['qwen3_5_moe-4bit']}%3:1", f"{split}={models['qwen3_next-4bit']}"]
    args = ["tests/mp_hybrid.py", *specs, "--steps", "16", "--extras"]
    lines = _lines(launch(2, args, timeout=1200))
    assert len(lines) == len(specs) + 1
    weighted = next(x for x in lines if x["split"] == "3:1")
    assert weighted["key_heads"] == [4, 1]  # 5 key heads 3:1 (largest remainders)


def test_three_ranks(models):
    """4 key heads as 2/1/1 and 5 as 2/2/1 (no equal split exists), 4 query / 2 KV heads
    with a KV head replicated, the GGUF file's tiled value heads read per rank."""
    specs = [str(models[k]) for k in ("qwen3_5-4bit", "qwen3_5_moe", "qwen3_next-4bit",
                                      "qwen3_5.gguf")]  # fmt: skip
    lines = _lines(launch(3, ["tests/mp_hybrid.py", *specs, "--steps", "16"], timeout=1200))
    assert [x["key_heads"] for x in lines] == [[2, 1, 1], [2, 2, 1], [2, 2, 1], [2, 1, 1]]


def test_four_ranks_and_a_tp2_x_pp2_mesh(models):
    """4 ranks (5 key heads 2/1/1/1), and 2 stages of 2 tensor ranks, the first stage of
    linear-attention layers only (its caches recurrent states only)."""
    specs = [str(models["qwen3_5_moe-4bit"]), f"{models['qwen3_next']}@2,2",
             f"{models['qwen3_5-4bit']}@2,2"]  # fmt: skip
    lines = _lines(launch(4, ["tests/mp_hybrid.py", *specs, "--steps", "16"], timeout=1200))
    assert lines[0]["key_heads"] == [2, 1, 1, 1]
    assert [x["mesh"] for x in lines[1:]] == [[2, 2], [2, 2]]


def test_chat_second_turn_prefills_only_its_new_tokens(models):
    """A 2-turn chat: the second turn prefills only the tokens the cache lacks (the first
    turn's reply that was not fed, the template's end of turn, the new message), the
    recurrent state carried on; a reply cut by a stop string (not a prefix of the next
    prompt) goes back to the checkpoint at the first prompt's end; greedy replies equal
    a fresh chat's; speculative decoding gives the plain tokens."""
    from llama_tp.conversation.chat import Chat
    from llama_tp.engine.generation import stream_generate
    from llama_tp.loading.loader import load

    model, tok = load(models["qwen3_5_moe"])
    chat = Chat(model, tok, max_tokens=8)
    chat.send("Hello there")
    first = chat.last_stats
    second = chat.send("Tell me more")
    s = chat.last_stats
    assert s.reused_tokens == first.context_tokens >= first.prompt_tokens + 7
    assert s.prefilled_tokens == s.prompt_tokens - first.context_tokens
    # the state carried on is the one a fresh cache computes from the whole prompt
    whole = chat._held[: s.prompt_tokens]
    fresh = stream_generate(model, tok, whole, max_tokens=8, temp=0.0)
    assert "".join(r.text for r in fresh) == second
    # a stop string: the reply kept is shorter than the tokens fed, so the cache is no
    # prefix of the next prompt: back to the checkpoint at the first prompt's end
    reply = Chat(model, tok, max_tokens=8).send("Hello there")
    stop = Chat(model, tok, max_tokens=8, stop=[reply[-2:]])
    stop.send("Hello there")
    held = stop.last_stats
    stop.send("Tell me more")
    assert held.finish_reason == "stop" and held.stop_string == reply[-2:]
    assert stop.last_stats.reused_tokens == held.prompt_tokens
    prompt = ([5, 6, 7, 8] * 6)[:20]
    plain = [
        r.token for r in stream_generate(model, tok, prompt, max_tokens=24, eos_token_ids=set())
    ]
    drafted = stream_generate(model, tok, prompt, max_tokens=24, eos_token_ids=set(),
                              draft="ngram", num_draft_tokens=4)  # fmt: skip
    assert [r.token for r in drafted] == plain


def test_serve_on_two_ranks(models, tmp_path):
    """`serve` on 2 ranks: 5 concurrent requests answered exactly as each alone (rows
    joining and leaving a batch of recurrent states); a chat's second turn takes the first
    turn's state from the prompt cache and prefills only what it lacks."""
    from serve_client import Server, chat

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.chat_template import renderer_for
    from llama_tp.checkpoints.tokenizer import load_tokenizer

    path = models["qwen3_5_moe-4bit"]
    server = Server(2, path, tmp_path, "--max-batch", "8", launcher="llama_tp")
    try:
        server.wait_ready(300)
        c = server.client(timeout=300)
        # 5 rows of different lengths: rows join and leave the batch (8 cost 104 s in CI)
        prompts = ["hello", "The quick brown fox", "abc", "Où est la gare?", "one two three"]
        alone = [chat(c, p, max_tokens=6)[0] for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: chat(c, p, stream=True, max_tokens=6)[0], prompts))
        assert together == alone
        first = [{"role": "user", "content": "Tell me a story"}]
        reply, finish, u1 = chat(c, "", messages=first, max_tokens=10)
        turn = [
            *first,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "More"},
        ]
        _, _, u2 = chat(c, "", messages=turn, max_tokens=4)
    finally:
        server.close()
    # what the prompt cache holds after turn 1: the prompt before its generation prompt,
    # the whole prompt, and the prompt with the reply's tokens fed
    ckpt = open_checkpoint(path)
    renderer = renderer_for(load_tokenizer(ckpt))
    p1, p2 = renderer.encode(first), renderer.encode(turn)
    gen = greedy(build_model(ckpt), p1, 10)
    fed = len(gen) - (finish == "length")
    ends = [len(renderer.encode(first, add_generation_prompt=False)), len(p1), len(p1) + fed]
    seq = p1 + gen
    expected = max(e for e in ends if e < len(p2) and seq[:e] == p2[:e])
    assert u2.prompt_tokens == len(p2)
    assert u2.prompt_tokens_details.cached_tokens == expected >= len(p1) - 3
    assert u1.prompt_tokens_details.cached_tokens == 0


def test_refusals_are_one_line(models, tmp_path):
    """A config whose value heads do not follow its key heads, layer types of another
    kind, a qwen3next GGUF converted to an mlx-lm folder: one line, the numbers."""
    from llama_tp.checkpoints import CheckpointError, open_checkpoint

    src = models["qwen3_next"]
    kinds = ["linear_attention", "mamba", "linear_attention", "full_attention"]
    cases = {
        "heads": (dict(linear_num_value_heads=7),
                  "model config: 7 linear-attention value heads are not a multiple of 5 key heads"),
        "types": (dict(layer_types=kinds),
                  "model config: layer type 'mamba' (supported: linear_attention, full_attention)"),
    }  # fmt: skip
    for name, (changes, message) in cases.items():
        path = tmp_path / name
        shutil.copytree(src, path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(CheckpointError) as e:
            open_checkpoint(path)
        assert str(e.value) == f"{path / 'config.json'}: {message}"
    out = tmp_path / "converted"
    r = run_python(["-m", "llama_tp.convert", "--model", str(models["qwen3_next.gguf"]),
                    "--out", str(out)])  # fmt: skip
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and "Traceback" not in r.stderr
    assert errors[0] == (
        "error: a qwen3next GGUF's linear attention (attn_qkv, attn_gate, ssm_ba) has no "
        "mlx-lm layout to write: run the GGUF file itself, or pre-split it with --shards"
    )
