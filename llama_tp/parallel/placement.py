"""The placement: what every rank of a model holds, as one pure value.

    shape = ModelShape(args, tensors, ffn_block)   # the config and the stored tensors' shapes
    placement = place(shape, tp=2, pp=2)            # 4 ranks: 2 stages of 2
    mine = placement.at(stage, tp_rank)
    mine.layers, mine.part.q_heads, mine.part.experts, mine.vocab
    mine.slices["layers.3.attention.wq.weight"]     # (axis, start, stop) stored; None: whole
    mine.nbytes                                     # what it reads and holds

Computed once, from the checkpoint's config and tensor shapes (nothing read) and the
mesh: the stage split of the layers (balanced by bytes, or `--pp-split`), the
partition of each layer over a stage's tensor group (`partition.make_plan`: heads,
feed-forward columns, experts or expert columns, on quantization groups and the
file's blocks), and the vocabulary rows. The loader reads exactly `mine.slices`
(`checkpoints/`), shards the model by the same partition (`llama_plan`), and
`python -m llama_tp.plan` prints this value, so what `plan` shows is what each rank
loads. Pure: no collective, no mlx array.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .mesh import MeshError, balanced_split, parse_split
from .partition import (
    NOT_HELD,
    Experts,
    Plan,
    RankPart,
    held_bytes,
    make_plan,
    tensor_slice,
    vocab_ranges,
)
from .shares import Weights
from .shares import parse_split as parse_weights
from .splits import LayerSpec, Segmented, Slice, Unit, cache_bytes, llama_layer

__all__ = ["ModelShape", "Placement", "RankPlacement", "Segmented", "Slice", "place"]
__all__ += ["kv_cache_bytes", "partition", "stage_layers", "state_bytes"]
DEFAULT_MOE_SPLIT = "tensor"  # measured faster on 2 ranks: docs/mixture-of-experts.md
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class ModelShape:
    """What a placement needs to know of a checkpoint: its `args` (a `ModelArgs`, read
    by attribute), every stored tensor as name -> (shape, nbytes) by the model's names
    (quantized: packed weight, scales, biases), the file's quantization block along
    the feed-forward split axis (`ffn_block`, GGUF K-quants: 256) and each layer's kinds
    (`layers`: their split tables and cache, `splits.LayerSpec`, from the model's
    registry; None: Llama layers)."""

    args: Any
    tensors: Mapping[str, tuple[tuple[int, ...], int]]
    ffn_block: int | None = None
    layers: tuple[LayerSpec, ...] | None = field(default=None, repr=False)

    def spec(self, layer: int) -> LayerSpec:
        """Layer `layer`'s kinds: split tables and cache."""
        return llama_layer(self.args.head_dim) if self.layers is None else self.layers[layer]

    def units(self) -> tuple[Unit, ...]:
        """The units the layers' kinds declare beyond the core ones, once each."""
        found: dict[str, Unit] = {}
        for spec in self.layers or ():
            for table in spec.tables.values():
                for u in table.units:
                    found.setdefault(u.name, u)
        return tuple(found.values())

    def group_size(
        self, suffix: str | tuple[str, ...], in_dims: int, layers: set[int] | None = None
    ) -> int | None:
        """The quantization group of the modules `layers.*.{suffix}` (any of several
        suffixes: the kinds' names for one unit; the lcm over layers, or over `layers`
        only, so that a split in its units falls on every layer's groups); None: not
        quantized."""
        ends = tuple(f".{s}.scales" for s in ((suffix,) if isinstance(suffix, str) else suffix))
        sizes = {
            in_dims // shape[-1]
            for name, (shape, _) in self.tensors.items()
            if name.endswith(ends)
            and (m := _LAYER.match(name))
            and (layers is None or int(m.group(1)) in layers)
        }
        return math.lcm(*sizes) if sizes else None

    def layer_bytes(self) -> list[int]:
        out = [0] * self.args.n_layers
        for name, (_, nb) in self.tensors.items():
            if m := _LAYER.match(name):
                out[int(m.group(1))] += nb
        return out

    def bytes_under(self, *prefixes: str) -> int:
        return sum(nb for name, (_, nb) in self.tensors.items() if name.startswith(prefixes))


