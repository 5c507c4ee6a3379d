"""The native kernels' weight bandwidth against reading memory (bench/cpu_kernels.py).

One matrix-vector product per format on ~130 MB of random weights (far over the
caches), and `read_bandwidth` (a plain read of 512 MB over the kernels' own threads),
at 1 and 2 threads, in turn; weight bytes (scales included) per second.
"""

from __future__ import annotations

import statistics
import time

FORMATS = ("Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K", "affine4")  # what the two files hold
# --formats may name any GGUF type the kernels compute, and affine4/G, affine8/G (MLX's
# layout, group G; "affine4" is group 64, an MLX-quantized checkpoint's)
WEIGHT_BYTES = 130 << 20


def bandwidth(rounds: int, formats: tuple[str, ...] = FORMATS, cpu_seconds: bool = False) -> dict:
    """GB/s of reading memory and of each format's product, at 1 and 2 threads (medians
    of `rounds`, and of each round's ratio to the read bandwidth). `cpu_seconds`: instead,
    each product's GB per second of CPU time on 1 thread (what other jobs on the machine
    change least: the kernel's own speed, not its share of the cores)."""
    import mlx.core as mx
    import numpy as np

    from llama_tp import kernels
    from llama_tp.kernels import GGUF_TYPES, native
    from llama_tp.kernels.blocks import random_blocks

    st = kernels.status()
    if not st.native:
        raise SystemExit(f"the native kernels are off: {st.reason}")
    ext = native.ext()
    rng = np.random.default_rng(0)
    k = 4096
    out = {"isa": ext.isa(), "read": {}, "formats": {}}
    products = {}
    for f in formats:
        if f.startswith("affine"):  # MLX 4- or 8-bit, group g
            bits, _, g = f.removeprefix("affine").partition("/")
            bits, g = int(bits), int(g or 64)
            rows = WEIGHT_BYTES // (k * bits // 8 + k // g * 4)
            w = rng.integers(0, 2**32, size=(rows, k * bits // 32), dtype=np.uint32)
            s = mx.array(rng.uniform(0.001, 0.01, (rows, k // g)).astype(np.float16))
            arrays = (mx.array(w), s, -(2 ** (bits - 1)) * s)
            nbytes = sum(a.nbytes for a in arrays)
            products[f] = (arrays, nbytes, dict(format=1000 + bits, group_size=g))
        else:
            code, per, size = GGUF_TYPES[f]
            rows = WEIGHT_BYTES // (k // per * size)
            w = mx.array(random_blocks(f, rows, k // per, rng))
            products[f] = ((w,), w.nbytes, dict(format=code))
    x = mx.array(rng.normal(size=(1, k)).astype(np.float16))
    mx.eval(x, *[a for arrays, _, _ in products.values() for a in arrays])
    if cpu_seconds:  # 1 thread, weight bytes per second of this process's CPU time
        ext.set_threads(1)
        for f, (arrays, nbytes, kw) in products.items():
            times = []
            for _ in range(12):
                tic = time.process_time()
                mx.eval(ext.qmatmul(x, *arrays, **kw))
                times.append(time.process_time() - tic)
            out["formats"][f] = {"cpu_1": nbytes / statistics.median(times[2:]) / 1e9}
        return out
    runs: dict[str, list[float]] = {}
    for i in range(rounds):  # read and products in turn, the order reversed every round
        jobs = [(t, f) for t in (1, 2) for f in ("read", *products)]
        for t, f in jobs if i % 2 == 0 else jobs[::-1]:
            ext.set_threads(t)
            if f == "read":
                gbs = ext.read_bandwidth(512 << 20, 5)
            else:
                arrays, nbytes, kw = products[f]
                times = []
                for _ in range(12):
                    tic = time.perf_counter()
                    mx.eval(ext.qmatmul(x, *arrays, **kw))
                    times.append(time.perf_counter() - tic)
                gbs = nbytes / statistics.median(times[2:]) / 1e9
            runs.setdefault(f"{f}|{t}", []).append(gbs)
    for t in (1, 2):
        out["read"][t] = statistics.median(runs[f"read|{t}"])
        for f in products:
            ratios = [a / b for a, b in zip(runs[f"{f}|{t}"], runs[f"read|{t}"], strict=True)]
            out["formats"].setdefault(f, {})[t] = statistics.median(runs[f"{f}|{t}"])
            out["formats"][f][f"of_read_{t}"] = statistics.median(ratios)
    return out
