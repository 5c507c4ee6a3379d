"""Run under llama_tp.launch: Qwen3 and mixture-of-experts models sharded both ways equal
one process.

    python -m llama_tp.launch -n N -- python tests/mp_moe.py MODEL [MODEL ...]
        [--steps 32] [--splits tensor,expert] [--extras]

MODEL may be SPLIT=SRC (a folder pre-split by `convert --shards`, against SRC),
PATH@T,P (loaded as a tp x pp mesh) or PATH%W:W (a weighted split, `--split W:W`), any
of them followed by #SPLIT (that expert split only) and ~N (N greedy tokens, not
`--steps`: one launch checks families of other lengths). A dense model is checked once with
`--dense-once` (its expert split means nothing).

For every model and expert split, every rank loads the model sharded over the world
(or a tp x pp mesh), builds it whole itself (the one-process reference), and checks:

- logits of a prefill then cached single-token steps within 1e-4 (the mesh: the last
  position's, as a stage returns);
- `--steps` (32) greedy tokens identical;
- its KV cache per token: what `plan` says (`placement.kv_cache_bytes`: its KV heads'
  keys and values, or the whole latent of multi-head latent attention);
- what the loader read and held: its placement's bytes (read exactly, from
  safetensors), and, for a float checkpoint's stacked
  experts, its share: E/N whole experts (larger first) split by expert, its balanced
  share of every expert's columns split by tensor (`--mesh`: of its stage's layers).

`--extras` (first model, split by tensor): prompt-lookup speculative decoding and
sequence-parallel prefill give the same tokens and logits, and perplexity equals one
process's. Rank 0 prints one JSON line per check; a failure exits 1 on every rank.
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache

from llama_tp import kernels
from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model
from llama_tp.checkpoints.slices import model_shape
from llama_tp.checkpoints.tokenizer import load_tokenizer
from llama_tp.cluster.distributed import all_gather_object
from llama_tp.engine.generation import generate_step
from llama_tp.engine.sampling import make_sampler, vocab_shard
from llama_tp.kernels.layers import use_native
from llama_tp.loading.loader import load_model
from llama_tp.parallel.placement import kv_cache_bytes

ATOL = 1e-4


def logits_of(model, x: mx.array) -> np.ndarray:
    """(L, vocab): a prefill, then three cached single-token steps, each evaluated alone
    (a pipeline stage returns the last position of each)."""
    cache = make_prompt_cache(model)
    shard = vocab_shard(model)  # the whole vocabulary is the one-shard case
    out = []
    for a, b in [(0, x.shape[1] - 3)] + [(i, i + 1) for i in range(x.shape[1] - 3, x.shape[1])]:
        logits = model(x[:, a:b], cache=cache)[0].astype(mx.float32)
        logits = shard.full_logits(logits)
        mx.eval(logits)
        out.append(np.array(logits))
    return np.concatenate(out, axis=0)


def greedy(model, prompt: list[int], steps: int, tokenizer=None) -> list[int]:
    """`steps` greedy tokens; with `tokenizer`, through prompt-lookup speculative decoding
    (no end of sequence: as many tokens as the plain loop)."""
    if tokenizer is None:
        sampler = make_sampler(0.0, 1.0, 0.0, 0, shard=vocab_shard(model))
        return [int(t) for t, _ in generate_step(model, prompt, sampler, steps)]
    from llama_tp.engine.generation import stream_generate

    out = stream_generate(
        model, tokenizer, prompt, max_tokens=steps, draft="ngram", num_draft_tokens=4,
        eos_token_ids=set(),
    )  # fmt: skip
    return [r.token for r in out]


def cache_bytes_per_token(model, x: mx.array) -> int:
    """What the model's KV cache holds per token after a prefill of `x` (a CacheList's
    caches each: sparse attention's latent and indexer keys)."""
    cache = make_prompt_cache(model)
    mx.eval(model(x, cache=cache))
    layers = [p for c in cache for p in (c.caches if isinstance(c, CacheList) else [c])]
    # a recurrent layer's fixed state (Kimi's KDA, Nemotron-H's Mamba), whatever the
    # length: counted whole
    states = [c for c in layers if isinstance(c, ArraysCache)]
    state = sum(a.nbytes for c in states for a in c.cache if a is not None)
    held = sum(
        c.keys[..., : c.offset, :].nbytes + c.values[..., : c.offset, :].nbytes
        for c in layers
        if not isinstance(c, ArraysCache)
    )
    return held // x.shape[1] + state


