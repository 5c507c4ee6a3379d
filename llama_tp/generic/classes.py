"""Which path runs an architecture, and mlx-lm's own classes for the ones not native.

    route(config) -> Route("native", ...)          # llama_tp implements the model_type
    route(config) -> Route("mlx-lm classes", ...)   # mlx_lm.models.<module> runs it
    model = build(config, stored)                   # mlx-lm's Model, lazy, quantized

Native first: a `model_type` llama_tp implements (`models/registry.MODEL_TYPES`) never
takes the mlx-lm path. Any other is looked up as mlx-lm looks it up (its
`MODEL_REMAPPING`, its architecture remapping, `mlx_lm.models.<model_type>`), built from
its `ModelArgs.from_dict(config)` (keys the architecture does not use are ignored, as
mlx-lm ignores them) and quantized by mlx-lm's rule for mlx-community folders: a module
is quantized when the checkpoint stores its `scales`, with the bits and group size its
stored shapes say (`mlx_lm.utils.infer_quant_config`), or as the config's per-module
entry says. Nothing is evaluated: the weights stay mlx's lazy initializers until the
loader puts the checkpoint's in (`generic/reads.py`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints.base import CheckpointError
from ..models.registry import MODEL_TYPES

NATIVE = "native"
MLX_LM = "mlx-lm classes"
# quantization_config methods mlx-lm maps onto MLX's own modes (the others transform the
# weights as they load, or need Metal: `mlx_lm.convert` them first)
_QUANT_METHODS = {
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
    "mxfp8": {"group_size": 32, "bits": 8, "mode": "mxfp8"},
}


@dataclass(frozen=True)
class Route:
    """How a config's architecture runs: `path` is NATIVE or MLX_LM, `reason` one line."""

    path: str
    model_type: str
    module: str | None  # mlx_lm.models.X for MLX_LM
    reason: str

    @property
    def generic(self) -> bool:
        return self.path == MLX_LM


def mlx_lm_version() -> str:
    import mlx_lm

    return mlx_lm.__version__


def route(config: dict, where: str = "config.json") -> Route:
    """The path for `config` (a config.json dict); CheckpointError for a model_type neither
    llama_tp nor the installed mlx-lm implements."""
    model_type = config.get("model_type")
    if model_type in MODEL_TYPES:
        return Route(NATIVE, model_type, None, f"model_type {model_type!r} is implemented natively")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{where}: no model_type")
    module = mlx_lm_module(config)
    if module is None:
        raise CheckpointError(
            f"{where}: unsupported model_type {model_type!r}: not native "
            f"({', '.join(MODEL_TYPES)}) and not in mlx-lm {mlx_lm_version()}"
        )
    return Route(
        MLX_LM,
        model_type,
        module,
        f"model_type {model_type!r} has no native implementation: {module} "
        f"(mlx-lm {mlx_lm_version()}) runs it",
    )


def path_line(ckpt: object) -> str:
    """'mlx-lm classes: model_type ... runs it' / 'native: ...': which path a loaded
    checkpoint runs on and why (`--verbose`, `doctor`)."""
    r = getattr(ckpt, "route", None)
    if r is None:
        fmt, meta = getattr(ckpt, "format", ""), getattr(ckpt, "metadata", {}) or {}
        if fmt == "gguf":
            arch = meta.get("general.architecture", "?")
            return f"{NATIVE}: GGUF architecture {arch!r} is implemented natively"
        model_type = meta.get("model_type") or getattr(
            getattr(ckpt, "args", None), "model_type", "?"
        )
        return f"{NATIVE}: model_type {model_type!r} is implemented natively"
    return f"{r.path}: {r.reason}"


def mlx_lm_module(config: dict) -> str | None:
    """The module mlx-lm builds `config` with (its own lookup), or None."""
    from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

    model_type = config["model_type"]
    archs = config.get("architectures") or ()
    archs = (archs,) if isinstance(archs, str) else archs
    found = next(
        (MODEL_ARCHITECTURE_REMAPPING[k] for a in archs if (k := (model_type, a)) in
         MODEL_ARCHITECTURE_REMAPPING),
        MODEL_REMAPPING.get(model_type, model_type),
    )  # fmt: skip
    name = f"mlx_lm.models.{found}"
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    except SystemExit:  # mlx_lm.models.olmo exits when its own dependency is missing
        return None
    return name if hasattr(module, "Model") and hasattr(module, "ModelArgs") else None


def build(config: dict, where: str) -> nn.Module:
    """mlx-lm's Model for `config`, its weights mlx's lazy initializers (nothing evaluated).
    Raises CheckpointError naming `where` when mlx-lm's classes refuse the config."""
    module = importlib.import_module(route(config, where).module)
    if config.get("model_file"):
        raise CheckpointError(
            f"{where}: model_file {config['model_file']!r}: custom code is not run"
        )
    try:
        model = module.Model(module.ModelArgs.from_dict(config))
    except Exception as e:  # a config the architecture's classes refuse
        raise CheckpointError(f"{where}: {module.__name__} refuses the config: {e}") from None
    model.eval()
    return model


def quantization_of(config: dict, where: str) -> dict | None:
    """The `quantization` block mlx-lm quantizes the model by (None: not quantized)."""
    if config.get("quantization") is not None:
        return config["quantization"]
    legacy = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config"
    )
    if not legacy:
        return None
    method = legacy.get("quant_method")
    if method in _QUANT_METHODS:
        return dict(_QUANT_METHODS[method])
    raise CheckpointError(
        f"{where}: quantization_config method {method!r} is not read here: convert the "
        "checkpoint with mlx_lm.convert first"
    )


def quantize(model: nn.Module, quantization: dict, shapes: dict[str, mx.array]) -> None:
    """mlx-lm's `load_model` rule: a module with stored `scales` is quantized with the bits and
    group size its shapes say; the config's per-module entries win. `shapes`: the sanitized
    weights by the model's names (lazy placeholders do: only shapes and dtypes are read)."""
    from mlx_lm.utils import infer_quant_config

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in shapes:
            return False
        return infer_quant_config(path, module, shapes)

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )
