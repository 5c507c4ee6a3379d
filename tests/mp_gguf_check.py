"""Run on 1 rank or under mlx.launch: GGUF files loaded in slices against gguf-py.

    mlx.launch -n 2 -- python tests/mp_gguf_check.py A.gguf B.gguf ...

For each file, every rank loads its slices (quantized), dequantizes each of its
weights and compares it with the same slice of `gguf.quants.dequantize` of the
whole tensor: within float16 rounding of each group's scale and bias products for
the types converted exactly, within half a step of the new grid for the requantized
ones ("worst" is the largest error / allowed error, per type: at most 1). Then it loads the file
again on the float32 path and computes logits (a prefill and cached steps) and a
greedy continuation. Rank 0 prints one JSON line per file: errors, every rank's
bytes read and peak memory, the logits and the tokens.
"""

from __future__ import annotations

import json
import sys

import gguf
import mlx.core as mx
import numpy as np
from gguf.quants import dequantize
from mp_check_logits import logits_of

from llama_tp.checkpoints import gguf_quants as gq
from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model
from llama_tp.cluster.distributed import all_gather_object
from llama_tp.engine.generation import generate_step
from llama_tp.engine.sampling import make_sampler, vocab_shard
from llama_tp.loading.loader import load_model
from llama_tp.parallel.partition import tensor_slice, vocab_ranges
from llama_tp.parallel.shard import plan_for


def reference(path: str) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (type name, float32 values in (rows, cols)), by gguf-py."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        out[t.name] = (t.tensor_type.name, values.reshape(tuple(reversed(t.shape.tolist()))))
    return out


def check_weights(path: str, world: mx.distributed.Group) -> tuple[dict, dict]:
    """(worst error / allowed, per type), this rank's load stats."""
    n, rank = world.size(), world.rank()
    ref = reference(path)
    plan = plan_for(build_model(open_checkpoint(path), whole=False), n) if n > 1 else None
    model, ckpt = load_model(path, world)
    vocab = vocab_ranges(model.args.vocab_size, n)[rank] if n > 1 else None
    modules = dict(model.named_modules())
    worst: dict[str, float] = {}
    for name, (_, stored) in ckpt.sources.items():
        if not stored.endswith(".weight"):
            continue
        kind, values = ref[stored]
        part = plan.parts[rank] if plan else None
        s = tensor_slice(plan, part, name, values.shape, vocab) if plan else None
        if s is not None:
            axis, a, b = s
            values = values[a:b] if axis == 0 else values[:, a:b]
        module = modules[name.removesuffix(".weight")]
        if hasattr(module, "scales"):
            got = mx.dequantize(
                module.weight,
                module.scales.astype(mx.float32),
                module.biases.astype(mx.float32),
                group_size=module.group_size,
                bits=module.bits,
            )
            scales = np.abs(np.array(module.scales.astype(mx.float32))).reshape(-1)
            biases = np.abs(np.array(module.biases.astype(mx.float32))).reshape(-1)
            if kind in gq.REQUANT_BITS:  # q was fitted to the float16 scale and bias
                allowed = scales / 2 * 1.001 + 1e-7
            else:  # float16 rounding of the scale and bias products
                allowed = 2**-11 * (scales * ((1 << module.bits) - 1) + biases) * 1.01 + 6e-8
        elif getattr(module, "type_name", None):  # GGUF blocks as stored (native kernels)
            from llama_tp.kernels import gguf_dequantize

            lead = getattr(module, "lead", 0)
            got = gguf_dequantize(
                module.weight, module.type_name, lead, values.shape[1], mx.float32
            )
            # the file's values, up to float32 rounding of the scale products
            allowed = np.abs(values).reshape(-1, gq.GROUP).max(axis=1) * 2e-6 + 1e-9
        else:
            got, allowed = module.weight.astype(mx.float32), np.zeros(values.size // gq.GROUP)
        err = np.abs(np.array(got).reshape(-1, gq.GROUP) - values.reshape(-1, gq.GROUP))
        ratio = float((err.max(axis=1) / np.maximum(allowed, 1e-30)).max()) if err.max() else 0.0
        worst[kind] = max(worst.get(kind, 0.0), ratio)
    return worst, ckpt.load_stats


def main() -> int:
    world = mx.distributed.init()
    for path in sys.argv[1:]:
        worst, stats = check_weights(path, world)
        model, _ = load_model(path, world, dtype="float32")
        vocab = model.args.vocab_size
        x = mx.array(np.random.default_rng(0).integers(0, vocab, (1, 8)), mx.int32)
        logits = logits_of(model, x)
        sampler = make_sampler(0.0, shard=vocab_shard(model))
        tokens = [t for t, _ in generate_step(model, [1, 2, 3, 4], sampler, 6)]
        del model  # not counted in the next file's peak
        everyone = all_gather_object((worst, stats), world)
        if world.rank() == 0:
            line = {
                "path": path,
                "worst": [w for w, _ in everyone],
                "bytes_read": [s["bytes_read"] for _, s in everyone],
                "peak_memory": [s["peak_memory"] for _, s in everyone],
                "logits": logits.tolist(),
                "tokens": [int(t) for t in tokens],
            }
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
