"""Where an mlx-lm model keeps its layers, its token embedding and its output head.

mlx-lm's models differ in names (`model.layers`, `transformer.h`, `backbone.layers`,
`language_model.model.layers`; `embed_tokens`, `wte`, `word_embeddings`; `lm_head`,
`output`, `embed_out`) but every one exposes its decoder layers as `Model.layers`. The
list is found by identity in the module tree; the token embedding is the embedding
outside the layers with the vocabulary's rows, the head the linear layer outside them
with the vocabulary's outputs (none: tied to the embedding, or not a module).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.nn as nn

from ..checkpoints.base import CheckpointError

_EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)
_LINEARS = (nn.Linear, nn.QuantizedLinear)


@dataclass(frozen=True)
class Structure:
    """The module paths of a model's parts (dotted, as in its parameter names)."""

    layers: str | None  # e.g. "model.layers"; None: not one list (the model cannot be split)
    n_layers: int
    embedding: str | None  # e.g. "model.embed_tokens"
    head: str | None  # e.g. "lm_head"; None: tied to the embedding (or not a module)
    vocab_size: int

    def layer_of(self, name: str) -> int | None:
        """The layer a parameter name (the model's) belongs to, or None."""
        prefix = self.layers + "."
        if not name.startswith(prefix):
            return None
        return int(name[len(prefix) :].split(".", 1)[0])

    def stored_layer_pattern(self) -> re.Pattern:
        """A stored tensor's layer number by the list's own name (`layers.3.`, `h.3.`), as
        mlx-lm's sharded_load matches them: checkpoints name the container differently
        (`model.language_model.layers.3.`) but keep its last component and the index."""
        last = re.escape(self.layers.rsplit(".", 1)[-1])
        return re.compile(rf"(?:^|\.){last}\.(\d+)\.")

    def require_list(self, why: str) -> str:
        """The layers' path; CheckpointError (one line) when they are not one list."""
        if self.layers is None:
            raise CheckpointError(
                f"{why}: the model's layers are not one list of modules (mlx-lm's Model.layers "
                "joins several), so they cannot be split"
            )
        return self.layers


def _named_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if name}


def find_structure(model: nn.Module, vocab_size: int | None) -> Structure:
    """The parts of mlx-lm `model` (built, not loaded); `layers` None when `Model.layers` is
    not one list of the module tree."""
    try:
        layers = list(model.layers)
    except (AttributeError, TypeError):
        layers = []
    path = _list_path(model, layers) if layers else None
    modules = _named_modules(model)
    inside = (path + ".") if path else "\0"
    outside = {n: m for n, m in modules.items() if not n.startswith(inside) and n != path}
    embeddings = [n for n, m in outside.items() if isinstance(m, _EMBEDDINGS)]
    if vocab_size is None and embeddings:
        vocab_size = modules[embeddings[0]].weight.shape[0]
    embedding = next((n for n in embeddings if modules[n].weight.shape[0] == vocab_size), None)
    heads = [
        n for n, m in outside.items() if isinstance(m, _LINEARS) and m.weight.shape[0] == vocab_size
    ]
    head = heads[-1] if heads else None
    return Structure(path, len(layers), embedding, head, vocab_size or 0)


def _list_path(model: nn.Module, layers: list) -> str | None:
    """The dotted path of the list in the module tree whose elements are `layers` (the
    `Model.layers` property may return the list itself or a copy of a slice of it)."""
    found = []

    def walk(obj: object, path: str) -> None:
        if isinstance(obj, nn.Module):
            for k, v in obj.items():
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}")
        elif isinstance(obj, list) and obj and all(isinstance(x, nn.Module) for x in obj):
            if len(obj) == len(layers) and all(a is b for a, b in zip(obj, layers, strict=True)):
                found.append(path)
            else:
                for i, v in enumerate(obj):
                    walk(v, f"{path}.{i}")

    walk(model, "")
    return found[0] if found else None
