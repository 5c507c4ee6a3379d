"""The timed runs behind `python -m llama_tp.bench`: trials, warm-up, memory, collectives."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..cluster.distributed import (
    all_gather_object,
    barrier,
    broadcast_object,
)
from ..cluster.progress import progress


def timed(
    steps: Iterator[tuple[Any, Any]], n_prompt: int, stream: Any = None
) -> tuple[dict[str, float], list[int]]:
    """Consume a generate_step iterator: time to first token, prompt and generation tokens/s.

    Generation tokens/s counts the tokens after the first over the time after it.
    `stream`: the one the loop evaluates on, waited for at the end.
    """
    tic = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    tokens, first = [], tic
    for token, _ in steps:
        tokens.append(int(token))
        if len(tokens) == 1:
            first = time.perf_counter()
    end = time.perf_counter()
    # mlx-lm's loop leaves a step in flight, with its all-reduces: finish it before
    # anything else (another stream's collective would overtake it on one rank only).
    mx.synchronize(stream) if stream is not None else mx.synchronize()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    ttft = first - tic
    stats = {
        "ttft_s": ttft,
        "prompt_tps": n_prompt / ttft,
        "generation_tps": (len(tokens) - 1) / (end - first) if len(tokens) > 1 else 0.0,
        "total_s": end - tic,
        "cpu_per_wall": cpu / (end - tic),  # > 1: more than one core busy (threads, spinning)
    }
    return stats, tokens


def run_trials(
    trial: Callable[[], tuple[dict, list[int]]], n: int, desc: str = "llama_tp"
) -> dict[str, Any]:
    """One warm-up trial, then `n` timed ones: their means, every trial, this rank's peak memory.

    Shows progress (warm-up, then trials) on rank 0's terminal, labelled `desc`."""
    trials, tokens = [], []
    with progress(desc=f"{desc}: warm-up", total=n + 1, unit="trial") as bar:
        trial()
        bar.update()
        bar.set_description_str(f"{desc}: trials")
        mx.reset_peak_memory()
        for _ in range(n):
            stats, tokens = trial()
            trials.append(stats)
            bar.update()
    keys = ("prompt_tps", "generation_tps", "ttft_s", "cpu_per_wall")
    out: dict[str, Any] = {k: sum(t[k] for t in trials) / n for k in keys}
    out.update(trials=trials, tokens=tokens, peak_memory_gb=mx.get_peak_memory() / 1e9)
    return out


