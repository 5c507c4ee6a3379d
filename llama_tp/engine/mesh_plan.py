"""The plan of a tp x pp mesh: each rank's stage, layers, tensor rank and slice.

A pure function of the number of ranks, read from a checkpoint's shapes only (no
launch, no weight read): `python -m llama_tp.plan -n 4 --tp 2 --pp 2` prints it.
Every stage is built as the loader builds it (`pipeline.stage_ranges` for the layer
split, `pipeline.stage_module`, the built-in plan over the stage's tensor group) and
each rank's bytes are counted with the loader's own `tensor_slice`, so the plan shows
what `load_model(..., tp=, pp=)` holds. Ranks are placed in rank order, as on one
host; across hosts `parallel.mesh.layout` orders them by host first. `convert --shards
N --tp T --pp P` writes each rank's folder from this plan (`engine/mesh_split.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn
from mlx.utils import tree_flatten

from ..checkpoints.base import Checkpoint
from ..checkpoints.build import build_model
from ..cluster.diagnostics import text_table
from ..parallel.llama_plan import check_quantized_heads, llama_plan, plan_for
from ..parallel.mesh import Mesh, MeshError, layout, mesh_shape
from ..parallel.parallelize import format_plan_table
from ..parallel.partition import (
    Plan,
    RankPart,
    format_kv_heads,
    format_ranges,
    human_bytes,
    imbalance,
    tensor_slice,
    vocab_ranges,
)
from ..parallel.styles import Replicate, Style, VocabParallel
from .pipeline import PipelineModel, stage_module, stage_ranges


@dataclass(frozen=True)
class RankSlice:
    """What one rank of the mesh holds."""

    rank: int
    stage: int
    tp_rank: int
    layers: range  # global layer indices of its stage
    part: RankPart  # its heads and feed-forward columns of each of those layers
    vocab: range | None  # its rows of the embedding / head (None: whole)
    nbytes: int  # parameter bytes it loads


@dataclass
class MeshPlan:
    """The mesh of `n` ranks: its stages, the stage models (lazy) and every rank's slice."""

    tp: int
    pp: int
    mesh: Mesh  # groups None: a description, not a running mesh
    partitions: list[Plan]  # each stage's partition plan over its tp ranks
    models: list[PipelineModel]  # each stage, unsharded and lazy
    ranks: list[RankSlice]
    vocab_parallel: bool


def stage_bytes(model: nn.Module, plan: Plan, part: RankPart, vocab: range | None) -> int:
    """Parameter bytes of `model` (a stage, unsharded) that rank `part` keeps: the slices
    the loader reads (`tensor_slice`), whole tensors elsewhere."""
    total = 0
    for name, v in tree_flatten(model.parameters()):
        s = tensor_slice(plan, part, name, v.shape, vocab) if plan.n > 1 else None
        total += v.nbytes if s is None else v.nbytes // v.shape[s[0]] * (s[2] - s[1])
    return total


def mesh_plan(
    ckpt: Checkpoint,
    n: int,
    tp: int | None,
    pp: int | None,
    pp_split: str | None = None,
    vocab_parallel: bool = True,
    full: nn.Module | None = None,
) -> MeshPlan:
    """The mesh of `n` ranks for `--tp`/`--pp`/`--pp-split`; MeshError (the loader's
    one-line messages) when it cannot run. `full`: the checkpoint's model, if already
    built (e.g. re-quantized by `convert`); by default built lazily, for its shapes."""
    T, P = mesh_shape(n, tp, pp)
    if pp_split and P == 1:
        raise MeshError("--pp-split needs --pp (the number of pipeline stages)")
    if full is None:
        full = build_model(ckpt, whole=False)  # lazy: shapes only
    stages = layout(["one host"] * n, T, P, by_host=False)
    mesh = Mesh(T, P, 0, 0, stages, None, None, stage_ranges(full, P, pp_split))
    vocab_parallel = vocab_parallel and T > 1
    vocab = vocab_ranges(full.args.vocab_size, T) if vocab_parallel else [None] * T
    partitions, models, ranks = [], [], []
    for s, members in enumerate(stages):
        view = Mesh(T, P, s, 0, stages, None, None, mesh.layers)
        model = stage_module(full, view)
        plan = plan_for(model, T)
        if T > 1:
            check_quantized_heads(model, plan)  # as `shard_model` does when loading
        partitions.append(plan)
        models.append(model)
        for t, rank in enumerate(members):
            nbytes = stage_bytes(model, plan, plan.parts[t], vocab[t])
            ranks.append(RankSlice(rank, s, t, mesh.layers[s], plan.parts[t], vocab[t], nbytes))
    ranks.sort(key=lambda r: r.rank)
    return MeshPlan(T, P, mesh, partitions, models, ranks, vocab_parallel)


