"""The mlx-lm side of `python -m llama_tp.bench --compare mlx-lm`.

mlx-lm loads the same weights from a Hugging Face / MLX directory (a GGUF file
is converted first with `llama_tp.convert`, into a temporary directory) and
runs its own generation loop, `mlx_lm.generate.generate_step`, with a greedy
sampler and no end-of-sequence check. On N > 1 ranks it is mlx-lm's own
tensor-parallel model (`mlx_lm.utils.sharded_load`, as `mlx_lm.benchmark`
does), where mlx-lm supports the configuration: its `shard` splits the query
and KV heads evenly, so both head counts must be multiples of N. When llama_tp ran
N pipeline stages (`--pp N`), it is mlx-lm's own pipeline (`pipeline_load`: the
model's `pipeline()`, which a folder needs a `model.safetensors.index.json` for).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..cluster.distributed import all_gather_object, barrier, broadcast_object, first_line


def hf_dir(path: Path, group: mx.distributed.Group) -> tuple[Path, Path | None]:
    """A directory mlx-lm can load for `path`, and a temporary directory to remove (or None).

    Rank 0 converts a GGUF file; a rank that cannot see rank 0's directory
    (another machine) converts its own.
    """
    from ..checkpoints.convert import convert_gguf

    if path.is_dir():
        return path, None
    made = None
    if group.rank() == 0:
        made = Path(tempfile.mkdtemp(prefix="llama_tp-bench-"))
        convert_gguf(path, made, progress=False)
    out = Path(broadcast_object(str(made) if made else None, group))
    barrier(group)
    if not (out / "config.json").is_file():
        made = out = Path(tempfile.mkdtemp(prefix="llama_tp-bench-"))
        convert_gguf(path, made, progress=False)
    return out, made


def unsupported_reason(directory: Path, n: int, pipeline: bool = False) -> str | None:
    """Why mlx-lm cannot shard this model over `n` ranks (by tensor, or `pipeline` stages),
    or None."""
    if n == 1 or pipeline:  # sharded_load itself says when a model has no pipeline()
        return None
    config = json.loads((directory / "config.json").read_text())
    heads = config.get("num_attention_heads", 0)
    kv = config.get("num_key_value_heads", heads)
    if heads % n or kv % n:
        return f"not supported by mlx-lm: {heads} query / {kv} KV heads do not split over {n} ranks"
    return None


def run_mlx_lm(
    args: Any, path: Path, group: mx.distributed.Group, prompt: list[int], pipeline: bool = False
) -> dict:
    """mlx-lm's trials on the same weights and prompt, or {"supported": False, "reason": ...}.
    `pipeline`: mlx-lm's own pipeline stages over the ranks (`pipeline_load`: the model's
    `pipeline()`, as llama_tp's `--pp N` on N ranks), else its tensor split."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step, generation_stream
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import sharded_load

    from ..cluster.collectives import count_step
    from .runner import run_trials, timed

    directory, made = hf_dir(path, group)
    try:
        reason = unsupported_reason(directory, group.size(), pipeline)
        if reason:
            return {"supported": False, "reason": reason}
        mx.reset_peak_memory()
        tic = time.perf_counter()
        model = error = None
        try:
            if group.size() > 1 and pipeline:
                model, _ = sharded_load(str(directory), group, None)
            elif group.size() > 1:
                model, _ = sharded_load(str(directory), None, group)
            else:
                model, _ = load(str(directory))
        except Exception as e:  # noqa: BLE001 - reported as "not supported" on every rank
            error = f"{type(e).__name__}: {first_line(e)}"
        errors = [e for e in all_gather_object(error, group) if e]
        if errors:
            return {"supported": False, "reason": f"not supported by mlx-lm: {errors[0]}"}
        load_s = time.perf_counter() - tic
        load_peak = mx.get_peak_memory() / 1e9

        def sampler(logprobs: mx.array) -> mx.array:
            return mx.argmax(logprobs, axis=-1)

        def trial():
            steps = generate_step(
                mx.array(prompt),
                model,
                max_tokens=args.generation_tokens,
                sampler=sampler,
                prefill_step_size=args.prefill_step_size,
            )
            return timed(steps, len(prompt), generation_stream)

        res = run_trials(trial, args.num_trials, "mlx-lm")
        peaks = all_gather_object((load_peak, res["peak_memory_gb"]), group)
        res.update(
            supported=True,
            load_time_s=load_s,
            load_peak_memory_gb=[p[0] for p in peaks],
            peak_memory_gb=[p[1] for p in peaks],
        )
        y = mx.array([[1]], dtype=mx.int32)
        res["collectives"] = count_step(
            lambda: sampler(model(y, cache=make_prompt_cache(model))[:, -1, :])
        )
        return res
    finally:
        barrier(group)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