def expert_bytes(model) -> int:
    return sum(
        v.nbytes
        for k, v in tree_flatten(model.parameters())
        if ".switch_mlp." in k and k.endswith(".weight")  # gpt-oss's biases: not split alike
    )


def share(total: int, n: int, i: int) -> int:
    """Rank i's count of `total` units balanced over n (larger first)."""
    base, extra = divmod(total, n)
    return base + (i < extra)


def expected_expert_bytes(whole, sharded, split: str, n: int, i: int) -> int | None:
    """Rank i's share of the whole model's float stacked experts (over the layers it holds)."""
    first = getattr(sharded, "first_layer", 0)
    layers = whole.layers[first : first + len(sharded.layers)]
    out = 0
    for ff in (m for layer in layers for m in layer.mixers().values()):
        if "switch_mlp" not in ff:  # the experts: a MoE feed-forward, or Gemma 4's beside it
            continue
        for proj in ("gate_proj", "up_proj", "down_proj", "fc1", "fc2"):  # SwitchGLU, SwitchMLP
            if proj not in ff.switch_mlp:
                continue
            w = ff.switch_mlp[proj]
            if "scales" in w:
                return None  # quantized: columns split in quantization groups
            e, rows, cols = w.weight.shape
            down = proj in ("down_proj", "fc2")
            units = e if split == "expert" else (cols if down else rows)
            out += w.weight.nbytes * share(units, n, i) // units
    return out


def atol(whole: nn.Module, path: str, x: mx.array) -> float:
    """ATOL, or for quantized products on the native kernels, which round activations
    to int16 per 32 values (tests/test_kernels.py), 5e-4 (2 ranks measured up to 2.7e-4
    from one process on the 4- and 8-bit fixtures) or twice the gap between one process
    on them and on MLX's kernels, where a model amplifies that rounding more (Gemma's
    scaled embeddings and sandwich norms: 2.4e-3): a split adds no more than rounding."""
    quantized = any(isinstance(m, nn.QuantizedLinear) for m in whole.modules())
    if not (quantized and kernels.status().native):
        return ATOL
    plain = build_model(open_checkpoint(path))
    gap = float(np.max(np.abs(logits_of(plain, x) - logits_of(whole, x))))
    return max(5e-4, 2 * gap)


_REFERENCES: dict[tuple[str, int], tuple] = {}


def reference(path: str, steps: int) -> tuple:
    """The one-process reference of checkpoint `path`: (whole model, prompt x (1, 10), its
    logits, its `steps` greedy tokens, the tolerance), computed once per process (every
    split and mesh of one checkpoint compares with the same)."""
    if (path, steps) not in _REFERENCES:
        whole = build_model(open_checkpoint(path))
        if kernels.status().native:  # the products the loader gives the sharded model
            use_native(whole)
        x = mx.array(np.random.default_rng(0).integers(0, whole.args.vocab_size, (1, 10)), mx.int32)
        ref = logits_of(whole, x)
        tokens = greedy(whole, x[0].tolist(), steps)
        _REFERENCES[path, steps] = (whole, x, ref, tokens, atol(whole, path, x))
    return _REFERENCES[path, steps]


