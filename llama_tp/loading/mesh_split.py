"""Pre-split checkpoints for a tp x pp mesh: folder r holds what world rank r loads.

    python -m llama_tp.convert --model M --out DIR --shards 4 --tp 2 --pp 2 [--pp-split 10,12]
    python -m llama_tp.launch -n 4 -m llama_tp.generate --model DIR --tp 2 --pp 2 --prompt hi

The folders come from the mesh's placement (`parallel/placement.py`, what `python -m
llama_tp.plan -n 4 --tp 2 --pp 2` prints): the stage split exactly as the loader makes
it (balanced by parameter bytes, or `--pp-split`), each stage
split over its tensor group by the built-in plan, the embedding on stage 0 and the norm
and head on the last stage (vocabulary-parallel inside the stage's tensor group unless
`--no-vocab-parallel`). Folder r holds rank r's slices of its stage's layers, under
their global names (`layers.12....`), and nothing else; the loader reads it whole and
builds the stage as for an unsplit checkpoint (`loading/loader.py`).

Placement: folder r is for world rank r with the stages placed in rank order, as
`parallel.mesh.layout` places them on one host (`make_mesh` orders the ranks by host:
across hosts, list each host's ranks together in the hostfile, or set
LLAMA_TP_MESH_ORDER=rank). The manifest and every `shard.json` record the mesh (tp,
pp, the world ranks of each stage, each stage's layer count), and loading refuses a
folder made for another mesh, `--pp-split` or placement (`split.check_mesh`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..checkpoints.convert import clear_out, convert, open_source, write_folders
from ..checkpoints.split import Folder
from ..parallel.mesh import MeshError, mesh_shape
from ..parallel.placement import DEFAULT_MOE_SPLIT, RankPlacement
from ..parallel.shares import SplitSpec, fixed_weights
from .mesh_plan import MeshPlan, mesh_plan


def mesh_record(mp: MeshPlan, pp_split: str | None) -> dict[str, Any]:
    """The mesh as the manifest and every `shard.json` record it."""
    return {
        "tp": mp.tp,
        "pp": mp.pp,
        "stages": mp.mesh.stages,
        "split": [len(r) for r in mp.mesh.layers],
        "pp_split": pp_split,
    }


def rank_folder(r: RankPlacement, get) -> Folder:
    """Rank `r`'s folder: its placement's slices of its stage's tensors (global names)."""

    def tensors() -> dict[str, mx.array]:
        return {name: get(name, s) for name, s in r.slices.items()}

    mine = {"stage": r.stage, "tp_rank": r.tp_rank, "layers": [r.layers.start, r.layers.stop]}
    return Folder(r.rank, tensors, mine, mine)


def convert_mesh(
    src: Path,
    out: Path,
    *,
    shards: int,
    tp: int | None = None,
    pp: int | None = None,
    pp_split: str | None = None,
    quantize: int | None = None,
    group_size: int = 64,
    vocab_parallel: bool = True,
    progress: bool = True,
    dtype: str | None = None,
    moe_split: str = DEFAULT_MOE_SPLIT,
    split: SplitSpec = None,
) -> Path:
    """Convert `src` into one folder per rank of the mesh `tp` x `pp` of `shards` ranks
    (`tp` defaults to shards // pp). MeshError, with the loader's one-line messages,
    for a mesh that cannot run (checked before anything is written); with one stage
    the plain tensor-parallel split (`checkpoints.convert.convert`). `quantize`,
    `group_size`, `dtype`, `progress`, `split` (each stage's tensor group's weights) as
    for `convert`."""
    T, P = mesh_shape(shards, tp, pp, shards=True)
    kw = dict(quantize=quantize, group_size=group_size, dtype=dtype, progress=progress)
    if P == 1:
        if pp_split:
            raise MeshError("--pp-split needs --pp (the number of pipeline stages)")
        return convert(
            src,
            out,
            shards=shards,
            vocab_parallel=vocab_parallel,
            moe_split=moe_split,
            split=split,
            **kw,
        )
    weights = fixed_weights(split, T, "convert")
    src, out = Path(src), Path(out)
    source = open_source(src, quantize, group_size, dtype)
    mp = mesh_plan(
        source.ckpt,
        shards,
        T,
        P,
        pp_split,
        vocab_parallel,
        full=source.model,
        moe_split=moe_split,
        split=weights,
    )
    clear_out(out)
    folders = [rank_folder(r, source.get) for r in mp.ranks]
    write_folders(source, out, folders, mp.placement, progress, mesh_record(mp, pp_split))
    if progress:
        layers = ", ".join(f"{r.start}-{r.stop - 1}" for r in mp.mesh.layers)
        print(
            f"wrote {out} ({shards} rank folders for --tp {T} x --pp {P}: layers {layers})",
            file=sys.stderr,
        )
    return out