def stage_styles(mp: MeshPlan, s: int) -> dict[str, Style]:
    """The built-in plan of stage `s` over its tensor group, for what the stage holds:
    its layers, and the embedding (vocabulary-parallel on the first stage) or the
    norm and head (loss-parallel on the last)."""
    model = mp.models[s]
    table = llama_plan(model, mp.tp, vocab_parallel=mp.vocab_parallel, plan=mp.partitions[s])
    table = {k: v for k, v in table.items() if k.split(".")[0] in model}
    if s == 0 and "tok_embeddings" in table:  # a tied table is the head only on the last
        table["tok_embeddings"] = VocabParallel() if mp.vocab_parallel else Replicate()
    return table


def _vocab_cell(mp: MeshPlan, r: RankSlice) -> str:
    model = mp.models[r.stage]
    what = []
    if r.stage == 0:
        what.append("embedding")
    if r.stage == mp.pp - 1:
        what.append("head (tied)" if "output" not in model else "head")
    if not what:
        return "-"
    rows = "whole" if r.vocab is None else f"rows {r.vocab.start}-{r.vocab.stop - 1}"
    return f"{', '.join(what)}: {rows}"


def format_mesh(mp: MeshPlan, name: str) -> str:
    """The mesh as text: one row per rank (stage, layers, tensor rank, heads, feed-forward
    columns, vocabulary rows, bytes), then each stage's plan table over its ranks."""
    n = len(mp.ranks)
    lines = [
        f"{name}: the mesh --tp {mp.tp} x --pp {mp.pp} on {n} ranks (in rank order, as on one host)"
    ]
    rows = [
        [
            "rank",
            "stage",
            "layers",
            "tensor rank",
            "q heads",
            "kv heads",
            "ffn columns",
            "vocabulary",
            "weights",
        ]
    ]
    for r in mp.ranks:
        replicated = mp.partitions[r.stage].replicated_kv_heads()
        q, kv, f = r.part.q_heads, r.part.kv_heads, r.part.ffn
        mapped = "" if r.part.kv_map is None else " (mapped)"
        rows.append(
            [
                str(r.rank),
                str(r.stage),
                f"{r.layers.start}-{r.layers.stop - 1} [{len(r.layers)}]",
                f"{r.tp_rank} of {mp.tp}",
                f"{format_ranges(list(q))}{mapped} [{len(q)}]",
                f"{format_kv_heads(kv, replicated)} [{len(kv)}]",
                f"{f.start}-{f.stop - 1} [{len(f)}]",
                _vocab_cell(mp, r),
                human_bytes(r.nbytes),
            ]
        )
    lines += text_table(rows)
    lines.append(f"imbalance: {imbalance([r.nbytes for r in mp.ranks]):.1f}% of weight bytes")
    stage_lines = mp.mesh.describe().splitlines()
    if mp.tp == 1:  # every rank holds its layers whole: no tables
        return "\n".join([*lines, "", *stage_lines])
    for s, members in enumerate(mp.mesh.stages):
        labels = [f"rank {r}" for r in members]
        lines += ["", stage_lines[s]]
        lines.append(format_plan_table(mp.models[s], stage_styles(mp, s), mp.tp, labels))
    return "\n".join(lines)
