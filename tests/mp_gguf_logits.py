"""Run on 1 rank or under mlx.launch: a GGUF file loaded as a user loads it (quantized,
in slices), its logits for fixed tokens and what each rank read.

    mlx.launch -n 2 -- python tests/mp_gguf_logits.py A.gguf B.gguf ...

Rank 0 prints one JSON line per file: the tokens, the logits (L, vocab) of a prefill and
three cached steps, and every rank's bytes read and peak memory while loading.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
from mp_check_logits import logits_of

from llama_tp.cluster.distributed import all_gather_object
from llama_tp.loading.loader import load_model


def main() -> int:
    world = mx.distributed.init()
    for path in sys.argv[1:]:
        model, ckpt = load_model(path, world)
        tokens = np.random.default_rng(0).integers(0, model.args.vocab_size, 12).tolist()
        logits = logits_of(model, mx.array([tokens], mx.int32))
        stats = all_gather_object(ckpt.load_stats, world)
        del model
        if world.rank() == 0:
            line = {
                "path": path,
                "tokens": tokens,
                "logits": logits.tolist(),
                "bytes_read": [s["bytes_read"] for s in stats],
                "peak_memory": [s["peak_memory"] for s in stats],
            }
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
