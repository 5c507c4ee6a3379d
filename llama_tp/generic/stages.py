"""One pipeline stage of an mlx-lm model, whatever its forward pass does.

The model's own `__call__` still runs on every rank, so whatever it does between its
layers (masks from chosen caches, per-layer position tables, scaled embeddings, logit
soft-capping) is exactly mlx-lm's. What differs per stage is which layers do work:

    layers another stage holds   their class swapped for a pass-through of the same
                                 class (attributes kept, weights dropped: `skip`)
    the stage's first layer      (stage > 0) its input replaced by the hidden state
                                 received from the stage before (`recv`)
    the stage's last layer       (not the last stage) its output sent on, evaluated there
    the token embedding          (not the first stage) zeros of its output shape; it
                                 never reaches a layer this stage runs
    the output head              (not the last stage) zeros of its output shape

and the last stage's logits are shared over the pipeline group by one all-sum (the
other stages add zeros), so every rank returns the same logits. Nothing is wrapped:
classes are swapped in place (`swap_class`), so parameter names, attributes the model's
forward reads from its layers (`layer.is_linear`, `layer.use_sliding`) and mlx-lm's
`make_cache` stay as they are.

Caches: the engine holds one cache per layer of the stage (`GenericModel.make_cache`);
the model's forward gets a full-length list in which a skipped layer's entry is a stage
cache of the same kind (so the masks the model makes from it have the right offsets),
or a never-used cache of its kind when the stage has none.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from ..parallel.module_swap import module_at
from .structure import Structure

_EMPTY = mx.zeros((0,))
FLOATS = ("float32", "float16", "bfloat16")


def _drop_weights(module: nn.Module) -> None:
    """Every array of `module` replaced by an empty one (the module keeps its structure and
    attributes; a lazy initializer left in it could be evaluated by accident)."""
    module.update(tree_map(lambda _: _EMPTY, module.parameters()))


def swap_class(obj: nn.Module, kind: str, call: Callable, **methods: Callable) -> None:
    """Give `obj` a subclass of its own class whose `__call__` is `call` (and `methods`), made
    for this object: they close over its own settings."""
    base = type(obj)
    body = {"__call__": call, "__module__": base.__module__, **methods}
    object.__setattr__(obj, "__class__", type(f"{kind}{base.__name__}", (base,), body))


# A layer's hidden state is its first parameter, unless another has one of these names
# (Talkie's blocks take the embeddings `e_x` first, the hidden state `x` second).
HIDDEN_NAMES = ("x", "h", "hidden_states", "inputs", "streams")


def _hidden_name(layer: nn.Module) -> tuple[int, str | None]:
    """(position, name) of the parameter a layer takes its hidden state in (gptj passes it
    by name, `inputs=`)."""
    params = [p.name for p in inspect.signature(type(layer).__call__).parameters.values()][1:]
    if not params:
        return 0, None
    i = next((i for i, p in enumerate(params) if p in HIDDEN_NAMES), 0)
    return i, params[i]


def _hidden(args: tuple, kwargs: dict, where: tuple[int, str | None]) -> mx.array:
    i, name = where
    return args[i] if len(args) > i else kwargs[name]


def _with_hidden(args: tuple, kwargs: dict, where: tuple[int, str | None], x: mx.array) -> tuple:
    i, name = where
    if len(args) > i:
        return (*args[:i], x, *args[i + 1 :]), kwargs
    return args, {**kwargs, name: x}


def skip(layer: nn.Module, link: StageLink) -> None:
    """A layer another stage holds: it passes its hidden state through (as a tuple of the
    layers' arity, the rest None, when the layers return several values: `StageLink.arity`)."""
    _drop_weights(layer)
    name = _hidden_name(layer)

    def call(self, *args, **kwargs):
        x = _hidden(args, kwargs, name)
        return x if link.arity == 1 else (x, *([None] * (link.arity - 1)))

    swap_class(layer, "Skipped", call)


def zeros_out(module: nn.Module, width: int, dtype: mx.Dtype, kind: str, vocab: int = 0) -> None:
    """An embedding (or head) this stage does not hold: lazy zeros of its output's shape
    (B, L, width) in `dtype` (a tied head's, `as_linear`: (B, L, vocab)), never evaluated
    unless the model feeds it to a layer here."""
    _drop_weights(module)

    def call(self, x: mx.array) -> mx.array:
        shape = (*x.shape, width) if kind == "NoEmbedding" else (*x.shape[:-1], width)
        return mx.zeros(shape, dtype)

    def as_linear(self, x: mx.array) -> mx.array:  # a tied head on a middle stage
        return mx.zeros((*x.shape[:-1], vocab), dtype)

    swap_class(module, kind, call, as_linear=as_linear)


class StageLink:
    """The hand-off between stages on one rank: receive before its first layer, send after
    its last. `probe` (a dtype) makes both local: the input is zeros of that dtype and the
    output is recorded, so that the stages can learn each other's dtypes with no
    collective but one gather (`GenericModel.agree_dtypes`). `arity`: how many values a
    layer returns (1: the hidden state; gemma4's return (h, kvs, offset)), learned then."""

    def __init__(self, group: Any, stage: int, pp: int):
        self.group, self.stage, self.pp = group, stage, pp
        self.in_dtype: mx.Dtype | None = None
        self.probe: mx.Dtype | None = None
        self.arity = 1
        self.seen: dict[str, Any] = {}

    def receive(self, x: mx.array) -> mx.array:
        if self.probe is not None:
            self.seen["in_shape"] = tuple(x.shape)
            return mx.zeros(x.shape, self.probe)
        return mx.distributed.recv(x.shape, self.in_dtype, self.stage - 1, group=self.group)

    def returned(self, out: Any) -> None:
        """Note the structure a real layer returned (in a probe)."""
        if self.probe is not None:
            self.seen["arity"] = len(out) if isinstance(out, tuple) else 1

    def send(self, out: Any) -> Any:
        h = out[0] if isinstance(out, tuple) else out
        if not isinstance(h, mx.array):
            raise TypeError(f"a pipeline stage hands on an array, but a layer returned {type(h)}")
        if self.probe is not None:
            self.seen["out"] = (tuple(h.shape), h.dtype)
            return out
        # Evaluated here: a stage's caches do not depend on the send, nothing would run it
        mx.eval(mx.distributed.send(h, self.stage + 1, group=self.group))
        return out


def link_layers(first: nn.Module, last: nn.Module, link: StageLink) -> None:
    """The stage's first layer receives (stage > 0), its last sends (not the last stage)."""
    name = _hidden_name(first)
    base_first = type(first).__call__

    def receive(self, *args, **kwargs):
        if link.stage > 0:
            args, kwargs = _with_hidden(
                args, kwargs, name, link.receive(_hidden(args, kwargs, name))
            )
        out = base_first(self, *args, **kwargs)
        link.returned(out)
        return out

    swap_class(first, "Receiving", receive)
    if link.stage < link.pp - 1:
        base_last = type(last).__call__

        def send(self, *args, **kwargs):
            return link.send(base_last(self, *args, **kwargs))

        swap_class(last, "Sending", send)


def cut_stage(
    model: nn.Module,
    structure: Structure,
    layers: range,
    link: StageLink,
    embedding_out: tuple[int, mx.Dtype] | None,
    head_out: tuple[int, mx.Dtype] | None,
    keep_embedding: bool,
) -> None:
    """Make `model` (built, maybe sharded, not loaded) stage `link.stage` holding `layers`:
    the other layers skipped; the embedding zeroed off the first stage unless it is tied to
    the head of the last or `keep_embedding` (the model reads it beyond the first layer);
    the head zeroed off the last stage. `embedding_out` / `head_out`: (width, dtype). The
    first and last layers are linked to the other stages (`link_layers`)."""
    stage, pp = link.stage, link.pp
    all_layers = module_at(model, structure.layers)
    for i, layer in enumerate(all_layers):
        if i not in layers:
            skip(layer, link)
    tied = structure.head is None
    if structure.embedding and embedding_out and stage > 0 and not keep_embedding:
        if not (tied and stage == pp - 1):
            emb = module_at(model, structure.embedding)
            zeros_out(emb, *embedding_out, "NoEmbedding", structure.vocab_size)
    if structure.head and head_out and stage < pp - 1:
        zeros_out(module_at(model, structure.head), *head_out, "NoHead")
    link_layers(all_layers[layers.start], all_layers[layers.stop - 1], link)


# Config keys of layers that share state across layers (a stage would lack its source):
# key -> what it means; refused when set (a count > 0, or true).
CROSS_LAYER = {
    "num_kv_shared_layers": "layers reuse the keys and values of earlier layers",
    "use_cla": "layers share keys and values (cross-layer attention)",
    "num_kv_reuse_layers": "its last layers reuse the keys and values of an earlier layer",
}


def cross_layer_state(config: dict) -> str | None:
    """Why the layers of `config` cannot be cut into stages, or None."""
    for c in (config, config.get("text_config") or {}):
        for key, why in CROSS_LAYER.items():
            if c.get(key):
                return f"{why} ({key} {c[key]})"
    return None