def check(spec: str, split: str, world, steps: int) -> dict:
    """`spec`: a checkpoint, SPLIT=SRC (a pre-split folder and the checkpoint it was cut
    from, the one-process reference) or PATH@T,P (a tp x pp mesh)."""
    spec, _, weights = spec.partition("%")
    spec, _, shape = spec.partition("@")
    mesh = tuple(int(v) for v in shape.split(",")) if shape else None
    path, _, source = spec.partition("=")
    whole, x, ref, ref_tokens, tol = reference(source or path, steps)
    kw = dict(tp=mesh[0], pp=mesh[1]) if mesh else {}
    sharded, ckpt = load_model(path, world, moe_split=split, split=weights or None, **kw)
    got = logits_of(sharded, x)
    if mesh:  # a stage returns the last position of each call
        ref = ref[[x.shape[1] - 4, -3, -2, -1]]
    tokens = greedy(sharded, x[0].tolist(), steps)
    t, r = (mesh or (world.size(), 1))[0], sharded.mesh.tp_rank if mesh else world.rank()
    stats = ckpt.load_stats
    split = ckpt.placement.moe_split or split  # a pre-split folder keeps its own
    expected = None if weights else expected_expert_bytes(whole, sharded, split, t, r)
    placed = ckpt.placement.at(sharded.mesh.stage, r) if mesh else ckpt.placement.ranks[r]
    mine = {
        "cache": cache_bytes_per_token(sharded, x),
        "planned_cache": kv_cache_bytes(model_shape(ckpt), placed, tokens=1),
        "held": stats["bytes_held"],
        "placement": stats["placement_bytes"],
        "experts": expert_bytes(sharded),
        "expected_experts": expected,
    }
    # Safetensors files are read in slices: exactly the bytes held (GGUF blocks are
    # smaller in the file than converted, but for MXFP4, held as stored, and F32; a
    # pre-split folder is read whole)
    sliced = ckpt.format == "hf" or (
        ckpt.format == "gguf" and all(n.startswith(("F32 ", "MXFP4 ")) for n in ckpt.notes)
    )
    mine["read_is_held"] = stats["bytes_read"] == stats["bytes_held"] if sliced else True
    ranks = all_gather_object(mine, world)
    return {
        "path": path,
        "split": split,
        "n": world.size(),
        "mesh": mesh,
        "weights": weights or None,
        "diff": float(np.max(np.abs(ref - got))),
        "atol": tol,
        "same_tokens": tokens == ref_tokens,
        "held_is_placement": all(m["held"] == m["placement"] for m in ranks),
        "cache_is_planned": all(m["cache"] == m["planned_cache"] for m in ranks),
        "cache_per_token": [m["cache"] for m in ranks],
        "read_is_held": all(m["read_is_held"] for m in ranks),
        "experts_are_shares": all(
            m["expected_experts"] is None or m["experts"] == m["expected_experts"] for m in ranks
        ),
        "experts_per_rank": [m["experts"] for m in ranks],
        "model_type": whole.args.model_type,
    }


def extras(path: str, world) -> dict:
    """Speculative decoding, sequence parallelism and perplexity on the model (by tensor)."""
    from llama_tp.engine.perplexity import perplexity

    whole = build_model(open_checkpoint(path))
    sharded, ckpt = load_model(path, world)
    x = mx.array(np.random.default_rng(1).integers(0, whole.args.vocab_size, (1, 48)), mx.int32)
    prompt = ([5, 6, 7, 8] * 6)[:20]  # repeats: prompt lookup finds drafts
    spec = greedy(sharded, prompt, 32, load_tokenizer(ckpt)) == greedy(whole, prompt, 32)
    seq, _ = load_model(path, world, sequence_parallel=True)
    diff = float(np.max(np.abs(logits_of(seq, x) - logits_of(whole, x))))
    tokens = x[0].tolist()
    ppl = perplexity(sharded, tokens, 32, 16).perplexity
    ppl_whole = perplexity(whole, tokens, 32, 16).perplexity
    return {
        "path": path,
        "speculative_same_tokens": spec,
        "sequence_parallel_diff": diff,
        "perplexity": [ppl, ppl_whole],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="+")
    p.add_argument("--steps", type=int, default=32, help="greedy tokens compared")
    p.add_argument("--splits", default="tensor,expert")
    p.add_argument("--extras", action="store_true")
    p.add_argument("--dense-once", action="store_true", help="dense models: one split only")
    args = p.parse_args()
    world = mx.distributed.init()
    failed = False
    for spec in args.models:
        spec, _, steps = spec.partition("~")
        path, _, only = spec.partition("#")
        source = path.partition("=")[2] or path.split("@")[0].split("%")[0]
        once = args.dense_once and not open_checkpoint(source).args.n_experts
        splits = [only] if only else args.splits.split(",")[: 1 if once else None]
        for split in splits:
            line = check(path, split, world, int(steps or args.steps))
            ok = line["diff"] <= line["atol"] and line["same_tokens"] and line["cache_is_planned"]
            ok = ok and line["held_is_placement"] and line["experts_are_shares"]
            ok = ok and line["read_is_held"]
            failed |= not ok
            if world.rank() == 0:
                print(json.dumps({"ok": ok, **line}), flush=True)
    if args.extras:
        line = extras(args.models[0], world)
        ppl, ppl_whole = line["perplexity"]
        ok = line["speculative_same_tokens"] and line["sequence_parallel_diff"] <= ATOL
        ok = ok and abs(ppl - ppl_whole) <= 1e-4 * ppl_whole
        failed |= not ok
        if world.rank() == 0:
            print(json.dumps({"ok": ok, "extras": True, **line}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