def bench_llama_tp(
    args: Any, path: Path, group: mx.distributed.Group
) -> tuple[dict[str, Any], list[int]]:
    """llama_tp's trials, collective count and decode share; also the prompt it used."""
    from ..cluster.collectives import decode_share
    from ..cluster.memory import max_rss
    from ..console.cli import UsageError
    from ..engine.generation import decode_step, generate_step
    from ..engine.sampling import make_sampler, vocab_shard
    from ..loading.loader import LoadOptions, load_model
    from ..models.attention import lazy_query_blocks
    from ..parallel.mesh import MeshError
    from ..parallel.shares import SplitError
    from .layer_collectives import count_collectives, count_prefill_collectives

    mx.reset_peak_memory()
    tic = time.perf_counter()
    options = LoadOptions.from_args(args)
    try:
        # (bench runs one copy of the model: a --dp of its own is not a flag of it)
        model, ckpt = load_model(path, group, options=replace(options, dp=None))
    except (MeshError, SplitError) as e:  # the same on every rank
        raise UsageError(str(e)) from None
    mesh = getattr(model, "mesh", None)  # a tp x pp mesh: this rank's pipeline stage
    load_s = time.perf_counter() - tic
    load_peak = mx.get_peak_memory() / 1e9
    weights = mx.get_active_memory() / 1e9  # what stays: the weights (and little else)
    prompt = bench_prompt(args, path, model, group)
    sampler = make_sampler(0.0, 1.0, 0.0, 0, shard=vocab_shard(model))
    drafter, spec = bench_drafter(args, path, model, group, _weights(ckpt)), []
    tokenizer = None if drafter is None else bench_tokenizer(path, group)

    def trial(prompt=prompt, max_tokens=args.generation_tokens):
        if drafter is None:
            steps = generate_step(
                model, prompt, sampler, max_tokens, prefill_step_size=args.prefill_step_size
            )
            return timed(steps, len(prompt))
        from ..engine.generation import stream_generate

        responses = stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=max_tokens,
            seed=0,
            eos_token_ids=set(),
            draft=drafter,
            num_draft_tokens=args.num_draft_tokens,
            prefill_step_size=args.prefill_step_size,
        )

        def steps():
            for r in responses:
                yield r.token, None
            spec.append(r.speculative)

        return timed(steps(), len(prompt))

    res = run_trials(trial, args.num_trials)
    if ckpt.placement is not None and ckpt.placement.plan.experts is not None:
        res["expert_load"] = expert_routes(model, ckpt.placement, group, trial)
    if spec:  # the timed trials (the first was the warm-up)
        from ..engine.speculative import SpecStats

        total = SpecStats()
        for s in spec[1 : 1 + args.num_trials]:
            for k in total.__dict__:
                setattr(total, k, getattr(total, k) + getattr(s, k))
        res["speculative"] = {"draft": args.draft, "k": args.num_draft_tokens, **total.to_dict()}
    peaks = all_gather_object(
        (load_peak, res["peak_memory_gb"], ckpt.load_stats["bytes_read"], weights), group
    )
    res.update(load_time_s=load_s, load_peak_memory_gb=[p[0] for p in peaks])
    res["load_bytes_read"] = [p[2] for p in peaks]  # from weight files, per rank
    placement = ckpt.placement
    res["split"] = list(placement.plan.weights) if placement and placement.plan.weights else None
    res["placement_bytes"] = [r.nbytes for r in placement.ranks] if placement else None
    res["peak_memory_gb"] = [p[1] for p in peaks]
    rows = None
    if getattr(sampler, "sample_with_rows", None) and sampler.shard.embedding is not None:
        # steady state: the previous step's exchange brought the token's embedding row
        rows = sampler.shard.embedding.local_rows(mx.array([0]))  # (1, dim)
    one = mx.array([1], dtype=mx.int32)
    mode = "count" if mesh is None else "identity"  # a stage evaluates its sends
    res["collectives"] = count_collectives(
        model, lambda cache: decode_step(model, sampler, cache, one, rows), mode
    )
    # The run's peak above the weights: activations, KV cache, temporaries.
    res["weights_gb"] = [p[3] for p in peaks]
    res["activation_peak_gb"] = [p[1] - p[3] for p in peaks]
    with lazy_query_blocks():  # graphs only: chunked attention evaluates nothing
        res["prefill_collectives"] = count_prefill_collectives(model, len(prompt) - 1, mode)
    res.update(mesh_traffic(model, res["collectives"]["traffic"], group))
    res["rounds_per_token"] = (
        res["speculative"]["collectives_per_token"] if spec else res["mesh"]["rounds_per_token"]
    )
    if group.size() > 1 and args.collective_steps > 0:
        k = args.collective_steps
        res.update(decode_share(lambda: 1 / trial(prompt[:16], k + 1)[0]["generation_tps"]))
    else:  # nothing to share with: no collectives
        step_ms = 1e3 / res["generation_tps"] if res["generation_tps"] else 0.0
        res.update(decode_step_ms=step_ms, decode_step_ms_no_collectives=step_ms)
        res["collective_share"] = 0.0
    from ..engine.step import compiling, decode_step_for

    # compiled decode steps: their recompilations (traces) and the graphs kept
    res["compile"] = {"on": compiling(), **decode_step_for(model).stats()}
    res["n_layers"] = len(model.layers)
    res["max_rss_gb"] = [m / 1e9 for m in all_gather_object(max_rss(), group)]  # per rank
    res["threads"] = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self") else None
    return res, prompt


def expert_routes(model: Any, placement: Any, group: mx.distributed.Group, trial) -> dict:
    """The routes each rank's experts take in one more trial (counted apart from the timed
    ones: counting adds small ops to every MoE layer)."""
    from ..engine import expert_load
    from ..models.moe import record_expert_load

    expert_load.start(model)
    trial()
    load = expert_load.gather(model, placement, group)
    record_expert_load(model, False)
    return {**load.to_dict(), "summary": load.summary()}


