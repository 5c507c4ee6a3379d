"""`python -m llama_tp.doctor`: is this machine (or cluster) ready for llama_tp?

    python -m llama_tp.doctor
    mlx.launch -n 2 -- python -m llama_tp.doctor [--json] [--quick]
    python -m llama_tp.launch -n 4 -m llama_tp.doctor --tp 2 --pp 2   # and the mesh
    python -m llama_tp.launch -n 2 -m llama_tp.doctor --model M       # do its weights fit?

Reports, from rank 0: the MLX backend, the ranks with their hosts, process ids
and versions, all-reduce latency and bus bandwidth for a few message sizes,
whether MLX's CPU matrix product is the slow reference BLAS, which path quantized
products take on the CPU (llama_tp's native kernels, or MLX's with the reason), each
rank's total and available memory with the `--split` weights that balance the time per
step and the ones that fit memory (`checks/split.py`; with --model, whether that
model's weights fit, and the numbers when they cannot, and which path runs it), whether a
tiny random Llama sharded over the ranks reproduces the single-process logits, and whether
a tiny model on mlx-lm's own classes (Gemma 2) split into pipeline stages reproduces
mlx-lm's. With
--tp/--pp/--dp it also builds that mesh and reports where each rank lands (host,
replica, stage, tensor rank), whether a tensor group spans hosts (a warning: its
all-reduces would cross the network), and the latency of an 8 KB all-reduce in the
tensor groups and of an 8 KB hand-off between stages 0 and 1.

Every check runs on every rank and ends with `agree_ok`, so all ranks agree on
its outcome and leave together. Any failed check: exit code 1. Under mlx.launch,
`llama_tp.watchdog` ends a rank whose check makes no progress for --timeout
seconds (exit code 3): a stopped peer would block MLX collectives for ever.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from typing import Any

import mlx.core as mx

from .cluster.diagnostics import (
    VERSION_KEYS,
    Check,
    backend_name,
    blas_on_this_rank,
    rank_info,
    run_check,
    text_table,
    time_all_reduce,
    version_differences,
)
from .cluster.distributed import all_gather_object, print0, world
from .console.command import script, start

ALL_REDUCE_BYTES = (4, 8 << 10, 1 << 20, 16 << 20)
LOGITS_ATOL = 1e-4  # fp32; sharding only changes the summation order


class DoctorError(RuntimeError):
    """One or more checks failed."""


def tiny_model(seed: int = 0):
    """A random fp32 Qwen3-MoE small enough to run everywhere: 4 query / 2 KV heads, so
    that 3 ranks get an uneven plan (replicated KV heads), per-head q/k norms, a dense
    layer then a mixture of 5 experts (2 per token: no N > 1 divides them), vocabulary
    97 (no N divides it)."""
    from .model_args import ModelArgs
    from .models.registry import build

    args = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=97,
        model_type="qwen3_moe", qk_norm=True, n_experts=5, n_experts_per_tok=2,
        moe_hidden_dim=48, norm_topk_prob=True, sparse_layers=[1],
    )  # fmt: skip
    mx.random.seed(seed)
    model = build(args)
    mx.eval(model.parameters())
    return model


def run_logits(model, tokens: mx.array) -> mx.array:
    """Logits of a prefill then two cached single-token steps: (L, vocab), gathered when
    the vocabulary is sharded. Each step is evaluated on its own so that the all-reduces
    of every rank run in the same order."""
    from mlx_lm.models.cache import make_prompt_cache

    from .engine.sampling import vocab_shard

    cache = make_prompt_cache(model)
    shard = vocab_shard(model)
    steps = [tokens[:, :-2], tokens[:, -2:-1], tokens[:, -1:]]
    out = []
    for step in steps:
        logits = model(step, cache=cache)[0].astype(mx.float32)  # (l, V or V_local)
        out.append(shard.full_logits(logits))
        mx.eval(out[-1])
    return mx.concatenate(out, axis=0)


def plan_text(plan) -> str:
    from .parallel.partition import split_units

    heads = "+".join(str(len(p.q_heads)) for p in plan.parts)
    ffn = "+".join(str(len(p.ffn)) for p in plan.parts)
    kind = "even" if plan.even_attention and plan.even_ffn else "uneven"
    columns = "+".join(str(len(p.expert_ffn)) for p in plan.parts)
    whole = "+".join(map(str, (len(r) for r in split_units(plan.experts.n_experts, [1] * plan.n))))
    return (
        f"{kind} plan: query heads {heads}, ffn columns {ffn}; experts by tensor (columns "
        f"{columns}) and by expert ({whole})"
    )


def diagnose(
    group: mx.distributed.Group,
    quick: bool = False,
    fault_rank: int | None = None,
    mesh: tuple[int | None, int | None, int | None] | None = None,
    model: str | None = None,
    weights_cache: str | None = None,
) -> dict[str, Any]:
    """Run every check on every rank (all ranks must call this); the report, alike on
    every rank, as a JSON-able dict. `fault_rank` perturbs that rank's sharded model
    (to test that a failing check fails everywhere); `mesh`: (tp, pp, dp) to check;
    `model`: a checkpoint whose weights the split advice places, and whose ranks say
    where their weights would come from (`weights_cache`: the cache folder a run uses)."""
    from .checks.split import check_split
    from .checks.weights import check_weights

    report: dict[str, Any] = {"backend": backend_name(group), "ranks": group.size()}
    checks = _check_ranks(group, report)
    checks.append(_check_blas(group, report, quick))
    checks.append(check_split(group, report, model, *(mesh or (None, None, None))))
    checks.append(_check_kernels(group, report))
    checks.append(_check_all_reduce(group, report, quick))
    tp, pp = (mesh or (None, None))[:2]
    checks.append(check_weights(group, report, model, tp, pp, quick, weights_cache))
    checks.append(_check_logits(group, fault_rank))
    checks.append(_check_generic(group))
    if mesh is not None:
        from .checks.mesh import check_mesh

        checks.append(check_mesh(group, report, *mesh, quick))
    report["checks"] = [asdict(c) for c in checks]
    report["ok"] = not any(c.status == "FAILED" for c in checks)
    return report


def _check_ranks(group: mx.distributed.Group, report: dict) -> list[Check]:
    infos, err = run_check("ranks", lambda: all_gather_object(rank_info(group), group), group)
    report["hosts"] = infos or []
    if err:
        return [Check("ranks", "FAILED", err)]
    hosts = len({i["host"] for i in infos})
    checks = [Check("ranks", "ok", f"{group.size()} rank(s) answered on {hosts} host(s)")]
    diffs = version_differences(infos)
    if diffs:
        checks.append(Check("versions", "warn", "ranks differ: " + "; ".join(diffs)))
    else:
        checks.append(Check("versions", "ok", "same on every rank"))
    return checks


def _check_blas(group: mx.distributed.Group, report: dict, quick: bool) -> Check:
    from .cluster.blas import preload_line

    per_rank, err = run_check(
        "blas", lambda: all_gather_object(blas_on_this_rank(quick), group), group
    )
    if err:
        return Check("blas", "FAILED", err)
    for info, b in zip(report["hosts"], per_rank, strict=False):
        info["blas"] = b
    worst = max(b["seconds"] for b in per_rank)
    timing = f"1024x1024 fp32 matmul {worst:.3f} s ({2 * 1024**3 / worst / 1e9:.1f} GFLOP/s)"
    slow = [r for r, b in enumerate(per_rank) if b["slow"]]
    if not slow:
        return Check("blas", "ok", f"fast: {timing}")
    where = "" if group.size() == 1 else f" on rank {', '.join(map(str, slow))}"
    first = per_rank[slow[0]]
    lib = f" {os.path.basename(first['library'])}" if first["library"] else ""
    fix = f"run every rank with {preload_line(first['openblas'])}"
    if not first["openblas"]:
        fix = f"apt-get install libopenblas0-pthread, then {fix}"
    return Check("blas", "warn", f"slow (reference BLAS{lib}){where}: {timing}; {fix}")


def _check_kernels(group: mx.distributed.Group, report: dict) -> Check:
    """Which path quantized CPU products take on each rank (`llama_tp.kernels`)."""
    from . import kernels

    per_rank, err = run_check(
        "kernels", lambda: all_gather_object(kernels.status().describe(), group), group
    )
    if err:
        return Check("kernels", "FAILED", err)
    report["kernels"] = per_rank
    if all(not line.startswith("MLX") for line in per_rank):
        where = "" if group.size() == 1 else " on every rank"
        return Check("kernels", "ok", f"{per_rank[0]}{where}")
    off = [r for r, line in enumerate(per_rank) if line.startswith("MLX")]
    where = "" if group.size() == 1 else f" on rank {', '.join(map(str, off))}"
    return Check("kernels", "warn", f"quantized products use {per_rank[off[0]]}{where}")


def _check_all_reduce(group: mx.distributed.Group, report: dict, quick: bool) -> Check:
    report["all_reduce"] = []
    if group.size() == 1:
        return Check("all-reduce", "n/a", "single process: nothing to reduce")
    rows, err = run_check(
        "all-reduce", lambda: [time_all_reduce(group, b, quick) for b in ALL_REDUCE_BYTES], group
    )
    if err:
        return Check("all-reduce", "FAILED", err)
    report["all_reduce"] = rows
    return Check("all-reduce", "ok", f"sums correct at {', '.join(map(_size, ALL_REDUCE_BYTES))}")


def _check_logits(group: mx.distributed.Group, fault_rank: int | None) -> Check:
    """The tiny model sharded over `group` against the same model whole, on every rank."""
    from mlx.utils import tree_flatten

    from .parallel.partition import vocab_ranges
    from .parallel.shard import shard_model, shard_vocab

    def shard(whole, split: str):
        sharded = tiny_model()
        sharded.load_weights(tree_flatten(whole.parameters()))  # same weights, whatever the seed
        plan = None
        if group.size() > 1:
            plan = shard_model(sharded, group, split)
            rows = vocab_ranges(sharded.args.vocab_size, group.size())[group.rank()]
            shard_vocab(sharded, group, rows.start, rows.stop)
        if fault_rank == group.rank():
            sharded.norm.weight = sharded.norm.weight * 1.01  # --inject-fault: this rank is off
        mx.eval(sharded.parameters())
        return sharded, plan

    def build():  # local work only: a failure here cannot leave a peer in a collective
        whole = tiny_model()
        # the experts split by tensor (every expert's columns) and by expert (whole ones)
        (by_tensor, plan), (by_expert, _) = shard(whole, "tensor"), shard(whole, "expert")
        return whole, [by_tensor, by_expert], plan

    built, err = run_check("logits", build, group)
    if err:
        return Check("logits", "FAILED", f"could not shard the tiny model: {err}")
    whole, sharded_models, plan = built
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]], dtype=mx.int32)

    def compare() -> float:
        ref = run_logits(whole, tokens)
        diff = max(mx.max(mx.abs(run_logits(m, tokens) - ref)).item() for m in sharded_models)
        if not diff <= LOGITS_ATOL:  # also catches NaN
            raise ValueError(
                f"sharded logits differ from the single process: max abs diff {diff:.3g} "
                f"> {LOGITS_ATOL:g}"
            )
        return diff

    diff, err = run_check("logits", compare, group)
    if err:
        return Check("logits", "FAILED", err)
    how = "1 rank: nothing to shard" if plan is None else plan_text(plan)
    return Check("logits", "ok", f"max abs diff {diff:.2g} <= {LOGITS_ATOL:g} ({how})")


def _check_generic(group: mx.distributed.Group) -> Check:
    """mlx-lm's classes (an architecture llama_tp does not implement) split into pipeline
    stages over `group`, against mlx-lm's whole model (`checks/generic.py`)."""
    from .checks.generic import stage_logits_diff

    result, err = run_check("mlx-lm classes", lambda: stage_logits_diff(group), group)
    if err:
        return Check("mlx-lm classes", "FAILED", err)
    diff, how = result
    if not diff <= LOGITS_ATOL:
        return Check("mlx-lm classes", "FAILED", f"max abs diff {diff:.3g} > {LOGITS_ATOL:g}")
    return Check("mlx-lm classes", "ok", f"tiny Gemma 2: max abs diff {diff:.2g} ({how})")


