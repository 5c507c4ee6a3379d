"""Loading an architecture llama_tp does not implement, on mlx-lm's own classes.

    model, ckpt = load_generic(path, group, mesh, pp_split, weights)

One pass, as the native loader's: read the config and the files' headers (nothing
else); build mlx-lm's `Model` lazily (`classes.py`: its lookup, its `sanitize` on lazy
placeholders to learn the names, its quantization rule); split it: over the tensor group
by the model's `shard()` or the style table (`tensor.py`), into this rank's pipeline stage
(mlx-lm's own `pipeline()` where the model has one and the pipeline is the whole world,
`stages.py` otherwise); then read exactly what this rank holds (`reads.py`), evaluate,
and agree on the stages' dtypes. No rank materializes a weight it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints.base import Checkpoint, CheckpointError
from ..checkpoints.hf import weight_files
from ..cluster.progress import progress
from ..parallel.mesh import Mesh, MeshError, balanced_split, parse_split
from ..parallel.module_swap import module_at
from ..parallel.shares import parse_split as parse_weights
from . import classes
from .model import GenericArgs, GenericModel
from .reads import (
    held,
    mlx_format,
    placeholders,
    read_direct,
    read_sanitized,
    shape_bytes,
    shapes_of,
    stored_tensors,
)
from .stages import StageLink, cross_layer_state, cut_stage
from .structure import Structure, find_structure
from .tensor import shard_model

# Models whose forward reads the token embeddings beyond the first layer (every stage then
# holds the embedding), with the reason.
EMBEDDING_EVERYWHERE: dict[str, str] = {
    "talkie": "every block takes the normed embeddings beside the hidden state",
}
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")


def read_config(path: Path) -> dict:
    """config.json as mlx-lm reads it (its generation_config's eos ids folded in)."""
    from mlx_lm.utils import load_config

    from ..checkpoints.hf import read_config as checked

    checked(path)  # one-line errors for a missing or damaged file
    return load_config(path)


def _text(config: dict, key: str, default: Any = None) -> Any:
    return config.get(key, (config.get("text_config") or {}).get(key, default))


class Opened:
    """A folder opened for the mlx-lm path: its config, headers and the lazy model."""

    def __init__(self, path: Path, shapes: dict | None = None):
        """`shapes`: every tensor of the whole checkpoint (name -> (shape, dtype)) when the
        folder holds only a part of it (`convert.py`'s stage folders); default: its own."""
        self.path = path
        self.config = read_config(path)
        self.route = classes.route(self.config, str(path / "config.json"))
        self.files = weight_files(path)
        self.stored = stored_tensors(self.files)
        self.shapes = {k: (tuple(v[0]), v[1]) for k, v in shapes.items()} if shapes else None
        self.shapes = self.shapes or shapes_of(self.stored)
        self.model = classes.build(self.config, str(path / "config.json"))
        ph = placeholders(self.shapes)
        sanitize = getattr(self.model, "sanitize", None)
        self.names = sanitize(dict(ph)) if sanitize else ph  # the model's names, lazily
        quantization = classes.quantization_of(self.config, str(path / "config.json"))
        if quantization is not None:
            classes.quantize(self.model, quantization, self.names)
        self.direct = mlx_format(self.files) and all(
            k in ph and tuple(ph[k].shape) == tuple(v.shape) for k, v in self.names.items()
        )
        self.partial = shapes is not None
        self.structure = find_structure(self.model, _text(self.config, "vocab_size"))
        self.dim = self._width()  # before a stage drops the embedding's weight

    def _width(self) -> int:
        """The hidden state's width: the config's `hidden_size`, else the token embedding's
        (an architecture's own name for it, d_model or n_embd, is not read)."""
        emb = module_at(self.model, self.structure.embedding) if self.structure.embedding else None
        if isinstance(emb, nn.QuantizedEmbedding):
            return emb.dims
        return _text(self.config, "hidden_size") or (emb.weight.shape[1] if emb is not None else 0)

    def layer_bytes(self) -> tuple[list[int], int, int]:
        """Stored bytes per layer, of the embedding, and of the head (tied: the embedding)."""
        s = self.structure
        pattern = s.stored_layer_pattern()
        per = [0] * s.n_layers
        emb = head = 0
        emb_key = f".{s.embedding.rsplit('.', 1)[-1]}." if s.embedding else None
        head_key = f".{s.head.rsplit('.', 1)[-1]}." if s.head else None
        for name, (shape, dtype) in self.shapes.items():
            nbytes = shape_bytes(shape, dtype)
            m = pattern.search(name)
            if m and int(m.group(1)) < s.n_layers:
                per[int(m.group(1))] += nbytes
            elif emb_key and emb_key in f".{name}":
                emb += nbytes
            elif head_key and head_key in f".{name}":
                head += nbytes
        return per, emb, head if s.head else emb

    def args(self) -> GenericArgs:
        """What the engine reads of the config (`ModelArgs`' names)."""
        context = next((v for k in _CONTEXT_KEYS if isinstance(v := _text(self.config, k), int)),
                       1 << 20)  # fmt: skip
        return GenericArgs(
            model_type=self.route.model_type,
            dim=int(self.dim),
            n_layers=self.structure.n_layers,
            vocab_size=self.structure.vocab_size,
            max_position_embeddings=context,
            tie_word_embeddings=self.structure.head is None,
            config=self.config,
        )


def stage_ranges(
    opened: Opened, pp: int, pp_split: str | None, weights: tuple[float, ...] | None
) -> list[range]:
    """Each stage's layers: `--pp-split` counts, or balanced by stored bytes (the first stage
    also holds the embedding, the last the head), weighted by `--pp-split W:W` or `weights`."""
    n = opened.structure.n_layers
    if pp_split and ":" not in pp_split:
        return parse_split(pp_split, n, pp)
    if pp_split:
        weights = parse_weights(pp_split, pp, "--pp-split")
    if pp == 1:
        return [range(n)]
    if pp > n:
        raise MeshError(f"--pp {pp} stages, but the model has only {n} layers")
    per, emb, head = opened.layer_bytes()
    return balanced_split(per, emb, head, pp, weights)


def _out_width(module: nn.Module, stored: dict, prefix: str, vocab: int) -> tuple[int, mx.Dtype]:
    """(width, dtype) of an embedding's (or head's) output, from the stored tensors."""
    from ..checkpoints.safetensors import DTYPES

    key = f"{prefix}.scales" if f"{prefix}.scales" in stored else f"{prefix}.weight"
    dtype = DTYPES[stored[key][1].dtype][1] if key in stored else mx.float32
    if isinstance(module, nn.Embedding):
        return module.weight.shape[1], dtype
    if isinstance(module, nn.QuantizedEmbedding):
        return module.dims, dtype
    return vocab, dtype


@dataclass
class Placed:
    """One rank's part of a model, split but not read: `model` cut and sharded in place."""

    model: nn.Module
    stages: list[range]  # each stage's layers, in stage order
    layers: range  # this rank's
    splits: dict  # parameter name -> reads.Split (tensor-parallel parts)
    how: str | None  # what split it by tensor ("mlx-lm's shard()", "the style table")
    link: StageLink | None  # the stage hand-offs (generic stages)
    by_mlx_lm: bool  # mlx-lm's own pipeline() does the hand-offs
    notes: list[str] = field(default_factory=list)


def split_rank(
    opened: Opened,
    tp: int,
    pp: int,
    stage: int,
    tp_group: Any,
    pp_group: Any,
    pp_split: str | None = None,
    stage_weights: tuple[float, ...] | None = None,
    pp_is_world: bool = False,
) -> Placed:
    """Cut and shard `opened.model` into the part stage `stage` (of `pp`) holds, over its tensor
    group `tp_group` (`tp` ranks). No weight is read; the groups are only asked their size
    and rank here, so `plan` passes stand-ins. mlx-lm's own `pipeline()` takes the stages
    when the model has one and the pipeline is the world (`pp_is_world`, tp 1)."""
    model, s, config = opened.model, opened.structure, opened.config
    name = f"{opened.route.model_type} ({opened.route.module})"
    if pp > 1:
        s.require_list(name)
        if (why := cross_layer_state(config)) is not None:
            raise CheckpointError(f"{name} cannot be split into pipeline stages: {why}")
    stages = stage_ranges(opened, pp, pp_split, stage_weights)
    placed = Placed(model, stages, stages[stage], {}, None, None, False)
    if tp > 1:
        placed.splits, placed.how = shard_model(model, s, tp_group, config, name)
        placed.notes.append(f"split by tensor over {tp} ranks by {placed.how}")
    owner = _pipeline_owner(model, s) if pp > 1 and tp == 1 and pp_is_world else None
    if owner is not None:
        counts = [len(r) for r in stages][::-1]  # mlx-lm: rank 0 holds the last layers
        owner.pipeline(pp_group, counts)
        placed.layers = stages[pp - 1 - pp_group.rank()]
        placed.by_mlx_lm = True
        placed.notes.append("pipeline stages by mlx-lm's pipeline()")
    elif pp > 1:
        keep_emb = opened.route.model_type in EMBEDDING_EVERYWHERE
        emb_out = head_out = None
        if s.embedding:
            emb = module_at(model, s.embedding)
            emb_out = _out_width(emb, opened.stored, s.embedding, s.vocab_size)
        if s.head:
            head_out = _out_width(module_at(model, s.head), opened.stored, s.head, s.vocab_size)
        placed.link = StageLink(pp_group, stage, pp)
        cut_stage(model, s, placed.layers, placed.link, emb_out, head_out, keep_emb)
    return placed


def load_generic(
    path: Path,
    group: mx.distributed.Group,
    mesh: Mesh | None,
    pp_split: str | None = None,
    stage_weights: tuple[float, ...] | None = None,
    shapes: dict | None = None,
) -> tuple[GenericModel, Checkpoint]:
    """This rank's part of the mlx-lm model at `path`: over `group` by tensor (the model's
    `shard()` or the style table) when `mesh` is None, else its stage of `mesh` (tensor-
    parallel inside the stage's group). `stage_weights`: the stages' shares of the bytes
    (`--split` on a pipeline). Evaluated; not yet checked across ranks (the engine's
    loader does that)."""
    opened = Opened(Path(path), shapes)
    T, P = (mesh.tp, mesh.pp) if mesh is not None else (group.size(), 1)
    stage = mesh.stage if mesh is not None else 0
    tp_group = (mesh.tp_group if mesh is not None else group) if T > 1 else None
    pp_group = mesh.pp_group if mesh is not None else None
    placed = split_rank(
        opened, T, P, stage, tp_group, pp_group, pp_split, stage_weights,
        pp_is_world=pp_group is group,
    )  # fmt: skip
    model, s = placed.model, opened.structure
    want = held(model)
    total = sum(v.nbytes for v in want.values())
    with progress(desc=f"loading {opened.path.name}", total=total, unit="B", unit_scale=True,
                  delay=1.0) as bar:  # fmt: skip
        sanitize = getattr(model, "sanitize", None) or (lambda w: w)
        if opened.direct:
            items = read_direct(
                opened.stored, want, placed.splits, sanitize, bar.update, opened.shapes
            )
        else:
            placed.notes.append("read whole and sanitized (not an mlx_lm.convert folder)")
            items = read_sanitized(
                opened.stored, want, placed.splits, s, placed.layers, sanitize, bar.update,
                opened.shapes,
            )  # fmt: skip
    model.load_weights(items, strict=False)
    held_bytes = sum(v.nbytes for _, v in items)
    del items
    mx.eval(model.parameters())
    generic = GenericModel(model, opened.args(), s, placed.layers if P > 1 else range(s.n_layers))
    object.__setattr__(generic, "mesh", mesh)
    if mesh is not None:  # each stage's layers, as the native loader records them
        mesh.layers = list(placed.stages)
    object.__setattr__(generic, "link", placed.link)
    object.__setattr__(generic, "pipelined_by_mlx_lm", placed.by_mlx_lm)
    object.__setattr__(generic, "split_by", placed.how)
    ckpt = Checkpoint(opened.path, "hf", generic.args, {}, opened.config, opened.files)
    ckpt.notes += placed.notes
    ckpt.route = opened.route
    ckpt.held_bytes = held_bytes
    ckpt.stages = placed.stages
    return generic, ckpt


def _pipeline_owner(model: nn.Module, s: Structure) -> nn.Module | None:
    """The module holding the layers list when it has mlx-lm's `pipeline(group, split)`
    (PipelineMixin; kimi_k3's own takes no split, so the stages here could not be asked)."""
    import inspect

    if s.layers is None:
        return None
    parent = s.layers.rpartition(".")[0]
    owner = module_at(model, parent) if parent else model
    fn = getattr(owner, "pipeline", None)
    if not callable(fn) or "split" not in inspect.signature(fn).parameters:
        return None
    return owner


def local_path(path: str | Path) -> Path:
    """`path`, or the local folder of a Hugging Face hub repo id (fetched as mlx-lm does)."""
    from ..checkpoints import _REPO_ID, _download

    p = Path(path)
    return _download(str(path)) if not p.exists() and _REPO_ID.match(str(path)) else p


def checkpoint_route(path: str | Path) -> classes.Route | None:
    """The route of a Hugging Face / MLX folder, or of one split by stage (`convert.py`);
    None: not such a folder (a GGUF file, a native pre-split one)."""
    p = local_path(path)
    if (p / "stages.json").is_file():  # generic/convert.py's split: its ranks' config
        p = p / "rank-0"
    if not (p.is_dir() and (p / "config.json").is_file()):
        return None
    from ..checkpoints.hf import read_config as checked

    return classes.route(checked(p), str(p / "config.json"))


__all__ = ["load_generic", "checkpoint_route", "Opened", "stage_ranges", "CheckpointError"]
