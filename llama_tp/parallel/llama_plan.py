"""The built-in Llama plan: one table from module paths to parallel styles.

Made from the partition plan (`partition.make_plan`): where N divides the heads or
columns the styles take no ranges (mlx's `shard_linear`, the design's even split),
elsewhere each rank's explicit range. Works on the model by its attribute names,
so this package never imports `llama_tp.model`. For SmolLM2 (9 query / 3 KV heads,
untied) on 2 ranks, `llama_plan(model, 2)` is:

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .experts import ShardInPlace, moe_styles
from .partition import Plan, RankPart
from .placement import ModelShape, partition
from .sequence import gather_input
from .styles import (
    ColwiseParallel,
    Layout,
    LossParallel,
    PlanError,
    PrepareModuleInput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Split,
    Style,
    VocabParallel,
)

Parts = Sequence[RankPart] | Mapping[int, RankPart]


def model_shape_of(model: nn.Module) -> ModelShape:
    """The placement's view of a built (lazy) model: its args and parameter shapes, as the
    checkpoint it was built from stores them (`checkpoints.slices.model_shape`)."""
    tensors = {k: (tuple(v.shape), v.nbytes) for k, v in tree_flatten(model.parameters())}
    return ModelShape(model.args, tensors, getattr(model, "ffn_block", None))


def plan_for(model: nn.Module, n: int, moe_split: str = "tensor") -> Plan:
    """The partition of `model`'s layers over `n` ranks (`placement.partition`)."""
    return partition(model_shape_of(model), n, moe_split)


def _by_rank(parts: Parts) -> dict[int, RankPart]:
    return dict(parts) if isinstance(parts, Mapping) else {p.rank: p for p in parts}


@dataclass(frozen=True)
class AttentionHeads(Style):
    """An attention module's local head counts (and, where a rank's query heads do not
    map onto its KV heads as plain GQA, the KV map) from the partition plan's `parts`;
    None: N equal blocks of query and KV heads. `input_layout="sequence"` gathers the
    sequence chunks first. Goes with `ColwiseParallel` on wq/wk/wv and `RowwiseParallel`
    on wo over the same heads; attention sinks (gpt-oss) are sliced to the local heads."""

    parts: Parts | None = None
    input_layout: Layout = "replicate"

    def split(self, module: nn.Module, path: str, n: int) -> None:
        if not all(hasattr(module, a) for a in ("n_heads", "n_kv_heads", "head_dim")):
            raise PlanError(f"{path}: AttentionHeads applies to attention, not {type(module)}")
        if self.parts is None and module.n_kv_heads % n:
            where = f"{path}: " if path else ""
            raise PlanError(
                f"{where}cannot split {module.n_kv_heads} KV heads evenly over {n} ranks"
            )
        return None

    def describe(self, rank: int, n: int) -> str:
        if self.parts is None:
            return f"heads 1/{n}"
        part = _by_rank(self.parts).get(rank)
        if part is None:
            return "-"
        q, kv = part.q_heads, part.kv_heads
        return f"q {q.start}-{q.stop - 1} kv {kv.start}-{kv.stop - 1}"

    def apply(self, module, group: mx.distributed.Group, ctx, split: Split | None):
        if self.parts is None:
            module.n_heads //= group.size()
            module.n_kv_heads //= group.size()
            first = group.rank() * module.n_heads
        else:
            part = _by_rank(self.parts)[group.rank()]
            module.n_heads, module.n_kv_heads = len(part.q_heads), len(part.kv_heads)
            first = part.q_heads.start
            if part.kv_map is not None:
                object.__setattr__(module, "_kv_index", mx.array(part.kv_map, dtype=mx.int32))
        if "sinks" in module:  # gpt-oss: each query head's sink logit goes with its head
            module.sinks = mx.contiguous(module.sinks[first : first + module.n_heads])
        if self.input_layout == "sequence":
            # The queries go in sequence chunks too (see `gather_input`).
            gather_input(module, ctx, query_chunks=True)
        return module


def attention_styles(
    head_dim: int, parts: Parts | None = None, sequence: bool = False
) -> dict[str, Style]:
    """Styles of one attention module, by path relative to it ("" is the module)."""
    q = kv = None
    if parts is not None:
        hd, by = head_dim, _by_rank(parts)
        q = {r: (p.q_heads.start * hd, p.q_heads.stop * hd) for r, p in by.items()}
        kv = {r: (p.kv_heads.start * hd, p.kv_heads.stop * hd) for r, p in by.items()}
    layout: Layout = "sequence" if sequence else "replicate"
    return {
        "": AttentionHeads(parts, input_layout=layout),
        "wq": ColwiseParallel(q),
        "wk": ColwiseParallel(kv),
        "wv": ColwiseParallel(kv),
        "wo": RowwiseParallel(q, output_layout=layout),
    }


