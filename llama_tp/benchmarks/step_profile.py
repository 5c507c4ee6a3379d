"""Where one decode step's time goes, on this rank: `python bench/step_profile.py`.

Measured on a warm cache (a 16-token prompt, then steps as `generate_step` runs them:
each step's graph built and started before the previous token is read):

- `step_ms`: wall time per token; `cpu_ms`: CPU time per token of the whole process,
  split by thread (`threads`): `main` (Python: building the graph, MLX dispatching its
  operations to the stream), `stream` (MLX's CPU stream: every operation's work), `pool`
  (the native kernels' other threads), `other` (the backend's socket threads, BLAS);
  `waiting`: by the same threads, the time they were ready to run with no core free
  (Linux's schedstat): where threads of the process (or other jobs) compete for cores.
  On a shared machine CPU time moves far less than wall time.
- `build_ms`: the main thread's CPU time building one step's graph (Python), and
  `dispatch_ms`: evaluating it asynchronously until control returns (MLX walks the graph
  and hands each operation to the stream; it waits whenever 100 are queued);
  `host_ms` = the main thread's CPU per token in the loop.
- `ops`: the operations (graph nodes) of one step, and the most frequent kinds.
- `native_ms`: wall time inside the native primitives per token, by kind (`qmatmul` =
  the quantized products), measured by the extension's own clock on the stream thread;
  `pool_wait`, the part of the products the stream thread spent waiting for chunks the
  kernels' other threads had taken (`native_calls`: calls per token, and the chunks those
  threads ran).
- `collectives_ms`: the step minus the same step with every collective replaced by the
  identity (`cluster.collectives`), on more than one rank; `rest_ms`: what is left of
  the step after the quantized products and the collectives.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import mlx.core as mx


def graph_ops(*outputs: mx.array) -> Counter:
    """The operations of the unevaluated graph behind `outputs`, by kind."""
    f = io.StringIO()
    mx.export_to_dot(f, *outputs)
    kinds = Counter()
    for line in f.getvalue().splitlines():
        if "shape=rectangle" in line:
            kinds[line.split('label ="', 1)[1].split('"', 1)[0]] += 1
    return kinds


def _thread_cpu() -> dict[int, tuple[int, int]]:
    """(CPU nanoseconds, nanoseconds runnable but waiting for a core) of every thread of
    this process (Linux's schedstat; empty elsewhere)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                run, wait = f.read().split()[:2]
            out[int(t)] = (int(run), int(wait))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _native():
    from ..kernels import native

    return native._ext if native.status().native else None


def _classify(before: dict, after: dict, main: int, which: int = 0) -> dict[str, float]:
    """CPU ns (`which` 0) or runnable-but-waiting ns (1) by thread kind between two
    `_thread_cpu` snapshots."""
    e = _native()
    stream, pool = e.thread_ids() if e is not None else (-1, [])
    kinds = {"main": 0, "stream": 0, "pool": 0, "other": 0}
    for tid, ns in after.items():
        d = ns[which] - before.get(tid, (0, 0))[which]
        kind = (
            "main" if tid == main else "stream" if tid == stream else "pool" if tid in pool else
            "other"
        )  # fmt: skip
        kinds[kind] += d
    return kinds


def run_steps(step: Callable[[], Any], n: int) -> dict[str, Any]:
    """Time `n` pipelined calls of `step()` (each returns once its token is read): wall,
    CPU by thread, main-thread CPU, native primitives' time; per step, milliseconds."""
    e = _native()
    main = threading.get_native_id()
    if e is not None:
        e.profile(True)
    cpu0, t_main0, t0 = _thread_cpu(), time.thread_time(), time.perf_counter()
    for _ in range(n):
        step()
    wall = time.perf_counter() - t0
    t_main = time.thread_time() - t_main0
    cpu1 = _thread_cpu()
    threads = _classify(cpu0, cpu1, main)
    waits = _classify(cpu0, cpu1, main, 1)
    native, counts = {}, {}
    if e is not None:
        native = {k: ns / 1e6 / n for k, calls, ns in e.profile_counts() if ns}
        counts = {k: calls / n for k, calls, _ in e.profile_counts() if calls}
        e.profile(False)
    return {
        "step_ms": 1e3 * wall / n,
        "cpu_ms": sum(threads.values()) / 1e6 / n,
        "threads": {k: v / 1e6 / n for k, v in threads.items()},
        "waiting": {k: v / 1e6 / n for k, v in waits.items()},  # runnable, no core free
        "host_ms": 1e3 * t_main / n,
        "native_ms": native,
        "native_calls": counts,  # per step; worker_chunks: chunks the pool's workers ran
    }


def profile_model(model: Any, group: mx.distributed.Group, steps: int = 32) -> dict[str, Any]:
    """This rank's per-step profile of greedy decoding with `model` (see the module)."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..cluster.collectives import collectives
    from ..cluster.distributed import barrier
    from ..engine.generation import decode_step, generate_step
    from ..engine.sampling import make_sampler, vocab_shard

    sampler = make_sampler(shard=vocab_shard(model))
    prompt = list(range(100, 116))

    def stepper(n: int):
        gen = generate_step(model, prompt, sampler, n + 8)
        for _ in range(8):  # prefill, first tokens: not timed
            next(gen)
        return lambda: next(gen)

    # one step's graph on a warm cache: its operations, its building and dispatching
    cache = make_prompt_cache(model)
    y, _, rows = decode_step(model, sampler, cache, mx.array(prompt, dtype=mx.int32))
    mx.eval(y, *([rows] if rows is not None else []))
    builds, dispatches, ops = [], [], None
    for _ in range(8):
        t = time.thread_time()
        out = decode_step(model, sampler, cache, y, rows)
        builds.append(time.thread_time() - t)
        targets = [out[0], *([out[2]] if out[2] is not None else [])]
        if ops is None:
            ops = graph_ops(*targets)
        t = time.thread_time()
        mx.async_eval(*targets)
        dispatches.append(time.thread_time() - t)
        mx.eval(*targets)
        y, rows = out[0], out[2]
    res: dict[str, Any] = {
        "ops": sum(ops.values()),
        "top_ops": dict(ops.most_common(8)),
        "build_ms": 1e3 * sorted(builds)[len(builds) // 2],
        "dispatch_ms": 1e3 * sorted(dispatches)[len(dispatches) // 2],
    }
    barrier(group)
    go = stepper(steps)
    res.update(run_steps(go, steps))
    qmm = res["native_ms"].get("qmatmul", 0.0)
    collective = 0.0
    if group.size() > 1:
        barrier(group)
        with collectives("identity"):
            go = stepper(steps)
            alone = run_steps(go, steps)
        barrier(group)
        collective = max(0.0, res["step_ms"] - alone["step_ms"])
        res["step_ms_no_collectives"] = alone["step_ms"]
    res["collectives_ms"] = collective
    res["qmatmul_ms"] = qmm
    res["rest_ms"] = max(0.0, res["step_ms"] - qmm - collective)
    return res


def count_instructions(model: Any, group: mx.distributed.Group, steps: int) -> None:
    """Under `valgrind --tool=callgrind --instr-atstart=no`: decode greedily and count the
    instructions of `steps` steady-state steps only (the extension switches callgrind's
    instrumentation on and off around them)."""
    from ..engine.generation import generate_step
    from ..engine.sampling import make_sampler, vocab_shard

    e = _native()
    sampler = make_sampler(shard=vocab_shard(model))
    gen = generate_step(model, list(range(100, 116)), sampler, steps + 16)
    for _ in range(8):
        next(gen)
    if e is not None:
        e.callgrind(True)
    for _ in range(steps):
        next(gen)
    if e is not None:
        e.callgrind(False)
    for _ in gen:  # the rest, so that every rank ends its collectives
        pass
