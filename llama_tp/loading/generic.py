"""The loader's branch for architectures without a native implementation.

`loading/loader.load_model` sends a Hugging Face / MLX folder whose `model_type` llama_tp
does not implement here (`generic.classes.route`). The sequencing is the native loader's:
the mesh flags agreed and the mesh made, this rank's part read and evaluated
(`generic/loader.py`), any rank's failure raised on every rank, the load's statistics,
a barrier. The flags that only the native plan has (`--dtype`, a style plan,
`--sequence-parallel`, `--moe-split expert`, a tensor `--split`) are refused in one line.
On a pipeline of single ranks `--split` weighs the stages (`memory`: by each rank's
available memory), as `--pp-split W:W` does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..checkpoints.safetensors import READ
from ..cluster.distributed import agree_ok, agreed, all_gather_object, barrier
from ..cluster.memory import max_rss, memory_figures
from ..parallel.mesh import Mesh
from ..parallel.shares import MEMORY, SplitError, parse_split
from .agreement import check_mesh_flags


def refuse_native_only(
    dtype: str | None, plan: Any, sequence_parallel: bool, moe_split: str, route: Any
) -> None:
    """ValueError (one line) for a flag the mlx-lm path does not take."""
    flags = [
        ("--dtype", dtype is not None),
        ("a style plan", plan is not None),
        ("--sequence-parallel", sequence_parallel),
        ("--moe-split expert", moe_split == "expert"),
    ]
    given = [f for f, on in flags if on]
    if given:
        raise ValueError(
            f"{given[0]} is for natively implemented models; {route.model_type} runs on "
            "mlx-lm's classes"
        )


def stage_weights(
    split: Any, group: mx.distributed.Group, mesh: Mesh | None, tp: int
) -> tuple[float, ...] | None:
    """`--split` as the stages' weights on a pipeline of single ranks (collective for
    'memory'); SplitError for a tensor split, which mlx-lm's classes take only evenly."""
    if split is None:
        return None
    if mesh is None or tp > 1:
        raise SplitError(
            f"--split {split if isinstance(split, str) else ':'.join(map(str, split))}: "
            "mlx-lm's classes split tensors evenly; weigh pipeline stages with --pp and "
            "--split or --pp-split instead"
        )
    weights = parse_split(split, mesh.pp)
    if weights != MEMORY:
        return weights
    mine = agreed(lambda: memory_figures(group.rank()), group)
    figures = all_gather_object(mine, group)
    available = [figures[ranks[0]][1] for ranks in mesh.stages]
    if min(available) <= 0:
        raise SplitError(f"--split memory: stage {available.index(min(available))} has no memory")
    return tuple(float(a) for a in available)


def load_generic_model(path: str | Path, group: mx.distributed.Group, route: Any, options: Any):
    """`load_model` for an mlx-lm architecture (see the module docstring), with its
    `LoadOptions` (`vocab_parallel` and `weights_cache` are the native loader's): (model,
    ckpt), every rank returning once all have loaded; if one fails, all raise."""
    from ..generic.convert import is_stage_split, rank_folder
    from ..generic.loader import load_generic, local_path

    o = options
    tp, pp, pp_split, dp, split = o.tp, o.pp, o.pp_split, o.dp, o.split
    refuse_native_only(o.dtype, o.plan, o.sequence_parallel, o.moe_split, route)
    check_mesh_flags(tp, pp, pp_split, group, dp, split)
    whole_mesh = mesh = None
    model_group = group
    if (pp or 1) > 1 or tp is not None or (dp or 1) > 1:
        from ..parallel.mesh import make_mesh

        whole_mesh = make_mesh(group, tp, pp, dp)
        model_group = whole_mesh.replica_group or group
        mesh = whole_mesh if whole_mesh.pp > 1 else None
    T = whole_mesh.tp if whole_mesh is not None else group.size()
    weights = stage_weights(split, group, mesh, T)
    tic = time.perf_counter()
    READ.reset()
    mx.reset_peak_memory()
    model = ckpt = error = None
    fingerprint = shapes = None
    try:
        path = local_path(path)
        if is_stage_split(path):  # convert --shards N: this rank's folder, its stages
            path, pp_split, fingerprint, shapes = rank_folder(
                path, T, mesh.pp if mesh else 1, model_group.rank()
            )
        model, ckpt = load_generic(path, model_group, mesh, pp_split, weights, shapes)
        if fingerprint is not None:  # the folders differ by design: the source's
            ckpt.metadata = {**ckpt.metadata, "llama_tp": {"fingerprint": fingerprint}}
        ckpt.mesh = whole_mesh
        ckpt.products = "MLX's kernels (mlx-lm's classes)"
    except Exception as e:
        error = e
    agree_ok(error, group)
    if model.link is not None:
        model.agree_dtypes(f"{route.model_type} ({route.module})")
    ckpt.load_stats = {
        "bytes_read": READ.bytes,
        "bytes_held": ckpt.held_bytes,
        "placement_bytes": ckpt.held_bytes,
        "peak_memory": mx.get_peak_memory(),
        "max_rss": max_rss(),
        "seconds": time.perf_counter() - tic,
    }
    barrier(group)
    return model, ckpt
