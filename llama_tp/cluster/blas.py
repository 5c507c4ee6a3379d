"""Which BLAS MLX's CPU backend uses, and how to get a fast one on Linux.

MLX's Linux CPU wheel (`mlx[cpu]`) bundles the reference (netlib) BLAS: its
fp32 matrix products are 10 to 20 times slower than OpenBLAS's. The dynamic
linker resolves `cblas_sgemm` from the global scope first (the program and
LD_PRELOAD libraries), so preloading Debian's OpenBLAS replaces it:

    apt-get install libopenblas0-pthread
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python -m ...

Only fp32 matrix products go through BLAS; fp16/bf16 and quantized products use
MLX's own kernels and do not change. `python -m llama_tp.blas` prints what is in use.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# Where Debian/Ubuntu (libopenblas0-pthread, -openmp, -serial) and Fedora put OpenBLAS.
_ARCH = f"{platform.machine()}-linux-gnu"
OPENBLAS_CANDIDATES = [
    f"/usr/lib/{_ARCH}/openblas-pthread/libblas.so.3",
    f"/usr/lib/{_ARCH}/openblas-openmp/libblas.so.3",
    f"/usr/lib/{_ARCH}/openblas-serial/libblas.so.3",
    f"/usr/lib/{_ARCH}/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
]
_FAST_NAMES = ("openblas", "mkl", "blis", "accelerate", "atlas", "armpl")


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _library_of(handle: ctypes.CDLL, symbol: str) -> str | None:
    """The file that `symbol` resolves to when looked up through `handle`, or None."""
    try:
        fn = getattr(handle, symbol)
    except AttributeError:
        return None
    info = _DlInfo()
    libc = ctypes.CDLL(None)
    if not libc.dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)):
        return None
    return os.path.normpath(os.fsdecode(info.dli_fname)) if info.dli_fname else None


def _libmlx() -> str | None:
    """The path of the loaded libmlx shared library (Linux), or None."""
    import mlx.core  # noqa: F401  (loads libmlx)

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
        if Path(path).name.startswith("libmlx."):
            return path
    return None


def blas_library() -> str | None:
    """The library MLX's fp32 matrix products call (`cblas_sgemm`), or None if unknown.

    The global scope (program, LD_PRELOAD) wins over libmlx's own dependencies,
    exactly as the dynamic linker binds libmlx's references.
    """
    if sys.platform != "linux":
        return None
    found = _library_of(ctypes.CDLL(None), "cblas_sgemm")
    if found:
        return found
    mlx_lib = _libmlx()
    if mlx_lib is None:
        return None
    return _library_of(ctypes.CDLL(mlx_lib, mode=os.RTLD_NOLOAD), "cblas_sgemm")


def find_openblas() -> str | None:
    """An installed OpenBLAS that can be preloaded, or None."""
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).is_file()), None)


def sgemm_gflops(m: int = 64, k: int = 512, n: int = 512, repeat: int = 5) -> float:
    """GFLOP/s of an (m, k) @ (k, n) fp32 product on the CPU (the median of `repeat`)."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        a = mx.random.normal((m, k), key=mx.random.key(0))
        b = mx.random.normal((k, n), key=mx.random.key(1))
        mx.eval(a, b, a @ b)
        times = []
        for _ in range(repeat):
            tic = time.perf_counter()
            mx.eval(a @ b)
            times.append(time.perf_counter() - tic)
    return 2 * m * k * n / sorted(times)[len(times) // 2] / 1e9


@dataclass
class BlasInfo:
    library: str | None  # what cblas_sgemm resolves to (None: not Linux / unknown)
    reference: bool  # the slow reference BLAS is in use
    openblas: str | None  # an installed OpenBLAS to preload, if any
    gflops: float  # a 64x512 @ 512x512 fp32 product's speed, for the record

    def to_dict(self) -> dict:
        return asdict(self)


def is_reference(library: str | None) -> bool:
    """True for a BLAS that is none of the known optimized ones (netlib's, as bundled)."""
    return library is not None and not any(n in library.lower() for n in _FAST_NAMES)


def check(measure: bool = True) -> BlasInfo:
    """What BLAS is in use, whether it is the slow one, and what could replace it."""
    lib = blas_library()
    return BlasInfo(lib, is_reference(lib), find_openblas(), sgemm_gflops() if measure else 0.0)


def preload_line(openblas: str | None = None) -> str:
    """The environment setting that swaps in OpenBLAS (`LD_PRELOAD=...`)."""
    return f"LD_PRELOAD={openblas or OPENBLAS_CANDIDATES[0]}"


def hint(info: BlasInfo) -> str | None:
    """One line telling how to get the fast BLAS, or None when it is in use (or not Linux)."""
    if not info.reference:
        return None
    if info.openblas:
        return (
            f"note: MLX uses the slow reference BLAS ({Path(info.library).name}); OpenBLAS is "
            f"installed: run with {preload_line(info.openblas)} for fast fp32 matrix products"
        )
    return (
        f"note: MLX uses the slow reference BLAS ({Path(info.library).name}); for fast fp32 "
        f"matrix products: apt-get install libopenblas0-pthread, then run with {preload_line()}"
    )


def set_threads(n: int) -> bool:
    """Limit OpenBLAS to `n` threads (e.g. one rank pinned to one core); False if not OpenBLAS."""
    try:
        fn = ctypes.CDLL(None).openblas_set_num_threads
    except AttributeError:
        return False
    fn(ctypes.c_int(n))
    return True


def main() -> int:
    import json

    info = check()
    if "--json" in sys.argv[1:]:
        print(json.dumps(info.to_dict()))
        return 0
    print(f"BLAS library: {info.library or 'unknown (not Linux, or no cblas_sgemm found)'}")
    print(f"reference BLAS: {'yes' if info.reference else 'no'}")
    print(f"installed OpenBLAS: {info.openblas or 'none'}")
    print(f"64x512 @ 512x512 fp32: {info.gflops:.1f} GFLOP/s")
    line = hint(info)
    if line:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