def _size(nbytes: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _duration(us: float) -> str:
    return f"{us / 1000:.1f} ms" if us >= 1000 else f"{us:.0f} us"


def _rate(gbps: float) -> str:
    return f"{gbps:.3g} GB/s" if gbps >= 1 else f"{gbps * 1000:.3g} MB/s"


def format_report(report: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = [f"llama_tp doctor: {report['ranks']} rank(s), backend {report['backend']}", ""]
    head = ("rank", "host", "pid", "python", "mlx", "mlx-lm", "llama_tp", "matmul")
    rows = [head]
    for i in report["hosts"]:
        matmul = f"{i['blas']['seconds']:.3f} s" if "blas" in i else "-"
        rows.append((str(i["rank"]), i["host"], str(i["pid"]), *map(i.get, VERSION_KEYS), matmul))
    lines += text_table(rows)
    if report["all_reduce"]:
        lines += ["", "all-reduce (fp32 all_sum; latency of the slowest rank per iteration):"]
        rows = [("size", "iterations", "median", "p90", "bus bandwidth")]
        rows += [
            (_size(r["bytes"]), str(r["iterations"]), _duration(r["median_us"]))
            + (_duration(r["p90_us"]), _rate(r["bus_gbps"]))
            for r in report["all_reduce"]
        ]
        lines += text_table(rows, right=True)
    from .checks.mesh import mesh_lines

    lines += mesh_lines(report.get("mesh"))
    from .checks.split import split_lines

    lines += split_lines(report)
    lines.append("")
    for c in report["checks"]:
        if c["status"] == "warn" and c["name"] == "versions":
            lines.append(f"WARNING: {c['detail']}")
    lines += text_table([(c["name"], c["status"], c["detail"]) for c in report["checks"]])
    counts = {s: sum(c["status"] == s for c in report["checks"]) for s in ("ok", "warn", "FAILED")}
    verdict = "healthy" if report["ok"] else "FAILED"
    lines += [
        "",
        f"doctor: {verdict}: {counts['ok']} ok, {counts['warn']} warning(s), "
        f"{counts['FAILED']} failed",
    ]
    return "\n".join(lines)


def _parser():
    from .console.cli import ArgumentParser

    p = ArgumentParser(
        prog="python -m llama_tp.doctor",
        description="Check this machine or cluster: backend, ranks, versions, all-reduce "
        "speed, BLAS, and sharded logits of a tiny model against the single process.",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quick", action="store_true", help="fewer timing iterations")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per check (120)")
    p.add_argument("--tp", type=int, help="also check this mesh: ranks per tensor group")
    p.add_argument("--pp", type=int, help="... pipeline stages (default 1)")
    p.add_argument("--dp", type=int, help="... data-parallel replicas (default 1)")
    p.add_argument(
        "--model",
        help="also check that this checkpoint's weights fit each rank's available memory, "
        "balanced and under the suggested --split weights (nothing is loaded)",
    )
    p.add_argument(
        "--weights-cache",
        metavar="DIR|none",
        help="with --model: the cache folder a run would use (see generate --help)",
    )
    # For the tests: perturb this rank's sharded model so that the logits check fails.
    p.add_argument("--inject-fault", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _check(args) -> None:
    """UsageError for flags out of range or a mesh the group cannot hold (the same on
    every rank, before any collective); sets `args.mesh` (None: none asked)."""
    from .console.cli import UsageError
    from .parallel.mesh import MeshError, mesh_shape

    size = world().size()
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout:g}")
    if args.inject_fault is not None and not 0 <= args.inject_fault < size:
        raise UsageError(f"--inject-fault must be a rank in 0..{size - 1}")
    mesh = (args.tp, args.pp, args.dp)
    args.mesh = None if mesh == (None, None, None) else mesh
    try:
        if args.mesh is not None:
            mesh_shape(size, *mesh)
    except MeshError as e:
        raise UsageError(str(e)) from None


def main() -> int:
    args = start(_parser(), _check, watch=True)  # --timeout: each check's
    group, mesh = world(), args.mesh
    report = diagnose(group, args.quick, args.inject_fault, mesh, args.model, args.weights_cache)
    print0(json.dumps(report, indent=2) if args.json else format_report(report), group=group)
    failed = [c for c in report["checks"] if c["status"] == "FAILED"]
    if failed:
        names = ", ".join(c["name"] for c in failed)
        raise DoctorError(f"doctor: {len(failed)} check(s) failed: {names}: {failed[0]['detail']}")
    return 0


cli = script(main)  # the console script

if __name__ == "__main__":
    cli()
