"""A float16 / bfloat16 product as MLX computes it on the CPU, and cut over its CPU streams
(llama_tp/kernels/float_products.py), side by side in one process.

    python bench/float_products.py                 # 5632 x 2048 float16 (the 0.5B's down)
    python bench/float_products.py --rows 11264 --cols 2048 --dtype bfloat16 --queries 7

Each round times `--reps` decode products of both kinds in turn; the table gives the
medians over the rounds and whether the outputs are bit-equal.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from llama_tp import kernels
from llama_tp.kernels.float_products import float_matmul, parts_for


def _time(f, reps: int) -> float:
    mx.eval(f())
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(f())
    return (time.perf_counter() - t) / reps * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=5632, help="output rows of the weight")
    ap.add_argument("--cols", type=int, default=2048, help="input columns of the weight")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    ap.add_argument("--queries", type=int, default=1, help="rows of x (1: a decode step)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    dtype = getattr(mx, a.dtype)
    w = (mx.random.normal((a.rows, a.cols)) * 0.05).astype(dtype)
    x = mx.random.normal((1, a.queries, a.cols)).astype(dtype)
    mx.eval(w, x)
    one, cut = [], []
    for _ in range(a.rounds):
        one.append(_time(lambda: x @ w.T, a.reps))
        cut.append(_time(lambda: float_matmul(x, w), a.reps))
    equal = mx.array_equal(x @ w.T, float_matmul(x, w)).item()
    m1, m2 = statistics.median(one), statistics.median(cut)
    st = kernels.status()
    rows = f"{a.queries} quer{'y' if a.queries == 1 else 'ies'}"
    print(
        f"{a.rows} x {a.cols} {a.dtype}, {rows}; kernel threads {st.threads} (native: {st.native})"
    )
    print("| product | ms (median) | parts |\n| --- | --- | --- |")
    print(f"| MLX's, one stream | {m1:.2f} | 1 |")
    print(f"| cut over CPU streams | {m2:.2f} | {parts_for(w)} |")
    print(f"speed-up {m1 / m2:.2f}x; bit-equal: {'yes' if equal else 'NO'}")


if __name__ == "__main__":
    main()
