"""The built-in plan: one table from module paths to parallel styles.

Made from the partition plan (`partition.make_plan`) and each layer's split tables
(`splits.py`, the kinds' declarations: `kind_shard.plan_styles` turns a table into
styles, as the kinds' own `shard` does): where N divides the heads or columns the styles
take no ranges (mlx's `shard_linear`, the design's even split), elsewhere each rank's
explicit range. It is what `plan` prints and a plan a user may pass to `parallelize`;
the loader shards each kind by its own `shard` and the vocabulary by `vocab_table`
(`shard.shard_placed`). Works on the model by its attribute names and its layers'
`spec`, so this package never imports `llama_tp.model`. For SmolLM2 (9 query / 3 KV
heads, untied) on 2 ranks, `llama_plan(model, 2)` is:

    layers.*.attention            AttentionHeads(parts)
    layers.*.attention.wq|wk|wv   ColwiseParallel(ranges)   rows of heads 0-5 | 6-8
    layers.*.attention.wo         RowwiseParallel(ranges)   columns of the same heads
    layers.*.feed_forward.w1|w3   ColwiseParallel()         rows 0-767 | 768-1535
    layers.*.feed_forward.w2      RowwiseParallel()
    layers.*.attention_norm, layers.*.ffn_norm, norm        Replicate()
    tok_embeddings                VocabParallel()
    output                        LossParallel()

With `sequence_parallel` the norms become `SequenceParallel()`, the embedding's output
and `wo`/`w2`'s outputs take the "sequence" layout, attention and feed-forward gather
their input first, and the head gathers before the logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.nn as nn
from mlx.utils import tree_flatten

from .kind_shard import holds, plan_styles
from .partition import Plan
from .placement import ModelShape, partition
from .splits import SplitTable
from .styles import Layout, LossParallel, Replicate, SequenceParallel, Style, VocabParallel

__all__ = ["layers_table", "llama_plan", "model_shape_of", "plan_for", "vocab_table"]


def model_shape_of(model: nn.Module) -> ModelShape:
    """The placement's view of a built (lazy) model: its args and parameter shapes, as the
    checkpoint it was built from stores them (`checkpoints.slices.model_shape`)."""
    tensors = {k: (tuple(v.shape), v.nbytes) for k, v in tree_flatten(model.parameters())}
    specs = tuple(layer.spec for layer in model.layers)
    return ModelShape(model.args, tensors, getattr(model, "ffn_block", None), specs)


def plan_for(model: nn.Module, n: int, moe_split: str = "tensor") -> Plan:
    """The partition of `model`'s layers over `n` ranks (`placement.partition`)."""
    return partition(model_shape_of(model), n, moe_split)


def _under(prefix: str, styles: dict[str, Style]) -> dict[str, Style]:
    return {f"{prefix}.{k}" if k else prefix: v for k, v in styles.items()}


def _mixer_table(model: nn.Module, p: Plan, sequence: bool) -> dict[str, Style]:
    """The mixers' entries: each layer's kinds by their split tables. A mixer path
    whose layers differ in kind (dense and expert feed-forwards; attention and a
    recurrent mixer) names each layer's module entry by its index (a wildcard would
    match both kinds); tensor entries keep the wildcard (the kinds' names differ)."""
    slots: dict[str, list[tuple[SplitTable, list[int]]]] = {}
    for i, layer in enumerate(model.layers):
        for slot, t in layer.spec.tables.items():
            kinds = slots.setdefault(slot, [])
            known = next((k for k in kinds if k[0] == t), None)
            if known is None:
                kinds.append((t, [i]))
            else:
                known[1].append(i)
    table: dict[str, Style] = {}
    for slot, kinds in slots.items():
        made = []
        for t, layers in kinds:
            styles = plan_styles(t, p, sequence)
            module = styles.pop("", None)
            if module is not None:
                for i in layers if len(kinds) > 1 else ["*"]:
                    table[f"layers.{i}.{slot}"] = module
            made.append((styles, layers))
        # a tensor two kinds name alike but split apart (Gemma 4's sliding and global
        # heads: wq of other widths) takes an entry per layer; the others a wildcard
        differ = {
            path
            for styles, _ in made
            for path, style in styles.items()
            if any(other.get(path, style) != style for other, _ in made)
        }
        for styles, layers in made:
            table |= _under(
                f"layers.*.{slot}", {k: v for k, v in styles.items() if k not in differ}
            )
            for i in layers:
                mixer = model.layers[i][slot]
                own = {k: v for k, v in styles.items() if k in differ and holds(mixer, k)}
                table |= _under(f"layers.{i}.{slot}", own)
    return table


def vocab_table(
    model: nn.Module,
    *,
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
    vocab: Sequence[range] | None = None,
) -> dict[str, Style]:
    """The embedding's and the head's entries: split by vocabulary rows (`vocab`: each
    rank's, default as even as possible; tied: the embedding is the head, loss-parallel)
    or whole, with the sequence-parallel layouts (the embedding keeps its chunk, the
    head gathers first)."""
    seq: Layout = "sequence" if sequence_parallel else "replicate"
    tied = model.args.tie_word_embeddings
    table: dict[str, Style] = {}
    if vocab_parallel:
        rows = None if vocab is None else tuple((r.start, r.stop) for r in vocab)
        table["tok_embeddings"] = (LossParallel if tied else VocabParallel)(rows, output_layout=seq)
        if not tied:
            table["output"] = LossParallel(rows, input_layout=seq)
        if "per_layer_embeddings" in model:  # Gemma's: the same rows, one all-reduce
            table["per_layer_embeddings"] = VocabParallel(rows)
    else:
        table["tok_embeddings"] = Replicate(output_layout=seq)
        if not tied:
            table["output"] = Replicate(input_layout=seq)
    return table


def layers_table(model: nn.Module, p: Plan, sequence_parallel: bool = False) -> dict[str, Style]:
    """The layers' entries of the built-in plan (their kinds' styles under the partition
    `p`, the norms whole or sequence-parallel) and the final norm's."""
    table = _mixer_table(model, p, sequence_parallel)
    norm: Style = SequenceParallel() if sequence_parallel else Replicate()
    norms = {k for layer in model.layers for k, m in layer.items() if isinstance(m, nn.RMSNorm)}
    return table | {f"layers.*.{k}": norm for k in sorted(norms)} | {"norm": norm}


def llama_plan(
    model: nn.Module,
    n: int,
    *,
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
    plan: Plan | None = None,
    vocab: Sequence[range] | None = None,
) -> dict[str, Style]:
    """The built-in plan of `model` over `n` ranks (see the module docstring); `vocab`:
    each rank's vocabulary rows (default: as even as possible)."""
    sp = sequence_parallel
    table = layers_table(model, plan or plan_for(model, n), sp)
    return table | vocab_table(
        model, vocab_parallel=vocab_parallel, sequence_parallel=sp, vocab=vocab
    )
