"""Pipeline stages: one stage's layers, tensor-parallel inside its group.

Stage s of P holds the contiguous layers `mesh.layers[s]`; stage 0 also holds the
embedding, the last stage the final norm and the head (tied or not;
vocabulary-parallel inside its tensor group when that has more than one rank).
A forward pass on every rank of stage s:

    s == 0:  tokens (B, L) -> embedding -> own layers -> send h (B, L, dim) to s + 1
    s > 0:   recv h (B, L, dim) from s - 1 -> own layers -> send to s + 1 (if not last)
    last:    norm(h[:, -1:]) -> head -> logits (B, 1, V_local)

and then one all-reduce of those logits over the pipeline group (the other stages
add zeros), so every rank returns the same last-position logits (B, 1, V_local) and
runs the unchanged samplers: every rank picks the same next token. The sends are
evaluated inside the call (a stage's cache update would not wait for them), so
decoding one sequence is sequential across stages: each token passes stage 0, then
stage 1, ..., while the others wait (the server's batches share those passes).
A prompt is prefilled in micro-batches (`micro_batches`: up to 2P of them, each at
least MIN_MICRO positions): stage s works on micro-batch i + 1 while stage s + 1 works
on micro-batch i, and the keys and values of earlier micro-batches are in the cache
by the time a later one attends to them, so the result is the same as one pass.

Each rank builds only its stage (the other layers stay unread, lazy placeholders)
and reads only its stage's slices of a safetensors checkpoint, or its folder of one
pre-split for the mesh (`convert --shards N --tp T --pp P`, `engine/mesh_split.py`):
folder r holds exactly world rank r's stage, and is refused (`split.check_mesh`) when
made for another mesh, `--pp-split` or placement of the stages.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask

from ..checkpoints.base import Checkpoint, CheckpointError
from ..checkpoints.build import build_model, empty_split_model, load_weights, split_vocab_parallel
from ..checkpoints.split import check_mesh
from ..cluster.distributed import all_gather_object
from ..model import ModelArgs
from ..parallel.layers import shard_linear_range
from ..parallel.mesh import Mesh, balanced_split, parse_split
from ..parallel.partition import Plan, human_bytes, tensor_slice, vocab_ranges
from ..parallel.shard import shard_model
from ..parallel.vocab import VocabParallelEmbedding
from .sampling import VocabShard

FLOATS = ("float32", "float16", "bfloat16")


def _nbytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


class PipelineModel(nn.Module):
    """One stage of the pipeline; called like `Transformer`, returns (B, 1, V[_local])."""

    def __init__(self, args: ModelArgs, mesh: Mesh, layers: list[nn.Module]):
        super().__init__()
        self.args = args
        self.layers = layers
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "first_layer", mesh.layers[mesh.stage].start)
        object.__setattr__(self, "vocab", range(args.vocab_size))  # this rank's logits
        object.__setattr__(self, "in_dtype", None)  # of the hidden state received
        object.__setattr__(self, "logits_dtype", None)

    def _head(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.tok_embeddings.as_linear(h)
        return self.output(h)

    def __call__(
        self,
        tokens: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
        every_position: bool = False,
    ) -> mx.array:
        """tokens (B, L) int -> the last position's logits (B, 1, V_local), on every rank;
        (B, L, V_local) with `every_position` (see `verify_logits`).

        With a cache, a prompt of L >= 2 * MIN_MICRO positions goes through in
        micro-batches (`micro_batches`): each stage sends a micro-batch on as soon as
        its layers are done and starts the next, so the stages work at once."""
        mesh, (B, L) = self.mesh, tokens.shape
        if cache is None:
            cache = [None] * len(self.layers)
        split = cache[0] is not None and not every_position and L >= 2 * MIN_MICRO
        bounds = micro_batches(L, mesh.pp) if split else [(0, L)]
        for a, b in bounds:
            if not mesh.first:
                h = mx.distributed.recv(
                    (B, b - a, self.args.dim), self.in_dtype, mesh.stage - 1, group=mesh.pp_group
                )
            elif input_embeddings is None:
                h = self.tok_embeddings(tokens[:, a:b])
            else:
                h = input_embeddings[:, a:b]
            mask = create_attention_mask(h, cache[0])
            for layer, c in zip(self.layers, cache, strict=True):
                h = layer(h, mask, c)
            if not mesh.last:
                # Evaluated here: the next micro-batch starts only once this one is sent
                # (and a stage's cache update would not wait for a lazy send).
                mx.eval(mx.distributed.send(h, mesh.stage + 1, group=mesh.pp_group))
            elif b < L:
                # The last stage too, one micro-batch at a time: a lazy graph of them
                # all could post the next recv before this one's layers have run.
                mx.eval(h)
        n = L if every_position else 1
        if mesh.last:
            logits = self._head(self.norm(h[:, -n:, :]))
        else:
            logits = mx.zeros((B, n, len(self.vocab)), self.logits_dtype)
        return mx.distributed.all_sum(logits, group=mesh.pp_group)

    def vocab_shard(self) -> VocabShard | None:
        """Where this rank's logits sit in the vocabulary (None: whole), for the samplers."""
        if len(self.vocab) == self.args.vocab_size:
            return None
        emb = self.get("tok_embeddings")
        emb = emb if isinstance(emb, VocabParallelEmbedding) else None
        v = self.vocab
        return VocabShard(v.start, v.stop, self.args.vocab_size, self.mesh.tp_group, emb)

    def out_dtype(self, dtype: mx.Dtype) -> mx.Dtype:
        """The dtype this stage hands on (h, or the logits on the last) for input `dtype`.
        Traced lazily: nothing is evaluated, no collective runs."""
        h = mx.zeros((1, 1, self.args.dim), dtype)
        for layer in self.layers:
            h = layer(h)
        return self._head(self.norm(h)).dtype if self.mesh.last else h.dtype

    def agree_dtypes(self) -> None:
        """Learn the dtypes of the received hidden state and of the logits (collective
        on the pipeline group: one small all-gather). Call after any cast."""
        table = {n: str(self.out_dtype(getattr(mx, n))).split(".")[-1] for n in FLOATS}
        start = None
        if self.mesh.first:
            start = str(self.tok_embeddings(mx.zeros((1, 1), mx.int32)).dtype).split(".")[-1]
        stages = all_gather_object((start, table), self.mesh.pp_group)
        dtype = stages[0][0]
        for s, (_, t) in enumerate(stages):
            if s == self.mesh.stage:
                object.__setattr__(self, "in_dtype", getattr(mx, dtype))
            dtype = t[dtype]
        object.__setattr__(self, "logits_dtype", getattr(mx, dtype))


