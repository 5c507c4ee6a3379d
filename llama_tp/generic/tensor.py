"""Tensor-parallel splits of mlx-lm's models: the model's own `shard()`, or a style table.

    splits = shard_model(model, group)   # {parameter name: Split} of what this rank keeps

mlx-lm's `shard()` (where the architecture defines one) cuts each projection with mlx's
`shard_linear` / `shard_inplace`, evenly. It runs here on the model before any weight
is read, with mlx's `_shard` watched: every parameter it cuts is recorded with its axis,
segments and this rank's part (`reads.Split`), so the loader then reads only that part
from the file. A parameter a `shard()` cuts by hand (DeepSeek's per-head `embed_q`,
Kimi's conv weights) is read off a probe: while the model splits, every parameter holds
its own flat indices, so what the cut kept is known exactly (`reads.Take`).

For an architecture without `shard()`, `STYLES` maps module paths inside a layer onto
the same two styles (attention's q/k/v/o with the head counts divided, the gated MLP,
`switch_mlp` experts with one all-sum after them, shared experts), applied only to a
layer whose every weight the table covers (its class's shape is then one the table
knows); any other layer refuses the split in one line that suggests `--pp`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
import mlx.nn.layers.distributed as distributed
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_flatten, tree_unflatten

from ..parallel.module_swap import module_at, replace_at
from .reads import Split, Take
from .stages import swap_class
from .structure import Structure


class TensorSplitError(ValueError):
    """A tensor-parallel split this model cannot take: one line, with the numbers."""


A2S, S2A = "all-to-sharded", "sharded-to-all"
# module path inside a layer -> (style, in place); in place: the module does its own sum
STYLES: dict[str, tuple[str, bool]] = {
    "self_attn.q_proj": (A2S, False),
    "self_attn.k_proj": (A2S, False),
    "self_attn.v_proj": (A2S, False),
    "self_attn.o_proj": (S2A, False),
    "mlp.gate_proj": (A2S, False),
    "mlp.up_proj": (A2S, False),
    "mlp.down_proj": (S2A, False),
    "mlp.switch_mlp.gate_proj": (A2S, True),
    "mlp.switch_mlp.up_proj": (A2S, True),
    "mlp.switch_mlp.down_proj": (S2A, True),
    "mlp.shared_expert.gate_proj": (A2S, False),
    "mlp.shared_expert.up_proj": (A2S, False),
    "mlp.shared_expert.down_proj": (S2A, False),
    "mlp.shared_experts.gate_proj": (A2S, False),
    "mlp.shared_experts.up_proj": (A2S, False),
    "mlp.shared_experts.down_proj": (S2A, False),
}
# weights a layer may keep whole on every rank: norms (per head or of the whole hidden state)
# and the experts' router
REPLICATED = ("*norm*", "*layernorm*", "mlp.gate.*", "mlp.shared_expert_gate.*")
# attention attributes holding head counts, divided by the group's size
QUERY_HEADS = ("n_heads", "num_heads", "num_attention_heads")
HEAD_COUNTS = (*QUERY_HEADS, "n_kv_heads", "num_key_value_heads", "num_kv_heads")


# Architectures whose layers have the table's shape but compute otherwise, with the reason
# (tests/test_generic.py splits every other one it recognises and checks the tokens)
STYLE_REFUSED = {
    "plamo": "its attention reshapes by the config's head counts, not its own",
}


def has_shard(model: nn.Module) -> bool:
    return callable(getattr(model, "shard", None))


@contextmanager
def _recording(group: mx.distributed.Group) -> Iterator[dict[int, tuple[int, Split]]]:
    """Watch mlx's `_shard`: yields {id(new array): (id(old array), Split)}."""
    real = distributed._shard
    made: dict[int, tuple[int, Split]] = {}
    keep = []

    def shard(parameters, predicate, group=None):
        g = group or mx.distributed.init()
        n, r = g.size(), g.rank()
        leaves = [(p, w) for p, w in tree_flatten(parameters) if isinstance(w, mx.array)]
        plans = {}
        for path, w in leaves:
            s = predicate(path, w)
            if s is None:
                continue
            axis, segments = (s, 1) if isinstance(s, int) else s
            split = Split(axis, segments, n, r)
            try:
                split.runs(w.shape[axis])
            except ValueError as e:
                raise _Indivisible(id(w), axis, w.shape, str(e)) from None
            plans[path] = split
        out = real(parameters, predicate, group)
        for (path, w), (_, o) in zip(leaves, tree_flatten(out), strict=True):
            if path in plans:
                made[id(o)] = (id(w), plans[path])
                keep.append(o)
        return out

    distributed._shard = shard
    try:
        yield made
    finally:
        distributed._shard = real


class _Indivisible(Exception):
    def __init__(self, array_id: int, axis: int, shape: tuple, why: str):
        super().__init__(why)
        self.array_id, self.axis, self.shape, self.why = array_id, axis, shape, why


