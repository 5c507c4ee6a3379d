"""Run under mlx.launch: loads that fail, each the same way on every rank, in one launch.

    mlx.launch -n 4 -- python tests/mp_load_errors.py '{"model": "DIR", "pp": 4}' ...

Each argument is a JSON object: "model" (the path) and `load_model`'s keyword
arguments. Every rank tries the loads in turn (a failed load raises on every rank,
so the next one starts together); rank 0 prints one JSON line per load: each rank's
[exception type, first line of its message], or null where a rank loaded.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx

from llama_tp.cluster.distributed import all_gather_object
from llama_tp.loading.loader import load_model


def main() -> int:
    world = mx.distributed.init()
    for spec in sys.argv[1:]:
        kw = json.loads(spec)
        outcome = None
        try:
            load_model(kw.pop("model"), world, **kw)
        except Exception as e:
            outcome = [type(e).__name__, str(e).strip().splitlines()[0]]
        ranks = all_gather_object(outcome, world)
        if world.rank() == 0:
            print(json.dumps(ranks), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
