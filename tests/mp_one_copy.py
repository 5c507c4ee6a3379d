"""Run on ranks some of which cannot see the models: load each case of a spec, check the
ranks agree, generate greedily, and print one JSON line per case from rank 0.

    python tests/mp_one_copy.py SPEC.json      # on every rank (tests/test_one_copy.py)

SPEC: {"cases": [{"name", "model", "options": {load_model's keywords}, "cache": DIR,
"tokens": N, "damage": RANK}]}. A case's line: {"name", "tokens", "ranks": [per rank:
load_stats, a CRC-32 of every weight it holds, its largest tensor's bytes]}, or
{"name", "error": the first line of the error every rank raised}. "damage": that rank
flips a byte in the middle of each of its cached weight files first.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from llama_tp.checkpoints.tokenizer import load_tokenizer
from llama_tp.checkpoints.weights_cache import wait_for_writes
from llama_tp.checks.weights import check_weights
from llama_tp.cluster.distributed import all_gather_object, first_line
from llama_tp.engine.generation import stream_generate
from llama_tp.loading.agreement import check_agreement
from llama_tp.loading.loader import load_model


def damage(cache: Path) -> list[str]:
    hit = []
    for f in sorted(cache.glob("*/slices-*/weights-*.safetensors")):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
        hit.append(f.name)
    return hit


def run_case(case: dict, group) -> dict:
    rank, cache = group.rank(), Path(case["cache"])
    if case.get("doctor"):  # the doctor's weights row, as `doctor --model` prints it
        report: dict = {}
        check = check_weights(group, report, case["model"], quick=True, weights_cache=cache)
        return {"name": case["name"], "doctor": [check.status, check.detail]}
    damaged = damage(cache) if case.get("damage") == rank else []
    model, ckpt = load_model(case["model"], group, weights_cache=case["cache"], **case["options"])
    stats = dict(ckpt.load_stats)
    tokenizer = load_tokenizer(ckpt)
    check_agreement(model, ckpt, tokenizer, group)
    params = tree_flatten(model.parameters())
    crc = 0
    for _, v in params:
        crc = zlib.crc32(memoryview(mx.contiguous(v)), crc)
    ids = tokenizer.encode("hi")
    wait_for_writes()  # the cache is written behind the load
    tokens = [
        r.token
        for r in stream_generate(model, tokenizer, ids, max_tokens=case["tokens"], group=group)
    ]
    mine = {
        "stats": stats,
        "crc": crc,
        "largest": max(v.nbytes for _, v in params),
        "damaged": damaged,
        "cache_files": sorted(
            str(p.relative_to(case["cache"])) for p in Path(case["cache"]).rglob("*")
        ),
    }
    return {"name": case["name"], "tokens": tokens, "ranks": all_gather_object(mine, group)}


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    group = mx.distributed.init()
    for case in spec["cases"]:
        try:
            out = run_case(case, group)
        except Exception as e:  # the loader raises on every rank alike
            out = {"name": case["name"], "error": first_line(e)}
        if group.rank() == 0:
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
