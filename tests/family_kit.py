"""The family test kit: what every natively implemented family must do, one row per
fixture of `flagship_fixtures.CONFIGS`, with mlx-lm's own class on the same folder as the
oracle (as mlx-lm's tests/test_models.py runs one `model_test_runner` per family).

    FAMILIES["minimax"]                   # a `Family`: what the kit checks of a fixture
    models = folders(tmp_path_factory)    # every fixture's folders, written once per run
    greedy(ours, prompt, 32) == greedy_mlx_lm(theirs, prompt, 32)
    held_bytes(cache)                     # what a list of caches holds, of any kind
    for label, config, theirs, logits in variants(FAMILIES["kimi_k3"]): ...

tests/test_families.py runs the kit's checks on every row (one process: logits, cached
steps, greedy tokens, the caches `plan` counts; a chat's second turn; `bench --synthetic`;
the GGUF layout; the optional config fields left to mlx-lm's defaults), and
tests/test_flagships.py its launches (every split and mesh, one launch per rank count
for all the rows). A family's own file keeps only what is its alone (`plan` of its
release's config, its release layouts, its refusals, what makes its kind matter).
Adding a family: its fixture in `CONFIGS`, its row here, its specs in the launches.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from flagship_fixtures import CONFIGS, QUANTIZED
from flagship_writers import flagship_models

__all__ = ["ATOL", "CONFIGS", "FAMILIES", "TOKENS", "Family", "folders", "greedy"]
__all__ += ["greedy_mlx_lm", "held_bytes", "optional_fields", "variants"]

ATOL = 1e-4
# 18 tokens: the kit's prompt is the first 12 (past every fixture's window, chunk and
# top-k of 4); the cached steps of a row whose `steps` reach further take the rest
TOKENS = mx.array(np.random.default_rng(0).integers(0, 389, (1, 18)), mx.int32)
# what the common reader requires (refused in one line without), so never left out
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


@dataclass(frozen=True)
class Family:
    """What the kit checks of one fixture (`name`, a key of `CONFIGS`).

    steps: the cached forward's calls as (start, stop) of `TOKENS`, each compared with
        mlx-lm's, then the caches' bytes with `plan`'s for `stop` tokens
    same_cache_classes: the caches are mlx-lm's own classes (else: the recurrent ones
        where mlx-lm's are)
    args_check / model_check: what the fixture must read as (its ModelArgs; its model)
    chat: (max_tokens, first message, second message); None: no chat (gemma3's tokenizer
        does not load: transformers refuses its config, 128 wide over 10 heads)
    synthetic: `bench --synthetic` specs, and what their model must read as
    gguf: the GGUF writer (flagship_gguf) whose Q8_0 file is compared with its own values
        dequantized; q8_last: the argmax of the last position only; q8_open: keywords of
        open_checkpoint; gguf_check(gguf checkpoint, folder checkpoint)
    refused: {config key: message} fields mlx-lm's class takes but llama_tp refuses (one
        line) when left to that class's default
    varies: mlx-lm's class takes the fixture with some of its fields left out (`variants`)
    """

    name: str
    steps: tuple[tuple[int, int], ...] = ((0, 8), (8, 9), (9, 12))
    same_cache_classes: bool = False
    args_check: Callable[[Any], bool] = lambda args: True
    model_check: Callable[[Any], bool] = lambda model: True
    chat: tuple[int, str, str] | None = (6, "hi there", "again")
    synthetic: tuple[tuple[str, ...], Callable[[Any], bool]] | None = None
    gguf: Callable | None = None
    q8_last: bool = False
    q8_open: dict = field(default_factory=dict)
    gguf_check: Callable[[Any, Any], bool] = lambda gguf, folder: True
    refused: dict = field(default_factory=dict)
    varies: bool = True

    @property
    def folders(self) -> tuple[str, ...]:
        """The folders compared with mlx-lm: float32, and the 4-bit copy where there is one."""
        return (self.name, f"{self.name}-q4") if self.name in QUANTIZED else (self.name,)


def _kinds(model) -> list[tuple[str, str]]:
    return [(type(x.attention).__name__, type(x.feed_forward).__name__) for x in model.layers]


def _rows() -> dict[str, Family]:
    from flagship_gguf import (
        gguf_gemma4,
        gguf_k3,
        gguf_kimi,
        gguf_llama4,
        gguf_minimax,
        gguf_nemotron,
        gguf_sparse,
        gguf_step,
    )

    # 6 single steps after the prompt: past Gemma's window of 4 (the rotating caches wrap)
    gemma_steps = ((0, 12), *((t, t + 1) for t in range(12, 18)))
    nemotron = dict(gguf=gguf_nemotron, q8_open={"blocks": True})
    k3_kinds = [("FusedKimiDeltaAttention", "SituFeedForward"),
                ("GatedLatentAttention", "LatentExperts"),
                ("FusedKimiDeltaAttention", "LatentExperts")]  # fmt: skip
    rows = [
        Family(
            "gemma4",
            gemma_steps,
            same_cache_classes=True,
            synthetic=(
                ("gemma4-tiny-fp32", "gemma4-tiny-q4"),
                lambda m: m.args.n_experts == 8 and "full_attention" in m.args.layer_types,
            ),
            gguf=gguf_gemma4,
            gguf_check=lambda g, f: (
                g.args.k_eq_v
                and g.args.global_kv_heads == 2
                and g.args.kv_sources == [None] * 4 + [3, 2]
                and g.args.rope["full_attention"][1]["partial_rotary_factor"] == 0.25
            ),
        ),
        Family("gemma3", gemma_steps, same_cache_classes=True, chat=None),
        Family(
            "deepseek_v32",
            ((0, 8), (8, 9), (9, 10), (10, 12)),
            same_cache_classes=True,
            synthetic=(
                ("dsv32-tiny-fp32", "dsv32-tiny-q4"),
                lambda m: m.args.model_type == "deepseek_v32" and m.args.index_topk == 4,
            ),
        ),
        Family(
            "glm5",
            ((0, 8), (8, 9), (9, 10), (10, 12)),
            same_cache_classes=True,
            gguf=gguf_sparse,
            q8_last=True,
            varies=False,
            gguf_check=lambda g, f: (
                g.args.extra["indexer_rope_interleave"] is True
                and g.args.index_topk == 4
                and g.args.index_n_heads == 4
            ),
        ),
        Family(
            "minimax",
            varies=False,
            args_check=lambda a: a.rope_dims == 16,
            synthetic=(
                ("minimax-tiny-fp32", "minimax-tiny-q4"),
                lambda m: m.args.model_type == "minimax" and m.args.rope_dims == 8,
            ),
            gguf=gguf_minimax,
            gguf_check=lambda g, f: (
                g.args.rope_dims == 16 and not g.args.qk_norm and g.args.router == "sigmoid_bias"
            ),
        ),
        Family(
            "llama4",
            varies=False,
            steps=((0, 6), (6, 7), (7, 8), (8, 9), (9, 12)),
            synthetic=(
                ("llama4-tiny-fp32", "llama4-tiny-q4"),
                lambda m: m.args.model_type == "llama4" and m.args.attention_chunk_size == 8,
            ),
            gguf=gguf_llama4,
            gguf_check=lambda g, f: (
                g.args.rope_scaling == f.args.rope_scaling and g.args.extra == f.args.extra
            ),
        ),
        Family("llama4_text", ((0, 6), (6, 7), (7, 8), (8, 9), (9, 12)), varies=False),
        Family(
            "step3p5",
            ((0, 8), (8, 9), (9, 10), (10, 11), (11, 12)),
            model_check=lambda m: [x.attention.n_heads for x in m.layers] == [10, 8, 8],
            chat=(2, "hi", "ok"),
            synthetic=(
                ("step3p5-tiny-fp32", "step3p5-tiny-q4"),
                lambda m: m.args.model_type == "step3p5" and m.layers[1].attention.n_heads == 12,
            ),
            gguf=gguf_step,
            gguf_check=lambda g, f: (
                g.args.extra == f.args.extra
                and (g.args.n_heads, g.args.n_kv_heads, g.args.layer_types)
                == (10, 5, f.args.layer_types)
            ),
        ),
        Family(
            "kimi_linear",
            args_check=lambda a: a.kda_layers == [0],
            model_check=lambda m: (
                [k for k, _ in _kinds(m)] == ["KimiDeltaAttention", "NopeLatentAttention"]
            ),
            synthetic=(
                ("kimi-tiny-fp32", "kimi-tiny-q4"),
                lambda m: m.args.model_type == "kimi_linear" and m.args.kda_layers == [0, 1, 2],
            ),
            gguf=gguf_kimi,
            gguf_check=lambda g, f: g.args.kda_layers == [0] and g.args.kda_heads == 5,
            refused={
                "qk_rope_head_dim": "latent attention needs positive qk_nope_head_dim, "
                "qk_rope_head_dim"
            },
        ),
        Family(
            "nemotron_h",
            synthetic=(
                ("nemotron-tiny-fp32", "nemotron-tiny-q4"),
                lambda m: m.args.model_type == "nemotron_h" and m.args.pattern == "ME*-",
            ),
            gguf_check=lambda g, f: g.args.pattern == "ME*-",
            **nemotron,
        ),
        Family("nemotron_g1", gguf_check=lambda g, f: g.args.pattern == "M*", **nemotron),
        Family(
            "kimi_k3",
            args_check=lambda a: a.kda_layers == [0, 2],
            model_check=lambda m: _kinds(m) == k3_kinds,
            synthetic=(
                ("kimi-k3-tiny-fp32", "kimi-k3-tiny-q4"),
                lambda m: m.args.model_type == "kimi_k3" and m.args.kda_layers == [0, 1, 2],
            ),
            gguf=gguf_k3,
            q8_last=True,
            gguf_check=lambda g, f: (
                (g.args.kda_layers, g.args.kda_heads, g.args.routed_expert_hidden_size)
                == ([0, 2], 5, 32)
                and g.args.mla_output_gate
                and g.args.latent_moe_norm
                and g.args.attn_res_block_size == 2
            ),
        ),
    ]
    assert [r.name for r in rows] == list(CONFIGS), "a row per fixture, in CONFIGS' order"
    return {r.name: r for r in rows}


FAMILIES = _rows()


def folders(tmp_path_factory, names=tuple(CONFIGS)) -> dict[str, Path]:
    """The fixtures' folders (`flagship_models`), written once per test run: under the
    run's base directory, which pytest-xdist's workers share (the first to need a family
    writes it, the others wait for it)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' basetemps are popen-gwN in the run's own
    return flagship_models(base / "families", names)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """llama_tp's greedy tokens after `prompt` (the engine's generate_step)."""
    from llama_tp.engine.generation import generate_step
    from llama_tp.engine.sampling import make_sampler

    return [int(t) for t, _ in generate_step(model, prompt, make_sampler(0.0), n)]