def latent_attention_styles(
    q_head_dim: int, v_head_dim: int, direct_q: bool, parts: Parts, sequence: bool = False
) -> dict[str, Style]:
    """Styles of one multi-head latent attention module (`models/latent_attention.py`) by
    path relative to it: each rank's query heads, any count (the rows of q_b_proj, or of
    wq when queries are projected directly, and those heads of embed_q / unembed_out,
    axis 0), wo by the same heads' columns; the latent projections stay whole."""
    by = _by_rank(parts)
    heads = {r: (p.q_heads.start, p.q_heads.stop) for r, p in by.items()}
    layout: Layout = "sequence" if sequence else "replicate"
    return {
        "": AttentionHeads(parts, input_layout=layout),
        "wq" if direct_q else "q_b_proj": ColwiseParallel(
            {r: (a * q_head_dim, b * q_head_dim) for r, (a, b) in heads.items()}
        ),
        "embed_q": ShardInPlace("heads", heads),
        "unembed_out": ShardInPlace("heads", heads),
        "wo": RowwiseParallel(
            {r: (a * v_head_dim, b * v_head_dim) for r, (a, b) in heads.items()},
            output_layout=layout,
        ),
    }


def feed_forward_styles(parts: Parts | None = None, sequence: bool = False) -> dict[str, Style]:
    """Styles of one feed-forward module, by path relative to it ("" is the module)."""
    f = None
    if parts is not None:
        f = {r: (p.ffn.start, p.ffn.stop) for r, p in _by_rank(parts).items()}
    styles: dict[str, Style] = {"": PrepareModuleInput()} if sequence else {}
    layout: Layout = "sequence" if sequence else "replicate"
    styles |= {
        "w1": ColwiseParallel(f),
        "w2": RowwiseParallel(f, output_layout=layout),
        "w3": ColwiseParallel(f),
    }
    return styles


def _under(prefix: str, styles: dict[str, Style]) -> dict[str, Style]:
    return {f"{prefix}.{k}" if k else prefix: v for k, v in styles.items()}


def _feed_forward_table(model: nn.Module, p: Plan, sequence: bool) -> dict[str, Style]:
    """The feed-forward entries: dense layers by columns, mixture-of-experts layers by
    tensor or by expert (`experts.moe_styles`). A model mixing the two names each layer's
    module entry by its index (a wildcard would match both kinds)."""
    kinds = ["switch_mlp" in layer.feed_forward for layer in model.layers]
    table: dict[str, Style] = {}
    for sparse in sorted(set(kinds)):
        if sparse:
            shared = any("shared_expert" in layer.feed_forward for layer in model.layers)
            styles = moe_styles(p.parts, p.experts.split, shared, sequence)
        else:
            styles = feed_forward_styles(None if p.even_ffn else p.parts, sequence)
        module = styles.pop("", None)
        table |= _under("layers.*.feed_forward", styles)
        if module is not None:
            mixed = len(set(kinds)) > 1
            for i in [i for i, k in enumerate(kinds) if k == sparse] if mixed else ["*"]:
                table[f"layers.{i}.feed_forward"] = module
    return table


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
    p = plan or plan_for(model, n)
    sp = sequence_parallel
    a = model.args
    if getattr(a, "kv_lora_rank", 0):
        q_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
        attention = latent_attention_styles(
            q_head_dim, a.v_head_dim, not a.q_lora_rank, p.parts, sp
        )
    else:
        attention = attention_styles(p.head_dim, None if p.even_attention else p.parts, sp)
    table = _under("layers.*.attention", attention)
    table |= _feed_forward_table(model, p, sp)
    norm: Style = SequenceParallel() if sp else Replicate()
    table |= {"layers.*.attention_norm": norm, "layers.*.ffn_norm": norm, "norm": norm}
    seq: Layout = "sequence" if sp else "replicate"
    tied = model.args.tie_word_embeddings
    if vocab_parallel:
        rows = None if vocab is None else tuple((r.start, r.stop) for r in vocab)
        table["tok_embeddings"] = (LossParallel if tied else VocabParallel)(rows, output_layout=seq)
        if not tied:
            table["output"] = LossParallel(rows, input_layout=seq)
    else:
        table["tok_embeddings"] = Replicate(output_layout=seq)
        if not tied:
            table["output"] = Replicate(input_layout=seq)
    return table
