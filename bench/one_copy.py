"""One copy of the model: load time with the model on rank 0 only, beside every rank having it.

    .venv/bin/python bench/one_copy.py            # its section of docs/benchmarks.md

Two ranks (the ring backend over 127.0.0.1, as mlx.launch starts them); rank 1 runs in
its own mount namespace (`unshare -m`, needs root) where the models folder is empty, so
it cannot read the model and receives its slices from rank 0. One launch, alternating
per trial: *all-local* (both ranks read a hard-linked copy every rank sees), *one copy*
(rank 1's cache emptied first: everything over the link, then cached behind the load)
and *cached* (the second start, once the first's cache is written: rank 1 reads it),
each trial after the bus bandwidth of a 16 MB all-reduce as `python -m llama_tp.doctor`
measures it on this link, to which the transfer rate (bytes received / seconds of the
transfer, on rank 1) is compared. Load time: the slowest rank's `load_model` wall time;
medians of the trials.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from llama_tp.benchmarks.sections import PAGE, facts_line, replace_section, run_facts, write_results

NAME = "one-copy"
ROOT = Path(__file__).resolve().parent.parent
HIDE = 'mount -t tmpfs tmpfs "$0" && exec "$@"'


def worker(spec: dict) -> None:
    """One rank: the trials; rank 0 prints the results as one JSON line."""
    import gc

    import mlx.core as mx

    from llama_tp.checkpoints.weights_cache import wait_for_writes
    from llama_tp.cluster.diagnostics import time_all_reduce
    from llama_tp.cluster.distributed import all_gather_object, barrier
    from llama_tp.loading.loader import load_model

    group = mx.distributed.init()
    rank = group.rank()
    cache = Path(spec["cache"])

    def load(path: str) -> dict:
        barrier(group)
        tic = time.perf_counter()
        model, ckpt = load_model(path, group, weights_cache=cache)
        seconds = time.perf_counter() - tic
        stats = dict(ckpt.load_stats, wall=seconds)
        del model, ckpt
        gc.collect()
        mx.clear_cache()
        return all_gather_object(stats, group)

    load(spec["shared"])  # warm the page cache (and the imports)
    trials = []
    for _ in range(spec["trials"]):  # each trial side by side: the machine may be shared
        bus = time_all_reduce(group, 16 << 20)["bus_gbps"]
        local = load(spec["shared"])
        if rank == 1:
            shutil.rmtree(cache, ignore_errors=True)
        barrier(group)
        copy = load(spec["hidden"])
        wait_for_writes()  # as the first start's command does before it exits
        cached = load(spec["hidden"])
        trials.append({"bus_gbps": bus, "local": local, "copy": copy, "cached": cached})
    if rank == 0:
        print(json.dumps({"trials": trials}), flush=True)


def launch(spec_path: Path, hidden: Path, port: int) -> dict:
    """The two ranks, rank 1 without the models folder; rank 0's JSON line."""
    hostfile = spec_path.with_suffix(".hosts.json")
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        cmd = [sys.executable, __file__, "--worker", str(spec_path)]
        if rank == 1:
            cmd = ["unshare", "-m", "sh", "-c", HIDE, str(hidden), *cmd]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True))
    out = procs[0].communicate(timeout=3600)[0]
    procs[1].wait(timeout=60)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines or any(p.returncode for p in procs):
        raise RuntimeError(f"the ranks failed: {[p.returncode for p in procs]}\n{out[-2000:]}")
    return json.loads(lines[-1])


def summary(res: dict) -> dict:
    """Medians over the trials of each figure, and of each trial's own ratios."""

    def slowest(run: list[dict]) -> float:
        return max(s["wall"] for s in run)

    rows = []
    for t in res["trials"]:
        got = t["copy"][1]
        row = {k: slowest(t[k]) for k in ("local", "copy", "cached")}
        row["rate_gbps"] = got["bytes_received"] / got["transfer_seconds"] / 1e9
        row["bus_gbps"] = t["bus_gbps"]
        row["rate_ratio"] = row["rate_gbps"] / row["bus_gbps"]
        row["copy_ratio"] = row["copy"] / row["local"]
        row["cached_ratio"] = row["cached"] / row["local"]
        rows.append(row)
    out = {k: median(r[k] for r in rows) for k in rows[0]}
    first = res["trials"][0]["copy"][1]
    out["bytes_received"], out["share"] = first["bytes_received"], first["placement_bytes"]
    out["trials"] = rows
    return out


def report(spec: str, s: dict, res: dict) -> str:
    n = len(s["trials"])
    lines = [
        "### One copy of the model: 2 ranks, the model on rank 0 only",
        "",
        f"Regenerate with `.venv/bin/python bench/one_copy.py` ({spec}: rank 1 receives "
        f"{s['bytes_received'] / 1e6:.1f} MB, its share as `plan` prints it, "
        f"{s['share'] / 1e6:.1f} MB). {facts_line(res)} Load average at the start: "
        f"{res['load']}. Each trial runs the four side by side; medians of {n} trials "
        "(of each trial's own ratios for the ratios).",
        "",
        "| load | seconds | / all-local |",
        "|---|---|---|",
        f"| all-local (every rank reads the file) | {s['local']:.2f} | 1.00 |",
        f"| one copy (rank 1 receives, then caches) | {s['copy']:.2f} | {s['copy_ratio']:.2f} |",
        f"| cached second start (rank 1 reads its cache) | {s['cached']:.2f} | "
        f"{s['cached_ratio']:.2f} |",
        "",
        f"Transfer rate: {s['rate_gbps'] * 1000:.0f} MB/s received by rank 1, against a bus "
        f"bandwidth of {s['bus_gbps'] * 1000:.0f} MB/s for a 16 MB all-reduce on the same "
        f"link (`doctor`'s figure, timed just before): {s['rate_ratio']:.2f} of it. Each trial:",
        "",
        "| trial | all-local s | one copy s | cached s | received MB/s | all-reduce MB/s "
        "| rate / all-reduce | cached / all-local |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(s["trials"], 1):
        lines.append(
            f"| {i} | {r['local']:.2f} | {r['copy']:.2f} | {r['cached']:.2f} | "
            f"{r['rate_gbps'] * 1000:.0f} | {r['bus_gbps'] * 1000:.0f} | {r['rate_ratio']:.2f} "
            f"| {r['cached_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--synthetic", default="0.5b-fp16", help="the checkpoint (default %(default)s)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--dir", default=str(Path.home() / ".cache/llama_tp/one_copy"))
    p.add_argument("--port", type=int, default=47100)
    p.add_argument("--out", default=str(PAGE), help="the page whose section to rewrite")
    args = p.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return 0
    from llama_tp.benchmarks.synthetic import synthetic_dir

    src = synthetic_dir(args.synthetic)
    base = Path(args.dir)
    shutil.rmtree(base, ignore_errors=True)
    for where in ("models", "shared"):
        shutil.copytree(src, base / where / "model", copy_function=os.link)
    spec = {
        "hidden": str(base / "models" / "model"),
        "shared": str(base / "shared" / "model"),
        "cache": str(base / "cache"),
        "trials": args.trials,
    }
    spec_path = base / "spec.json"
    spec_path.write_text(json.dumps(spec))
    load = open("/proc/loadavg").read().split()[:3]
    res = {**run_facts("bench/one_copy.py"), "load": " ".join(load), "spec": args.synthetic}
    res.update(launch(spec_path, base / "models", args.port))
    res["summary"] = summary(res)
    print(json.dumps(res["summary"], indent=1), file=sys.stderr)
    write_results(NAME, res)
    replace_section(NAME, report(args.synthetic, res["summary"], res), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