def mesh_traffic(model: Any, mine: dict[str, Any], group: mx.distributed.Group) -> dict[str, Any]:
    """Every rank's counted messages of one decode step (`mine`: this rank's, from
    `count_collectives`), with its place in the mesh, and the rounds of one token.

    Collective (one all_gather_object). The stages of a pipeline run one after the other,
    so a token's rounds, one after the other, are: each stage's tensor-group rounds up to
    the logits (its tensor rank 0's), each hop to the next stage (a send), the pipeline
    group's all-reduce of the logits, then the most tensor-group rounds any stage makes
    after it (sampling: the stages do that side by side). With tensor parallelism only,
    rank 0's rounds."""
    mesh = getattr(model, "mesh", None)
    where = (0, group.rank()) if mesh is None else (mesh.stage, mesh.tp_rank)
    ranks = [
        {"rank": r, "stage": s, "tp_rank": t, **x}
        for r, ((s, t), x) in enumerate(all_gather_object((where, mine), group))
    ]
    leaders = [r for r in ranks if r["tp_rank"] == 0]  # one rank per stage
    rounds = sum(r["tensor_rounds"][0] for r in leaders)
    rounds += sum(m["calls"] for r in leaders for m in r["messages"] if m["op"] == "send")
    rounds += sum(
        m["calls"]
        for m in ranks[0]["messages"]
        if m["group"] == "pipeline" and m["op"] not in ("send", "recv")
    )
    rounds += max(r["tensor_rounds"][1] for r in leaders)
    layers = [model.args.n_layers] if mesh is None else [len(r) for r in mesh.layers]
    shape = {
        "tp": group.size() if mesh is None else mesh.tp,
        "pp": 1 if mesh is None else mesh.pp,
        "layers_per_stage": layers,
        "stages": [list(range(group.size()))] if mesh is None else mesh.stages,
        "rounds_per_token": rounds,
    }
    return {"mesh": shape, "traffic": ranks}


def bench_prompt(args: Any, path: Path, model: Any, group: mx.distributed.Group) -> list[int]:
    """--prompt TEXT with the chat template, or -p random token ids (the same on every rank)."""
    if args.prompt:
        from ..checkpoints import open_checkpoint
        from ..checkpoints.tokenizer import encode_prompt, load_tokenizer

        tok = load_tokenizer(open_checkpoint(path, group.rank(), group.size()))
        ids = encode_prompt(tok, args.prompt, None, True)
        args.prompt_tokens = len(ids)
        return ids
    ids = mx.random.randint(0, model.args.vocab_size, (args.prompt_tokens,), key=mx.random.key(0))
    return broadcast_object(ids.tolist(), group)


def bench_tokenizer(path: Path, group: mx.distributed.Group):
    """The tokenizer of the checkpoint at `path`."""
    from ..checkpoints import open_checkpoint
    from ..checkpoints.tokenizer import load_tokenizer

    return load_tokenizer(open_checkpoint(path, group.rank(), group.size()))


def bench_drafter(
    args: Any, path: Path, model: Any, group: mx.distributed.Group, split: Any = None
):
    """The drafter of --draft ngram|PATH, or None (a sharded draft by the model's `split`)."""
    from ..engine.drafters import NgramDrafter, load_draft, make_drafter

    if not args.draft:
        return None
    if args.draft == "ngram":
        return NgramDrafter()
    tok = bench_tokenizer(path, group)
    draft = load_draft(args.draft, model, tok, group, args.draft_sharded, split)
    return make_drafter(draft, model)


def pin(spec: str, rank: int) -> list[int]:
    """Pin every thread of this process to one core (`auto`: core `rank`).

    Returns the cores this process's threads may run on, read back afterwards.
    """
    from ..cluster.affinity import pin_threads
    from ..console.cli import UsageError

    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        raise UsageError("--pin-core needs Linux (sched_setaffinity)")
    if spec == "auto":
        core = rank % (os.cpu_count() or 1)
    else:
        try:
            cores = [int(c) for c in spec.split(",")]
        except ValueError:
            raise UsageError(
                f"--pin-core: expected auto or a list like 0,1, got {spec!r}"
            ) from None
        core = cores[rank % len(cores)]
    try:
        return pin_threads([core])
    except OSError as e:
        raise UsageError(f"--pin-core: cannot pin to core {core}: {e}") from None


def prepare_model(args: Any, group: mx.distributed.Group) -> tuple[Path, str]:
    """The checkpoint path (a synthetic one is written by rank 0 first) and its label."""
    from ..loading.loader import default_model

    if args.synthetic:
        from .synthetic import parse_spec, synthetic_dir

        parse_spec(args.synthetic)
        if group.rank() == 0:
            synthetic_dir(args.synthetic)
        barrier(group)
        return synthetic_dir(args.synthetic), f"synthetic {args.synthetic}"
    from ..console.cli import model_on_some_rank

    path = Path(args.model or model_on_some_rank(default_model, group))
    return path, path.name


def _weights(ckpt) -> tuple[float, ...] | None:
    """The --split weights the checkpoint was placed with (None: balanced, or mlx-lm's classes)."""
    return ckpt.placement.plan.weights if ckpt.placement is not None else None
