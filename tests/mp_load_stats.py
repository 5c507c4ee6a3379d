"""Run under mlx.launch: load a checkpoint and print every rank's load accounting.

    mlx.launch -n 2 -- python tests/mp_load_stats.py DIR

Rank 0 prints one JSON line: a list, per rank, of the loader's `load_stats`
plus `rchar`, the bytes the process read through system calls meanwhile
(Linux /proc/self/io: an independent count of the same reads), for a second load.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx

from llama_tp.cluster.distributed import all_gather_object
from llama_tp.loading.loader import load_model


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def main() -> int:
    group = mx.distributed.init()
    # A first load imports the modules the loader imports lazily: their files' reads
    # would count in rchar, and only the second load's reads are measured.
    load_model(sys.argv[1], group)
    before = rchar()
    _, ckpt = load_model(sys.argv[1], group)
    stats = dict(ckpt.load_stats, rchar=rchar() - before)
    everyone = all_gather_object(stats, group)
    if group.rank() == 0:
        print(json.dumps(everyone), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