def shard_model(
    model: nn.Module, structure: Structure, group: mx.distributed.Group, config: dict, name: str
) -> tuple[dict[str, Split | Take], str]:
    """Split `model` (built, not loaded) over `group`; returns what each split parameter keeps
    (a `Split` through mlx's `_shard`, a `Take` of a cut by hand) and how ("mlx-lm's
    shard()" or "the style table"). TensorSplitError when it cannot.

    Before splitting, every parameter becomes a lazy probe holding its own flat indices
    (`mx.arange`, never evaluated unless a `shard()` cuts the parameter by hand: then the
    indices it kept are read off the probe)."""
    before = dict(tree_flatten(model.parameters()))
    probes = {k: mx.arange(v.size, dtype=mx.int64).reshape(v.shape) for k, v in before.items()}
    model.update(tree_unflatten(list(probes.items())))
    names = {id(v): k for k, v in probes.items()}
    how = "mlx-lm's shard()" if has_shard(model) else "the style table"
    with _recording(group) as made:
        try:
            if has_shard(model):
                _check_heads(config, group.size(), name)
                model.shard(group)
            else:
                refused = STYLE_REFUSED.get(config.get("model_type"))
                if refused:
                    raise TensorSplitError(
                        f"{name}: no tensor split: mlx-lm defines no shard() for it and "
                        f"llama_tp's style table cannot split it ({refused}); run --pp "
                        f"{group.size()} instead"
                    )
                apply_styles(model, structure, group, name)
        except _Indivisible as e:
            what = names.get(e.array_id, "a weight")
            raise TensorSplitError(
                f"{name}: {how} splits evenly, but {what} ({e.shape[e.axis]} along axis "
                f"{e.axis}): {e.why}; run --pp {group.size()} instead"
            ) from None
        except TensorSplitError:
            raise
        except (ValueError, AssertionError) as e:  # the model's own shard() refusing N ranks
            raise TensorSplitError(
                f"{name}: {how} cannot split it over {group.size()} ranks ({e}); run --pp "
                f"{group.size()} instead"
            ) from None
    splits: dict[str, Split | Take] = {}
    for k, v in tree_flatten(model.parameters()):
        if id(v) in made:
            splits[k] = made[id(v)][1]
        elif k in probes and v is not probes[k]:  # cut by hand: the indices it kept
            splits[k] = Take(tuple(v.reshape(-1).tolist()), tuple(v.shape))
    return splits, how


def _check_heads(config: dict, n: int, name: str) -> None:
    """The head counts a `shard()` divides (unchecked, `n_heads //= N`) must divide."""
    text = config.get("text_config") or {}
    for key in ("num_attention_heads", "num_key_value_heads"):
        count = config.get(key, text.get(key))
        if isinstance(count, int) and count % n:
            raise TensorSplitError(
                f"{name}: mlx-lm's shard() splits evenly, but {key} {count} does not divide "
                f"over {n} ranks; run --pp {n} instead"
            )


def _layer_styles(layer: nn.Module) -> dict[str, tuple[str, bool]] | None:
    """The table's styles for `layer`'s modules, or None when some weight of it is neither in
    the table nor one a layer may keep whole (the table does not know this layer's shape)."""
    found = {p: s for p, s in STYLES.items() if _module(layer, p) is not None}
    if not any(p.endswith("o_proj") for p in found) and not any(
        p.endswith("down_proj") for p in found
    ):
        return None
    head_dim = _head_dim(layer)
    for path, value in tree_flatten(layer.parameters()):
        module = path.rsplit(".", 1)[0]
        if module in found:
            continue
        if not any(fnmatch.fnmatch(path, g) for g in REPLICATED):
            return None
        # a norm inside attention is kept whole only when it is per head (Qwen3's q_norm);
        # one over a whole projection (OLMo 2's) would see only this rank's columns
        if path.startswith("self_attn.") and value.shape[-1] != head_dim:
            return None
    return found


def _head_dim(layer: nn.Module) -> int | None:
    q = _module(layer, "self_attn.q_proj")
    attention = _module(layer, "self_attn")
    heads = next(
        (
            getattr(attention, a)
            for a in QUERY_HEADS
            if isinstance(getattr(attention, a, None), int)
        ),
        None,
    )
    if q is None or not heads:
        return None
    return q.weight.shape[0] // heads


def _module(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        m = module_at(layer, path)
    except (KeyError, IndexError, AttributeError, ValueError):
        return None
    return m if isinstance(m, nn.Module) else None


def apply_styles(model: nn.Module, structure: Structure, group: mx.distributed.Group, name: str):
    """The style table on every layer (all recognised first: nothing is split otherwise)."""
    layers = module_at(model, structure.require_list(name))
    tables = [_layer_styles(layer) for layer in layers]
    unknown = next((i for i, t in enumerate(tables) if t is None), None)
    if unknown is not None:
        cls = type(layers[unknown]).__name__
        raise TensorSplitError(
            f"{name}: no tensor split: mlx-lm defines no shard() for it and llama_tp's style "
            f"table does not know the shape of its layer {unknown} ({cls}); run --pp "
            f"{group.size()} instead"
        )
    n = group.size()
    for layer, table in zip(layers, tables, strict=True):
        for path, (style, in_place) in table.items():
            module = module_at(layer, path)
            if in_place:
                shard_inplace(module, style, group=group)
            else:
                replace_at(layer, path, shard_linear(module, style, group=group))
        attention = _module(layer, "self_attn")
        for attr in HEAD_COUNTS:
            count = getattr(attention, attr, None) if attention is not None else None
            if isinstance(count, int):
                if count % n:
                    raise TensorSplitError(
                        f"{name}: {attr} {count} does not divide over {n} ranks; run --pp "
                        f"{n} instead"
                    )
                setattr(attention, attr, count // n)
        experts = _module(layer, "mlp.switch_mlp")
        if experts is not None and "mlp.switch_mlp.down_proj" in table:
            _sum_after(experts, group)


def _sum_after(module: nn.Module, group: mx.distributed.Group) -> None:
    """`module`'s output summed over `group` (experts split in place: each rank's partial sum)."""
    base = type(module).__call__

    def call(self, *args, **kwargs):
        return mx.distributed.all_sum(base(self, *args, **kwargs), group=group)

    swap_class(module, "Summed", call)