def verify_logits(model: nn.Module, x: mx.array, cache: list[Any]) -> mx.array:
    """`model(x, cache=cache)` with every position's logits (B, L, V[_local]), as speculative
    verification needs (a pipeline stage returns only the last position's otherwise)."""
    if isinstance(model, PipelineModel):
        return model(x, cache=cache, every_position=True)
    return model(x, cache=cache)


MIN_MICRO = 32  # positions: smaller micro-batches cost more in overhead than they overlap


def micro_batches(length: int, stages: int) -> list[tuple[int, int]]:
    """[start, stop) of each micro-batch of a `length`-position prompt on `stages` stages:
    2 * stages of them (at most; each >= MIN_MICRO positions), so that the P - 1 steps
    of filling and draining the pipeline are a small part of the whole. One when the
    prompt is short (decoding: length 1). `LLAMA_TP_PP_MICRO_BATCHES=N` caps the count
    (1: the whole prompt at once, for comparison)."""
    most = int(os.environ.get("LLAMA_TP_PP_MICRO_BATCHES", 2 * stages))  # 1: one piece
    n = max(1, min(most, length // MIN_MICRO))
    size = -(-length // n)
    return [(a, min(a + size, length)) for a in range(0, length, size)]


def stage_ranges(full: nn.Module, pp: int, pp_split: str | None) -> list[range]:
    """Each stage's layers: `--pp-split`, or balanced by parameter bytes."""
    args = full.args
    if pp_split:
        return parse_split(pp_split, args.n_layers, pp)
    emb = _nbytes(full.tok_embeddings)
    head = _nbytes(full.norm) + (emb if args.tie_word_embeddings else _nbytes(full.output))
    return balanced_split([_nbytes(layer) for layer in full.layers], emb, head, pp)


def describe_stages(model: PipelineModel, group: mx.distributed.Group) -> list[str]:
    """One line per stage, from what each rank of `group` (the world) actually holds:
    its ranks, its layers, the embedding / norm / head, and each rank's parameter bytes.
    Collective: one all_gather_object; every rank calls it, rank 0 prints it."""
    mesh = model.mesh
    extras = [k for k in ("tok_embeddings", "norm", "output") if k in model]
    if "tok_embeddings" in extras and not mesh.first:
        extras[extras.index("tok_embeddings")] = "head (tied)"
    names = {"tok_embeddings": "embedding", "output": "head"}
    mine = (mesh.stage, model.first_layer, len(model.layers), extras, _nbytes(model))
    ranks = all_gather_object(mine, group)
    lines = []
    for s in range(mesh.pp):
        members = [(r, x) for r, x in enumerate(ranks) if x[0] == s]
        _, first, count, held, _ = members[0][1]
        who = f"rank{'s' * (len(members) > 1)} {', '.join(str(r) for r, _ in members)}"
        what = " + " + ", ".join(names.get(k, k) for k in held) if held else ""
        sizes = ", ".join(f"rank {r} {human_bytes(x[4])}" for r, x in members)
        lines.append(
            f"stage {s}: {who}: layers {first}-{first + count - 1}{what} (weights: {sizes})"
        )
    return lines


def stage_module(full: nn.Module, mesh: Mesh) -> PipelineModel:
    """Stage `mesh.stage` of the (lazily built, unsharded) `full` model: its layers, and
    the embedding (first stage; the last too when tied), norm and head (last stage).
    Pure: no collective, nothing read; `mesh.layers` must be set."""
    mine = mesh.layers[mesh.stage]
    model = PipelineModel(full.args, mesh, full.layers[mine.start : mine.stop])
    tied = full.args.tie_word_embeddings
    if mesh.first or (mesh.last and tied):
        model.tok_embeddings = full.tok_embeddings
    if mesh.last:
        model.norm = full.norm
        if not tied:
            model.output = full.output
    # As the tensor-parallel loader: split the feed-forward on the file's own blocks
    model.ffn_block = getattr(full, "ffn_block", None)
    return model


def shard_stage(
    full: nn.Module, mesh: Mesh, vocab_parallel: bool
) -> tuple[PipelineModel, Plan | None, range | None]:
    """Stage `mesh.stage` of `full` (lazy), sharded over its tensor group by the built-in
    plan, the embedding and head vocabulary-parallel there with `vocab_parallel`:
    (the stage, its partition plan, this rank's vocabulary rows), both None with one
    rank per stage. Nothing is read; `mesh.layers` must be set."""
    model = stage_module(full, mesh)
    plan, vocab = None, None
    if mesh.tp > 1:
        plan = shard_model(model, mesh.tp_group)
        if vocab_parallel:
            vocab = vocab_ranges(full.args.vocab_size, mesh.tp)[mesh.tp_rank]
            object.__setattr__(model, "vocab", vocab)
            if "tok_embeddings" in model:
                model.tok_embeddings = VocabParallelEmbedding(
                    model.tok_embeddings, vocab.start, vocab.stop, mesh.tp_group
                )
            if "output" in model:
                model.output = shard_linear_range(
                    model.output, "all-to-sharded", vocab.start, vocab.stop, mesh.tp_group
                )
    return model, plan, vocab


def build_stage(
    ckpt: Checkpoint, mesh: Mesh, pp_split: str | None, vocab_parallel: bool
) -> PipelineModel:
    """This rank's stage of the checkpoint: its layers, sharded over its tensor group,
    with only its slices read (lazily built; the caller evaluates). A folder pre-split
    for this mesh holds exactly that (`_build_split_stage`)."""
    if ckpt.format == "split":
        return _build_split_stage(ckpt, mesh, pp_split, vocab_parallel)
    full = build_model(ckpt, whole=False)  # lazy: only what the stage keeps is ever read
    mesh.layers = stage_ranges(full, mesh.pp, pp_split)
    model, plan, vocab = shard_stage(full, mesh, vocab_parallel)
    if ckpt.sources:
        _read_stage_slices(model, ckpt, plan, mesh.tp_rank, vocab)
    return model


def _build_split_stage(
    ckpt: Checkpoint, mesh: Mesh, pp_split: str | None, vocab_parallel: bool
) -> PipelineModel:
    """The stage from this rank's folder of a checkpoint pre-split for the mesh
    (`convert --shards N --tp T --pp P`): the folder's stages (checked against the
    running mesh and `pp_split`), an empty stage sharded the same way, the stored
    slices put in. A folder holding any other tensor is refused."""
    mesh.layers = check_mesh(ckpt, mesh.tp, mesh.pp, pp_split, mesh.stages)
    vocab_parallel = split_vocab_parallel(ckpt, vocab_parallel, mesh.tp)
    model, _, _ = shard_stage(empty_split_model(ckpt), mesh, vocab_parallel)
    names = {global_name(k, model.first_layer): k for k, _ in tree_flatten(model.parameters())}
    for what, extra in (
        ("missing", set(names) - set(ckpt.weights)),
        ("holds", set(ckpt.weights) - set(names)),
    ):
        if extra:
            mine = mesh.layers[mesh.stage]
            raise CheckpointError(
                f"{ckpt.path}: {what} {sorted(extra)[0]} (stage {mesh.stage}: layers "
                f"{mine.start}-{mine.stop - 1}); convert the checkpoint again"
            )
    load_weights(model, ckpt, [(local, ckpt.weights[name]) for name, local in names.items()])
    return model


def global_name(name: str, first_layer: int) -> str:
    """'layers.0.attention.wq.weight' of a stage starting at layer 10 -> 'layers.10....'."""
    if not name.startswith("layers."):
        return name
    _, i, rest = name.split(".", 2)
    return f"layers.{int(i) + first_layer}.{rest}"


def _read_stage_slices(
    model: PipelineModel, ckpt: Checkpoint, plan: Plan | None, rank: int, vocab: range | None
) -> None:
    """Replace every lazy parameter by exactly the bytes this rank keeps (as the loader's
    `_read_own_slices`, with the stage's layer numbers mapped to the checkpoint's)."""
    weights = []
    for name, _ in tree_flatten(model.parameters()):
        file, stored = ckpt.sources[global_name(name, model.first_layer)]
        shape = file.tensors[stored].shape
        s = None if plan is None else tensor_slice(plan, plan.parts[rank], name, shape, vocab)
        weights.append((name, file.read(stored) if s is None else file.read(stored, *s)))
    load_weights(model, ckpt, weights)
