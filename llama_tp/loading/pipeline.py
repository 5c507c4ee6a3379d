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
runs the unchanged samplers: every rank picks the same next token. `hidden` shares the
last stage's final-normed hidden states (B, L, dim) the same way (embeddings). The sends are
evaluated inside the call (a stage's cache update would not wait for them), so
decoding one sequence is sequential across stages: each token passes stage 0, then
stage 1, ..., while the others wait (the server's batches share those passes).
A prompt is prefilled in micro-batches (`micro_batches`: up to 2P of them, each at
least MIN_MICRO positions): stage s works on micro-batch i + 1 while stage s + 1 works
on micro-batch i, and the keys and values of earlier micro-batches are in the cache
by the time a later one attends to them, so the result is the same as one pass.

Each rank reads only its stage's slices (its placement, `parallel/placement.py`: the
stage split balanced by bytes or `--pp-split`, the layers' partition over the stage's
tensor group), or its folder of a checkpoint pre-split for the mesh (`convert --shards
N --tp T --pp P`, `loading/mesh_split.py`), and the loader (`loading/loader.py`) cuts its
stage out of the lazily built model (`stage_module`) and shards it.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..cluster.distributed import all_gather_object
from ..model import Transformer, run_layers
from ..model_args import ModelArgs
from ..models.caches import layer_caches
from ..parallel.mesh import Mesh
from ..parallel.plan_text import human_bytes
from ..parallel.vocab import VocabParallelEmbedding
from ..parallel.vocab_shards import VocabShard

FLOATS = ("float32", "float16", "bfloat16")


def _nbytes(module: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


class PipelineModel(nn.Module):
    """One stage of the pipeline; called like `Transformer`, returns (B, 1, V[_local])."""

    def __init__(
        self,
        args: ModelArgs,
        mesh: Mesh,
        layers: list[nn.Module],
        family: type[Transformer] = Transformer,
    ):
        """`family`: the whole model's class, whose `embed`, `side_inputs`, hand-off
        (`hand_off`, `take_over`), `finish` and `head` the stage runs on what it holds
        (Gemma scales its embeddings, caps its logits and hands its per-layer inputs on
        beside h: `side_width` values per position; Kimi K3 hands on its attention
        residuals' block states, more for a later stage, and mixes them into the last
        layer's output)."""
        super().__init__()
        self.args = args
        self.layers = layers
        object.__setattr__(self, "family", family)
        object.__setattr__(self, "side_width", 0)  # the whole model's (`stage_module`)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "first_layer", mesh.layers[mesh.stage].start)
        object.__setattr__(self, "vocab", range(args.vocab_size))  # this rank's logits
        object.__setattr__(self, "in_dtype", None)  # of the hidden state received
        object.__setattr__(self, "logits_dtype", None)

    def make_cache(self) -> list[Any]:
        """One cache per caching layer of the stage (`layer_caches`: sliding-window ones
        bounded, none for a KV-shared layer)."""
        return layer_caches(self.layers)

    def _head(self, h: mx.array) -> mx.array:
        return self.family.head(self, h)

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
        split = cache is not None and not every_position and L >= 2 * MIN_MICRO
        bounds = micro_batches(L, mesh.pp) if split else [(0, L)]
        h, side = self._run_stage(tokens, cache, input_embeddings, bounds)
        n = L if every_position else 1
        if mesh.last:
            h = self.family.finish(self, h, side)
            logits = self._head(self.norm(h[:, -n:, :]))
        else:
            logits = mx.zeros((B, n, len(self.vocab)), self.logits_dtype)
        return mx.distributed.all_sum(logits, group=mesh.pp_group)

    def hidden(self, tokens: mx.array, cache: list[Any] | None = None) -> mx.array:
        """tokens (B, L) -> the final-normed hidden state (B, L, dim) in float32, on every
        rank: the last stage's, shared over the pipeline group by one all-sum (the other
        stages add zeros), as the logits are. One pass (no micro-batches)."""
        mesh, (B, L) = self.mesh, tokens.shape
        h, side = self._run_stage(tokens, cache, None, [(0, L)])
        if mesh.last:
            out = self.norm(self.family.finish(self, h, side)).astype(mx.float32)
        else:
            out = mx.zeros((B, L, self.args.dim), mx.float32)
        return mx.distributed.all_sum(out, group=mesh.pp_group)

    def _run_stage(
        self,
        tokens: mx.array,
        cache: list[Any] | None,
        input_embeddings: mx.array | None,
        bounds: list[tuple[int, int]],
    ) -> tuple[mx.array, Any]:
        """This stage's layers on each micro-batch [a, b) of `bounds` in turn (received from
        the stage before, or embedded; sent on unless last): the last micro-batch's h
        (B, b - a, dim) and side input."""
        mesh, (B, L) = self.mesh, tokens.shape
        family, side = self.family, None
        width = self.args.dim + family.hand_off_width(self, self.first_layer)
        for a, b in bounds:
            if not mesh.first:
                h = mx.distributed.recv(
                    (B, b - a, width), self.in_dtype, mesh.stage - 1, group=mesh.pp_group
                )
                # the side inputs handed on beside h (Gemma's per-layer inputs, Kimi K3's
                # block states)
                h, side = family.take_over(self, h)
            else:
                rows = None if input_embeddings is None else input_embeddings[:, a:b]
                h = self.family.embed(self, tokens[:, a:b], rows)
                side = self.family.side_inputs(self, tokens[:, a:b], h)
            h = run_layers(self.layers, h, cache, side)
            if not mesh.last:
                out = family.hand_off(self, h, side)
                # Evaluated here: the next micro-batch starts only once this one is sent
                # (and a stage's cache update would not wait for a lazy send).
                mx.eval(mx.distributed.send(out, mesh.stage + 1, group=mesh.pp_group))
            elif b < L:
                # The last stage too, one micro-batch at a time: a lazy graph of them
                # all could post the next recv before this one's layers have run.
                mx.eval(h)
        return h, side

    def vocab_shard(self) -> VocabShard | None:
        """Where this rank's logits sit in the vocabulary (None: whole), for the samplers."""
        if len(self.vocab) == self.args.vocab_size:
            return None
        emb = self.get("tok_embeddings")
        emb = emb if isinstance(emb, VocabParallelEmbedding) else None
        v = self.vocab
        rows = getattr(self, "vocab_ranges", None)
        return VocabShard(v.start, v.stop, self.args.vocab_size, self.mesh.tp_group, emb, rows)

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
    if isinstance(model, PipelineModel) or getattr(model, "link", None) is not None:
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


def describe_stages(model: PipelineModel, group: mx.distributed.Group) -> list[str]:
    """One line per stage, from what each rank of `group` (the world) actually holds:
    its ranks, its layers, the embedding / norm / head, and each rank's parameter bytes.
    Collective: one all_gather_object; every rank calls it, rank 0 prints it."""
    if hasattr(model, "describe_stages"):  # mlx-lm's classes (generic/model.py)
        return model.describe_stages(group)
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
    model = PipelineModel(full.args, mesh, full.layers[mine.start : mine.stop], type(full))
    object.__setattr__(model, "side_width", full.side_width)
    tied = full.args.tie_word_embeddings
    if mesh.first or (mesh.last and tied):
        model.tok_embeddings = full.tok_embeddings
    if mesh.first:  # what the family embeds beside the tokens (Gemma's per-layer inputs)
        for name in getattr(full, "embedding_modules", ()):
            if name in full:  # a family's optional parts (Gemma 3 has no per-layer inputs)
                setattr(model, name, full[name])
    if mesh.last:
        for name in getattr(full, "head_modules", ()):  # what `finish` uses (Kimi K3's)
            if name in full:
                setattr(model, name, full[name])
        model.norm = full.norm
        if not tied:
            model.output = full.output
    # As the tensor-parallel loader: split the feed-forward on the file's own blocks
    model.ffn_block = getattr(full, "ffn_block", None)
    return model


def global_name(name: str, first_layer: int) -> str:
    """'layers.0.attention.wq.weight' of a stage starting at layer 10 -> 'layers.10....'."""
    if not name.startswith("layers."):
        return name
    _, i, rest = name.split(".", 2)
    return f"layers.{int(i) + first_layer}.{rest}"


def local_name(name: str, first_layer: int) -> str:
    """'layers.10.attention.wq.weight' of a stage starting at layer 10 -> 'layers.0....'."""
    return global_name(name, -first_layer)
