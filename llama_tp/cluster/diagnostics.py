"""The doctor's checks that need no model: backend, ranks and versions, BLAS, all-reduce timing.

`python -m llama_tp.doctor` runs them with the sharded-logits check and prints the report.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from . import watchdog
from .distributed import agree_ok, all_gather_object, launched_backend

SLOW_MATMUL_S = 0.15  # 1024^3 fp32 multiply-adds: reference BLAS ~0.4 s here, OpenBLAS ~0.03 s
VERSION_KEYS = ("python", "mlx", "mlx-lm", "llama_tp")


def backend_name(group: mx.distributed.Group) -> str:
    """The backend behind `group`, told from what mlx.launch (or mpirun) put in the
    environment, tried in the order `mx.distributed.init(backend="any")` tries them."""
    if group.size() == 1:
        return "single process"
    return launched_backend() or "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def rank_info(group: mx.distributed.Group) -> dict[str, Any]:
    """This rank's identity and versions (gathered to describe every rank)."""
    return {
        "rank": group.rank(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx-lm": _version("mlx-lm"),
        "llama_tp": llama_tp_version(),
    }


def version_differences(infos: list[dict[str, Any]]) -> list[str]:
    """One text per version that differs: e.g. 'mlx (rank 0: 0.32.4, rank 1: 0.31.0)'."""
    out = []
    for key in VERSION_KEYS:
        if len({i[key] for i in infos}) > 1:
            per_rank = ", ".join(f"rank {i['rank']}: {i[key]}" for i in infos)
            out.append(f"{key} ({per_rank})")
    return out


def matmul_seconds(n: int = 1024, repeats: int = 3, warmup: bool = True) -> float:
    """Best time of an (n, n) @ (n, n) fp32 product on the CPU. The reference BLAS is
    10x slower than OpenBLAS, more than a warm-up changes (--quick skips it)."""
    a = mx.random.normal((n, n), key=mx.random.key(0), stream=mx.cpu)
    b = mx.random.normal((n, n), key=mx.random.key(1), stream=mx.cpu)
    mx.eval(a, b)
    if warmup:
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
    best = math.inf
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - tic)
    return best


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def time_all_reduce(
    group: mx.distributed.Group, nbytes: int, quick: bool = False
) -> dict[str, float | int]:
    """Median and p90 latency (slowest rank per iteration) and bus bandwidth of an fp32
    all_sum of `nbytes`. Every rank runs the same number of iterations: each times one
    call after the warm-up and they agree on the slowest (all_max) to size the loop."""
    n = group.size()
    x = mx.full((max(1, nbytes // 4),), float(group.rank() + 1), stream=mx.cpu)
    mx.eval(x)

    def once() -> tuple[mx.array, float]:
        tic = time.perf_counter()
        y = mx.distributed.all_sum(x, group=group, stream=mx.cpu)
        mx.eval(y)
        return y, time.perf_counter() - tic

    warmup, budget, lo, hi = (1, 0.05, 3, 10) if quick else (3, 0.5, 5, 200)
    for _ in range(warmup):
        y, _ = once()
    expected = n * (n + 1) / 2
    if not mx.all(y == expected).item():
        got = mx.max(mx.abs(y - expected)).item()
        raise RuntimeError(f"all_sum of {nbytes} B is wrong: off by up to {got:g}")
    _, probe = once()
    slowest = mx.distributed.all_max(mx.array(probe), group=group, stream=mx.cpu).item()
    iters = int(min(hi, max(lo, budget / max(slowest, 1e-9))))
    times = [once()[1] for _ in range(iters)]
    per_iter = sorted(max(ts) for ts in zip(*all_gather_object(times, group), strict=True))
    median = _percentile(per_iter, 0.5)
    return {
        "bytes": x.nbytes,
        "iterations": iters,
        "median_us": median * 1e6,
        "p90_us": _percentile(per_iter, 0.9) * 1e6,
        # NCCL's convention: what each link carries in a ring all-reduce, per second.
        "bus_gbps": x.nbytes / median * 2 * (n - 1) / n / 1e9,
    }


def blas_on_this_rank(quick: bool) -> dict[str, Any]:
    """The BLAS library MLX calls (`llama_tp.blas`), an installed OpenBLAS, the 1024x1024
    matmul time, and whether this is the slow reference BLAS: by the library where it
    can be told (Linux), else by the time."""
    from . import blas

    info = blas.check(measure=False)
    seconds = matmul_seconds(1024, 1 if quick else 3, warmup=not quick)
    slow = info.reference or (info.library is None and seconds > SLOW_MATMUL_S)
    return {"library": info.library, "openblas": info.openblas, "seconds": seconds, "slow": slow}


def llama_tp_version() -> str:
    """llama_tp's installed version, from its package metadata."""
    return _version("llama_tp")


@dataclass
class Check:
    name: str
    status: str  # "ok", "warn" (reported, not a failure), "FAILED", "n/a"
    detail: str


def run_check(name: str, fn: Callable[[], Any], group: mx.distributed.Group) -> tuple[Any, str]:
    """fn() on every rank: (its value, "") or (None, the error), alike on every rank (a
    failure on any rank is one on all: `agree_ok`). Under mlx.launch the watchdog ends
    a rank whose check makes no progress (a stopped peer blocks collectives for ever)."""
    with watchdog.stage(f"doctor check {name!r}"):
        try:
            value, error = fn(), None
        except Exception as e:  # the check's outcome, on every rank
            value, error = None, e
        try:
            agree_ok(error, group)
        except Exception as e:
            text = str(e).strip().splitlines()
            return None, text[0] if text else type(e).__name__
        return value, ""


def text_table(rows: list, right: bool = False) -> list[str]:
    """Rows of strings as aligned lines (two spaces between columns; `right`: flush right)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    just = str.rjust if right else str.ljust
    return ["  ".join(just(v, w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
