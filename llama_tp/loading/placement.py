"""The placement one load makes: from a checkpoint's config and stored shapes, the
running mesh and the flags (`--pp-split`, `--moe-split`, `--split`'s weights), through
`parallel.placement.place`; a pre-split folder says its own mesh, split and vocabulary,
checked against the running ones (`checkpoints.split`).
"""

from __future__ import annotations

from ..checkpoints.base import Checkpoint
from ..checkpoints.slices import model_shape
from ..checkpoints.split import check_mesh, check_split, split_vocab_parallel
from ..parallel.mesh import Mesh
from ..parallel.placement import Placement, place
from ..parallel.shares import SplitSpec, Weights


def checkpoint_placement(
    ckpt: Checkpoint,
    n: int,
    mesh: Mesh | None,
    pp_split: str | None,
    vocab_parallel: bool,
    moe_split: str,
    split: SplitSpec,
    weights: Weights | None,
) -> Placement:
    """The placement of this copy of the model over `n` tensor-parallel ranks, or over
    the stages of `mesh`: pure, from the config, the stored shapes and the mesh, its
    tensor groups split by `weights` (`split` as given: None, weights or 'memory'). A
    pre-split folder says its own mesh, split, weights and vocabulary (checked against
    the running ones: `split.check_mesh`, `split.check_split`)."""
    T, P = (mesh.tp, mesh.pp) if mesh is not None else (n, 1)
    if ckpt.format == "split":
        stages = mesh.stages if mesh is not None else None
        layers = check_mesh(ckpt, T, P, pp_split, stages)
        pp_split = ",".join(str(len(r)) for r in layers) if layers else None
        vocab_parallel = split_vocab_parallel(ckpt, vocab_parallel, T)
        moe_split = ckpt.metadata.get("moe_split") or moe_split  # as the folder was cut
        weights = check_split(ckpt, split, weights)
    return place(
        model_shape(ckpt),
        T,
        P,
        pp_split,
        vocab_parallel=vocab_parallel,
        moe_split=moe_split,
        stages=_replica_stages(mesh),
        split=weights,
    )


def _replica_stages(mesh: Mesh | None) -> list[list[int]] | None:
    """The mesh's stages as ranks of its replica (with --dp a replica's stages name world
    ranks 2, 3, ...): every replica then places, and agrees on, the same plan."""
    if mesh is None or not mesh.replicas:
        return None if mesh is None else mesh.stages
    members = mesh.replicas[mesh.replica]
    return [[members.index(r) for r in ranks] for ranks in mesh.stages]
