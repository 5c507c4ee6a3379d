"""The native attention primitive alone: microseconds a call for one decode query.

    python bench/attention.py                       # 64 and 600 keys, 1 and 2 threads
    python bench/attention.py --ext /path/to/_ext.cpython-311-x86_64-linux-gnu.so

9 query heads over 3 KV heads of 64 (the built-in model's), one query position, keys
read from a longer cache buffer as the decode step reads them; the best of 5 runs of 300
calls each (evaluated one by one, so the call's own dispatch is included: about 60 us
here). `--ext`: another build of the extension (e.g. an older checkout's, from
~/.cache/llama_tp/kernels/), for before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import mlx.core as mx


def load(path: str | None):
    if path is None:
        from llama_tp.kernels import native

        return native.ext()
    spec = importlib.util.spec_from_file_location("llama_tp.kernels._ext", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--keys", type=int, nargs="+", default=[64, 600])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--ext", help="the extension module to time (default: this checkout's)")
    args = p.parse_args()
    e = load(args.ext)
    q = mx.random.normal((1, 9, 1, 64), key=mx.random.key(0))
    buf = mx.random.normal((2, 1, 3, 1024, 64), key=mx.random.key(1))
    print("| keys | threads | us per call |\n| --- | --- | --- |")
    for threads in args.threads:
        e.set_threads(threads)
        for s in args.keys:
            k, v = buf[0, :, :, :s], buf[1, :, :, :s]
            mx.eval(q, k, v)
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(300):
                    mx.eval(e.attention(q, k, v, scale=0.125, causal=True))
                best = min(best, (time.perf_counter() - t) / 300)
            print(f"| {s} | {threads} | {best * 1e6:.1f} |")


if __name__ == "__main__":
    main()