@dataclass(frozen=True)
class RankPlacement:
    """What one rank holds: its stage and layers, its part of every layer (None: a
    user's style plan), its vocabulary rows (None: whole), the slice of every tensor it
    holds (global names; None: the whole tensor) and their bytes."""

    rank: int  # in rank order of one replica (stage * tp + tp_rank, unless `stages` say)
    stage: int
    tp_rank: int
    layers: range
    part: RankPart | None
    vocab: range | None
    slices: dict[str, Slice | Segmented | None] = field(repr=False)
    nbytes: int


@dataclass(frozen=True)
class Placement:
    """Every rank of one model copy (a replica): `tp` x `pp` ranks."""

    tp: int
    pp: int
    layers: tuple[range, ...]  # each stage's layers
    stages: tuple[tuple[int, ...], ...]  # the ranks of each stage, in tensor-rank order
    plan: Plan  # each layer's partition over a stage's tensor group
    vocab_parallel: bool  # embedding and head split by vocabulary rows (tp > 1)
    ranks: tuple[RankPlacement, ...]  # by rank

    def at(self, stage: int, tp_rank: int) -> RankPlacement:
        # by the rank's number: with --dp a replica's stages name world ranks (2, 3, ...)
        rank = self.stages[stage][tp_rank]
        return next(r for r in self.ranks if r.rank == rank)

    @property
    def moe_split(self) -> str | None:
        return self.plan.experts.split if self.plan.experts else None