def greedy_mlx_lm(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's greedy tokens after `prompt` (its generate_step)."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda lp: lp.argmax(-1))
    return [int(t) for t, _ in steps]


def held_bytes(cache: list) -> tuple[int, int]:
    """(what the caches hold, their recurrent states alone) in bytes: a KV cache's keys and
    values of the tokens it keeps (a rotating one its window, a chunked one its chunk), a
    recurrent cache's arrays, a CacheList's parts; a layer without a cache (None) none."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    total = state = 0
    for c in cache:
        if isinstance(c, CacheList):
            t, s = held_bytes(c.caches)
            total, state = total + t, state + s
        elif isinstance(c, ArraysCache):
            n = sum(a.nbytes for a in c.cache if a is not None)
            total, state = total + n, state + n
        elif c is not None and c.keys is not None:
            n = c.offset - getattr(c, "start_position", 0)
            n = min(n, getattr(c, "max_size", None) or n)
            total += c.keys[..., :n, :].nbytes + c.values[..., :n, :].nbytes
    return total, state


def _args_class(config: dict):
    """mlx-lm's dataclass that reads `config`'s fields (a wrapper's text part's own)."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    names = {f.name for f in dataclasses.fields(module.ModelArgs)}
    text = getattr(module, "TextArgs", None)
    return text if "text_config" in names and text is not None else module.ModelArgs


def optional_fields(config: dict) -> tuple[list[str], list[str]]:
    """The fields of `config` (its `text_config` when it has one) that mlx-lm's class
    gives a default: (those whose default is a value, those whose default is None: a part
    of the model left out), less `REQUIRED` and the vocabulary's size."""
    inner = config.get("text_config", config)
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(_args_class(inner if "text_config" in config else config))
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    keys = [k for k in inner if k in defaults and k not in (*REQUIRED, "vocab_size")]
    keys = [k for k in keys if k != "model_type"]
    return [k for k in keys if defaults[k] is not None], [k for k in keys if defaults[k] is None]


def _without(config: dict, keys) -> dict:
    if "text_config" in config:
        return {**config, "text_config": _without(config["text_config"], keys)}
    return {k: v for k, v in config.items() if k not in keys}


def _builds(config: dict, size: int) -> bool:
    """mlx-lm's class builds a model of `config` of at most twice `size` parameters (not a
    default of a full-size model's width); nothing evaluated."""
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    try:
        model = module.Model(module.ModelArgs.from_dict(config))
    except Exception:  # noqa: BLE001 - a config mlx-lm's class does not take
        return False
    return sum(v.size for _, v in tree_flatten(model.parameters())) <= 2 * size


def _reference(config: dict, size: int):
    """mlx-lm's random model for `config` and its logits of the prompt, or None where its
    class refuses the config or its forward fails (`_builds` first)."""
    from flagship_writers import random_mlx_lm

    if not _builds(config, size):
        return None
    try:
        model = random_mlx_lm(config)
        logits = model(TOKENS[:, :12])
        mx.eval(logits)
    except Exception:  # noqa: BLE001 - a config mlx-lm's forward does not take
        return None
    return model, logits


def _running(config: dict, keys: list[str], size: int) -> tuple[list[str], Any]:
    """The most of `keys` (in order) left out together that mlx-lm's model still runs, and
    its `_reference`: all of them, or less each key whose addition makes the forward fail
    (found by bisecting the prefixes: a few forwards, not one per key)."""
    keys = list(keys)
    while keys:
        ref = _reference(_without(config, keys), size)
        if ref is not None:
            return keys, ref
        runs, fails = 0, len(keys)  # keys[:runs] runs (none: the fixture), keys[:fails] not
        while fails - runs > 1:
            mid = (runs + fails) // 2
            if _reference(_without(config, keys[:mid]), size) is None:
                fails = mid
            else:
                runs = mid
        del keys[fails - 1]
    return [], None


def variants(family: Family) -> list[tuple[str, dict, Any, mx.array]]:
    """The fixture's config with fields left out as mlx-lm's class accepts it: (label,
    config, mlx-lm's random model for it, its logits). First every field whose default is
    a value, left out together as far as the class builds and runs them (`_builds`,
    `_running`); then each field whose default is None, alone (the part of the model it
    describes left out)."""
    from flagship_writers import random_mlx_lm
    from mlx.utils import tree_flatten

    config = CONFIGS[family.name]
    size = sum(v.size for _, v in tree_flatten(random_mlx_lm(config).parameters()))
    values, nones = optional_fields(config)
    built = []
    for key in values:
        if _builds(_without(config, [*built, key]), size):
            built.append(key)
    dropped, last = _running(config, built, size)
    out = []
    if last is not None:
        out.append(("defaults of " + ",".join(dropped), _without(config, dropped), *last))
    for key in nones:
        ref = _reference(_without(config, [key]), size)
        if ref is not None:
            out.append((f"no {key}", _without(config, [key]), *ref))
    return out
