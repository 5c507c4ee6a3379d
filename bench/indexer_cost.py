"""The replicated indexer's share of a decode step (docs/sparse-attention.md).

    python bench/indexer_cost.py [P]

The synthetic deepseek-v32-fp32 in one process at a context of P tokens (default 512): a
whole decode step of the model against its layers' indexers alone on the same shapes
(each layer's indexer over a cache of P keys), medians of 10 after 2 warm-ups.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from llama_tp.benchmarks.synthetic import synthetic_dir
from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model


def timed(step: Callable[[], None], caches: list, runs: int = 12) -> float:
    """Median seconds of `step` (each followed by one token trimmed from `caches`)."""
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        for c in caches:
            c.trim(1)
    return sorted(times[2:])[(runs - 2) // 2]


def main() -> int:
    P = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    model = build_model(open_checkpoint(synthetic_dir("deepseek-v32-fp32")))
    a = model.args
    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, a.vocab_size, (1, P), key=mx.random.key(0)), cache=cache))
    token = mx.array([[5]])
    step = timed(lambda: mx.eval(model(token, cache=cache)), cache)
    indexers = [layer.attention.indexer for layer in model.layers]
    x = mx.random.normal((1, 1, a.dim))
    qr = mx.random.normal((1, 1, a.q_lora_rank))
    keys = []
    for _ in indexers:
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 1, P, a.index_head_dim)), mx.zeros((1, 1, P, 0)))
        keys.append(c)
    mx.eval([c.keys for c in keys])
    alone = timed(
        lambda: mx.eval([f(x, qr, None, cache=c) for f, c in zip(indexers, keys, strict=True)]),
        keys,
    )
    print(
        f"context {P}: decode step {1000 * step:.2f} ms, its {len(indexers)} indexers alone "
        f"{1000 * alone:.2f} ms ({100 * alone / step:.1f}%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