def _itemsize(shape: ModelShape) -> int:
    """Bytes per activation value (and cache entry): the wider of the embedding's float
    dtype (its scales' when quantized) and the first layer norm's (MLX promotes)."""
    t = shape.tensors
    names = ["tok_embeddings.scales" if "tok_embeddings.scales" in t else "tok_embeddings.weight"]
    names += ["layers.0.attention_norm.weight", "layers.0.norm.weight"]  # (a MixerBlock's)
    return max(t[n][1] // math.prod(t[n][0]) for n in names if n in t)


def kv_cache_bytes(shape: ModelShape, mine: RankPlacement, tokens: int = 1000) -> int:
    """What rank `mine`'s caches hold for `tokens` tokens: per layer it holds, what its
    kind's cache declares (`splits.CacheSpec`): the keys and values of its KV heads; with
    multi-head latent attention, the whole latent and RoPE key (kv_lora_rank +
    qk_rope_head_dim values per token), as one process does; a sliding-window layer
    (gpt-oss) the last `sliding_window` tokens at most (its RotatingKVCache, between
    steps); a recurrent layer its fixed state, whatever the length (its float32 part at
    4 bytes a value)."""
    # a user's style plan (no part): the caches of one process, every unit whole
    part = mine.part if mine.part is not None else partition(shape, 1).parts[0]

    def units(name: str) -> tuple[range, int] | None:
        r = part.unit(name)
        return None if r is None else (r, 0)  # (the counts are all a cache needs)

    held, itemsize = 0, _itemsize(shape)
    for i in mine.layers:
        spec = shape.spec(i).cache
        if spec is not None:
            held += cache_bytes(spec, units, tokens, itemsize)
    return held


def state_bytes(shape: ModelShape, mine: RankPlacement) -> int:
    """What rank `mine`'s caches hold whatever the length, per sequence: the recurrent
    states (a linear-attention layer's conv and delta-rule state) of the layers it
    holds, for its heads only; 0 for a model of KV caches."""
    return kv_cache_bytes(shape, mine, tokens=0)


def _unit(
    shape: ModelShape,
    suffix: str | tuple[str, ...],
    width: int,
    n: int,
    weights: Weights | None = None,
) -> int | None:
    """The split unit of a feed-forward's columns: the down projection's quantization
    group, widened to the file's own block (`ffn_block`) where the columns still split
    over `n` ranks in such units (under `weights`: every rank's share at least half a
    unit), so that no rank reads a block another also reads."""
    group = shape.group_size(suffix, width)
    block = shape.ffn_block
    if block:  # GGUF blocks as stored have no groups: any split is exact, blocks save memory
        unit = math.lcm(group or 1, block)
        least = min(weights) / sum(weights) if weights else 1 / n
        if width % unit == 0 and width // unit >= n and width // unit * least >= 0.5:
            return unit
    return group


# The down projections whose input columns a plan splits (quantization groups): the
# kinds' names (Nemotron-H's one-mixer layers: `mixer.*`, its experts mlx-lm's SwitchMLP)
_DENSE_DOWN = ("feed_forward.w2", "mixer.down_proj")
_EXPERT_DOWN = ("switch_mlp.down_proj", "switch_mlp.fc2")
_SHARED_DOWN = ("feed_forward.shared_expert.w2", "mixer.shared_experts.down_proj")


def partition(
    shape: ModelShape, n: int, moe_split: str = DEFAULT_MOE_SPLIT, weights: Weights | None = None
) -> Plan:
    """Each layer's partition over `n` ranks, balanced or in proportion to `weights`
    (ValueError, one line, where none exists; SplitError for weights that leave a rank
    nothing)."""
    a = shape.args
    experts = None
    if getattr(a, "n_experts", 0):
        experts = Experts(
            a.n_experts,
            a.moe_hidden_dim,
            moe_split,
            _unit(shape, _EXPERT_DOWN, a.moe_hidden_dim, n, weights),
            a.shared_expert_dim,
            _unit(shape, _SHARED_DOWN, a.shared_expert_dim, n, weights)
            if a.shared_expert_dim
            else None,
        )
    if shape.layers is not None:  # some layer's kind splits a dense feed-forward's columns
        dense = any("ffn" in t.unit_names() for s in shape.layers for t in s.tables.values())
    else:
        dense = any(not a.is_sparse(i) for i in range(a.n_layers)) if experts else True
    plan = make_plan(
        a.n_heads,
        a.n_kv_heads,
        a.head_dim,
        a.dim,
        a.hidden_dim if dense else 0,  # 0: no dense feed-forward to split
        n,
        group_size=_unit(shape, _DENSE_DOWN, a.hidden_dim, n, weights) if dense else None,
        experts=experts,
        weights=weights,
        layers=shape.layers,
        units=shape.units(),
    )
    if n > 1:
        _check_quantized_heads(shape, plan)
    return plan


def _check_quantized_heads(shape: ModelShape, plan: Plan) -> None:
    """A quantized wo splits by columns at query-head boundaries: those must be group bounds
    (each layer's at the bounds of the unit its wo splits by: the core query heads, or a
    kind's own, Step-3.5's sliding layers' `swa_heads`; not a KDA layer's wo, Kimi-Linear,
    which does not split by heads)."""
    totals = {u.name: u.total for u in shape.units()} | {"q_heads": plan.n_heads}
    groups: dict[tuple[str, int], set[int]] = {}  # (unit, values per unit) -> group sizes
    for name, (dims, _) in shape.tensors.items():
        m = _LAYER.match(name)
        if m is None or not name.endswith((".attention.wo.scales", ".mixer.wo.scales")):
            continue
        spec = shape.spec(int(m.group(1)))
        if not _by_heads(spec):
            continue
        table = spec.tables.get("attention", spec.tables.get("mixer"))  # (a one-mixer layer's)
        e = table.tensors.get("wo") if table is not None else None
        unit, width = (e.unit, e.width) if e is not None and e.unit else ("q_heads", plan.head_dim)
        groups.setdefault((unit, width), set()).add(totals[unit] * width // dims[-1])
    for (unit, width), sizes in groups.items():
        group_size = math.lcm(*sizes)
        what = (
            "query heads"
            if unit == "q_heads"
            else next(u.what for u in shape.units() if u.name == unit)
        )
        for p in plan.parts:
            start = (p.q_heads if unit == "q_heads" else p.unit(unit)).start * width
            if start % group_size:
                raise ValueError(
                    f"cannot split {totals[unit]} {what} of {width} quantized columns over "
                    f"{plan.n} ranks: rank {p.rank} would start at column {start}, not a "
                    f"multiple of the group size {group_size}"
                )


def _by_heads(spec: LayerSpec) -> bool:
    table = spec.tables.get("attention", spec.tables.get("mixer"))  # (a one-mixer layer's)
    return table is None or table.module == "heads"


def tied_boundaries(shape: ModelShape) -> dict[int, tuple[int, int]]:
    """Layer boundaries no pipeline stage may start at: b -> (source, layer) of a KV-shared
    layer (Gemma's) whose span from its source (source < b <= layer) b would cut."""
    out: dict[int, tuple[int, int]] = {}
    for j, spec in enumerate(shape.layers or ()):
        c = spec.cache
        if c is not None and c.kind == "shared" and c.source is not None:
            for b in range(c.source + 1, j + 1):
                out.setdefault(b, (c.source, j))
    return out


def stage_layers(shape: ModelShape, pp: int, pp_split: str | None = None) -> list[range]:
    """Each stage's layers: `--pp-split` layer counts (10,12), or balanced by stored bytes
    (the first stage also holds the embedding, the last the norm and the head), or in
    proportion to `--pp-split` weights (3:1: stage 0 about three times stage 1's bytes).
    A KV-shared layer stays on its source's stage (`tied_boundaries`)."""
    n_layers = shape.args.n_layers
    weights = None
    tied = tied_boundaries(shape)
    if pp_split and ":" not in pp_split:
        stages = parse_split(pp_split, n_layers, pp)
        for r in stages[1:]:
            if r.start in tied:
                source, layer = tied[r.start]
                raise MeshError(
                    f"--pp-split {pp_split}: a stage starting at layer {r.start} would part "
                    f"layer {layer} from layer {source}, whose keys and values it attends over"
                )
        return stages
    if pp_split:
        weights = parse_weights(pp_split, pp, "--pp-split")
    if pp == 1:
        return [range(n_layers)]
    emb = shape.bytes_under("tok_embeddings.")
    head = shape.bytes_under("norm.") + (
        emb if shape.args.tie_word_embeddings else shape.bytes_under("output.")
    )
    return balanced_split(shape.layer_bytes(), emb, head, pp, weights, frozenset(tied))


def _on_stage(name: str, stage: int, layers: range, pp: int, tied: bool) -> bool:
    """Whether stage `stage` (of `pp`, holding `layers`) holds tensor `name`."""
    if m := _LAYER.match(name):
        return int(m.group(1)) in layers
    last = stage == pp - 1
    if name.startswith("tok_embeddings."):
        return stage == 0 or (last and tied)
    if name.startswith("per_layer_"):  # Gemma's per-layer inputs: made on the first stage
        return stage == 0
    if name.startswith(("norm.", "output.", "output_attn_res_")):  # (Kimi K3's output mix)
        return last
    return True


def place(
    shape: ModelShape,
    tp: int = 1,
    pp: int = 1,
    pp_split: str | None = None,
    *,
    vocab_parallel: bool = True,
    moe_split: str = DEFAULT_MOE_SPLIT,
    stages: list[list[int]] | None = None,
    split: Weights | None = None,
) -> Placement:
    """The placement of `shape` on `tp` x `pp` ranks (see the module docstring).

    `stages`: the ranks of each stage in tensor-rank order (default: rank order, stage s
    = ranks s*tp .. s*tp + tp - 1). `split`: one weight per tensor rank (`--split 3:1`,
    `shares.parse_split`; None: balanced), every stage's tensor group split alike.
    Raises ValueError (MeshError for the stage split, SplitError for the weights) with
    one line where no placement exists.
    """
    if tp < 1 or pp < 1:
        raise MeshError(f"need at least one rank per stage and one stage, got {tp} x {pp}")
    plan = partition(shape, tp, moe_split, split)
    layers = stage_layers(shape, pp, pp_split)
    stages = stages or [[s * tp + t for t in range(tp)] for s in range(pp)]
    vocab_parallel = vocab_parallel and tp > 1
    vocab = [None] * tp
    if vocab_parallel:
        vocab = vocab_ranges(shape.args.vocab_size, tp, plan.weights)
    tied = shape.args.tie_word_embeddings
    ranks: list[RankPlacement] = []
    for s, members in enumerate(stages):
        names = [n for n in shape.tensors if _on_stage(n, s, layers[s], pp, tied)]
        for t, rank in enumerate(members):
            part = plan.parts[t]
            slices = {}
            for name in names:
                stored = shape.tensors[name][0]
                cut = tensor_slice(plan, part, name, stored, vocab[t]) if tp > 1 else None
                if cut != NOT_HELD:
                    slices[name] = cut
            nbytes = sum(held_bytes(*shape.tensors[k], s) for k, s in slices.items())
            ranks.append(RankPlacement(rank, s, t, layers[s], part, vocab[t], slices, nbytes))
    ranks.sort(key=lambda r: r.rank)
    return Placement(
        tp,
        pp,
        tuple(layers),
        tuple(tuple(m) for m in stages),
        plan,
        vocab_parallel,
        tuple(ranks),
    )
