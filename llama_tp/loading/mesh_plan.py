"""The plan of a tp x pp mesh: each rank's stage, layers, tensor rank and slice.

The placement (`parallel/placement.py`: a pure function of the number of ranks and the
checkpoint's shapes, no launch, no weight read) is what `load_model(..., tp=, pp=)`
computes and loads; `python -m llama_tp.plan -n 4 --tp 2 --pp 2` prints it with each
stage's style table (the built-in plan over the stage's tensor group, shown on the
stage cut out of the lazily built model as the loader cuts it). Ranks are placed in
rank order, as on one host; across hosts `parallel.mesh.layout` orders them by host
first. `convert --shards N --tp T --pp P` writes each rank's folder from this
placement (`loading/mesh_split.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from ..checkpoints.base import Checkpoint
from ..checkpoints.build import skeleton
from ..checkpoints.slices import model_shape
from ..cluster.diagnostics import text_table
from ..parallel.mesh import Mesh, MeshError, layout, mesh_shape
from ..parallel.parallelize import format_plan_table
from ..parallel.placement import DEFAULT_MOE_SPLIT, Placement, RankPlacement, place
from ..parallel.plan_text import (
    expert_cells,
    expert_header,
    format_kv_heads,
    format_ranges,
    human_bytes,
    imbalance,
    share_line,
)
from ..parallel.shard import builtin_plan
from ..parallel.shares import Weights
from .pipeline import PipelineModel, stage_module


@dataclass
class MeshPlan:
    """The mesh of `n` ranks: its placement and the stage models (lazy, for the tables)."""

    placement: Placement
    mesh: Mesh  # groups None: a description, not a running mesh
    models: list[PipelineModel]  # each stage, unsharded and lazy

    @property
    def tp(self) -> int:
        return self.placement.tp

    @property
    def pp(self) -> int:
        return self.placement.pp

    @property
    def ranks(self) -> tuple[RankPlacement, ...]:
        return self.placement.ranks

    @property
    def vocab_parallel(self) -> bool:
        return self.placement.vocab_parallel


def mesh_plan(
    ckpt: Checkpoint,
    n: int,
    tp: int | None,
    pp: int | None,
    pp_split: str | None = None,
    vocab_parallel: bool = True,
    full: nn.Module | None = None,
    moe_split: str = DEFAULT_MOE_SPLIT,
    split: Weights | None = None,
) -> MeshPlan:
    """The mesh of `n` ranks for `--tp`/`--pp`/`--pp-split` (and `--split` weights of each
    tensor group); MeshError (the loader's one-line messages) when it cannot run. `full`:
    the checkpoint's model, if already built (e.g. re-quantized by `convert`: its shapes
    are placed); by default built lazily, for its style tables."""
    from ..parallel.shard import model_shape_of

    T, P = mesh_shape(n, tp, pp)
    if pp_split and P == 1:
        raise MeshError("--pp-split needs --pp (the number of pipeline stages)")
    shape = model_shape(ckpt) if full is None else model_shape_of(full)
    stages = layout(["one host"] * n, T, P, by_host=False)
    placement = place(
        shape,
        T,
        P,
        pp_split,
        vocab_parallel=vocab_parallel,
        moe_split=moe_split,
        stages=stages,
        split=split,
    )
    full = skeleton(ckpt) if full is None else full
    mesh = Mesh(T, P, 0, 0, stages, None, None, list(placement.layers))
    models = [
        stage_module(full, Mesh(T, P, s, 0, stages, None, None, mesh.layers)) for s in range(P)
    ]
    return MeshPlan(placement, mesh, models)


def _vocab_cell(mp: MeshPlan, r: RankPlacement) -> str:
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


def bytes_lines(placement: Placement) -> list[str]:
    """The imbalance of the weight bytes over all ranks; under --split weights, each
    stage's tensor ranks' shares against them (`plan_text.share_line`)."""
    nbytes = [r.nbytes for r in placement.ranks]
    if placement.plan.weights is None:
        return [f"imbalance: {imbalance(nbytes):.1f}% of weight bytes"]
    return [
        f"stage {s}: "
        + share_line(placement.plan.weights, [placement.at(s, t).nbytes for t in range(len(m))])
        for s, m in enumerate(placement.stages)
    ]


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
            *expert_header(mp.placement.plan),
            "vocabulary",
            "weights",
        ]
    ]
    for r in mp.ranks:
        replicated = mp.placement.plan.replicated_kv_heads()
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
                f"{f.start}-{f.stop - 1} [{len(f)}]" if len(f) else "-",
                *expert_cells(mp.placement.plan, r.part),
                _vocab_cell(mp, r),
                human_bytes(r.nbytes),
            ]
        )
    lines += text_table(rows)
    lines += bytes_lines(mp.placement)
    stage_lines = mp.mesh.describe().splitlines()
    if mp.tp == 1:  # every rank holds its layers whole: no tables
        return "\n".join([*lines, "", *stage_lines])
    for s, members in enumerate(mp.mesh.stages):
        labels = [f"rank {r}" for r in members]
        lines += ["", stage_lines[s]]
        table = builtin_plan(mp.models[s], mp.placement)
        lines.append(format_plan_table(mp.models[s], table, mp.tp, labels))
    return "\n".join(lines)
