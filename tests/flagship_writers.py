"""The flagship fixtures' folders (flagship_fixtures.CONFIGS), written by mlx-lm's own
classes: a random model, its folder as mlx-lm saves it, mlx-lm's 4-bit convert, and every
family's set of folders written once under a root (`flagship_models`)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
from fixtures import train_sentencepiece
from flagship_fixtures import CONFIGS, QUANTIZED
from flagship_gguf import GGUF
from flagship_release import release_k3

# the families with a float32 copy in their release's own layout too
RELEASE = {"kimi_k3": release_k3}


def random_mlx_lm(config: dict, seed: int = 0):
    """mlx-lm's model for `config` (its own `ModelArgs.from_dict`), every parameter random
    in float32 (projections scaled by their input width, norms about 1)."""
    from mlx.utils import tree_flatten, tree_unflatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    params = []
    for name, v in tree_flatten(model.parameters()):
        w = mx.random.normal(v.shape) * v.shape[-1] ** -0.5
        if "norm" in name or name.endswith(("scale", "layer_scalar")):
            w = 1.0 + 0.1 * mx.random.normal(v.shape)
        params.append((name, w.astype(mx.float32)))
    model.update(tree_unflatten(params))
    return model


def save_mlx_lm(path: Path, model, config: dict, tokenizer: bool = True) -> Path:
    """`model`'s folder as mlx-lm saves it (and a sentencepiece tokenizer)."""
    from mlx.utils import tree_flatten

    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        train_sentencepiece(path, config["vocab_size"])
    return path


def write_mlx_lm(path: Path, config: dict, seed: int = 0) -> Path:
    """A float32 folder of mlx-lm's model for `config`, every parameter random."""
    return save_mlx_lm(path, random_mlx_lm(config, seed), config)


def quantized(src: Path, out: Path, bits: int = 4) -> Path:
    """mlx-lm's convert of `src`: `bits` bits in groups of 32."""
    from mlx_lm import convert

    convert(str(src), str(out), quantize=True, q_bits=bits, q_group_size=32)
    return out


def flagship_models(root: Path, names=tuple(CONFIGS)) -> dict[str, Path]:
    """{family: float32 folder, "<family>-q4": its 4-bit copy (`QUANTIZED`), "<family>-gguf":
    its float32 GGUF (`GGUF`), "<family>-release": its release layout (`RELEASE`)}, each
    family written once under `root` (its weights seeded by its place in `CONFIGS`): a
    second call, from this process or another (`family_kit.folders` shares a root over
    pytest-xdist's workers), waits for the first and finds its folders."""
    out = {}
    for name in names:
        out |= _family_models(root / name, name)
    return out


def _family_models(root: Path, name: str) -> dict[str, Path]:
    import fcntl

    out = {name: root / name}
    out |= {f"{name}-q4": root / f"{name}-q4"} if name in QUANTIZED else {}
    out |= {f"{name}-gguf": root / f"{name}.gguf"} if name in GGUF else {}
    out |= {f"{name}-release": root / f"{name}-release"} if name in RELEASE else {}
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / ".written").exists():
            write_mlx_lm(out[name], CONFIGS[name], seed=list(CONFIGS).index(name))
            if name in QUANTIZED:
                quantized(out[name], out[f"{name}-q4"])
            if name in GGUF:
                GGUF[name](out[name], out[f"{name}-gguf"])
            if name in RELEASE:
                RELEASE[name](out[name], out[f"{name}-release"])
            (root / ".written").touch()
    return out
