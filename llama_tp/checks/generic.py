"""The doctor's check of the mlx-lm path: a tiny model on mlx-lm's own classes (Gemma 2's,
an architecture llama_tp does not implement) split into pipeline stages over the ranks,
against the same model whole on every rank.

Every rank writes the same random-weight folder (a fixed seed) to a temporary directory,
loads it through the loader's mlx-lm branch (`--pp N` over all ranks), and compares the
logits every rank returns with mlx-lm's own model of the folder.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mlx.core as mx

TINY = {
    "model_type": "gemma2",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": 256,
}
TOKENS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]]


def write_tiny(out: Path, seed: int = 0) -> Path:
    """The tiny Gemma 2 folder, written by mlx-lm's own class (the same on every rank)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma2

    mx.random.seed(seed)
    model = gemma2.Model(gemma2.ModelArgs.from_dict(TINY))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(TINY))
    return out


def stage_logits_diff(group: mx.distributed.Group) -> tuple[float, str]:
    """(max abs difference, how it was split) of the tiny model's logits split over `group`
    into pipeline stages against mlx-lm's whole model. Collective: every rank calls it."""
    from mlx_lm.utils import load_model

    from ..generic.loader import checkpoint_route
    from ..loading.generic import load_generic_model
    from ..loading.loader import LoadOptions

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny(Path(tmp))
        route = checkpoint_route(path)
        pp = group.size() if group.size() > 1 else None
        model, _ = load_generic_model(path, group, route, LoadOptions(pp=pp))
        whole, _ = load_model(path)
        tokens = mx.array(TOKENS, dtype=mx.int32)
        diff = mx.max(mx.abs(model(tokens) - whole(tokens))).item()
    how = f"{group.size()} pipeline stages" if pp else "1 rank: nothing to split"
    return diff, how
