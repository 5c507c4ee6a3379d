"""Finding, loading and checking the built extension; why the fallback runs when it does.

`status()` loads the module once per process (building it first if needed, see
`build.py`) and says which path quantized products take: the native kernels (with
the instruction set and threads) or MLX's `quantized_matmul`, with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx

from .build import BuildError, build, built_module

ENV = "LLAMA_TP_KERNELS"  # "mlx": never use the native kernels; an ISA name forces that one
THREADS_ENV = "LLAMA_TP_KERNEL_THREADS"  # threads per process (the launcher sets it)


@dataclass
class Status:
    native: bool  # quantized products on the CPU use the native kernels
    reason: str  # why not, when they do not
    isa: str | None = None  # avx512, avx2, neon, scalar
    threads: int = 1
    module: str | None = None  # the built module's path

    def describe(self) -> str:
        """One line for --verbose and doctor."""
        if self.native:
            t = f"{self.threads} thread{'s' * (self.threads > 1)}"
            return f"native kernels ({self.isa}, {t})"
        return f"MLX's quantized_matmul ({self.reason})"


_status: Status | None = None
_ext: ModuleType | None = None
_warned = False
_off = 0  # depth of `off()` blocks
_OFF = Status(False, "turned off (llama_tp.kernels.off)")


def default_threads(ranks_here: int = 1) -> int:
    """$LLAMA_TP_KERNEL_THREADS, else this machine's cores over the ranks on it."""
    if os.environ.get(THREADS_ENV):
        return max(1, int(os.environ[THREADS_ENV]))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, ranks_here))


def _import(path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("llama_tp.kernels._ext", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _missing_instructions(ext: ModuleType) -> str | None:
    if ext.isa() != "scalar":
        return None
    if platform.machine().lower() in ("x86_64", "amd64"):
        return "this CPU lacks AVX2, FMA or F16C"
    return f"no SIMD kernels for {platform.machine()}"


def _load() -> Status:
    global _ext
    choice = os.environ.get(ENV, "native")
    if choice == "mlx":
        return Status(False, f"{ENV}=mlx")
    path, why = built_module()
    if path is None:
        try:
            path = build()
        except BuildError as e:
            return Status(False, str(e))
        except OSError as e:  # e.g. an unwritable cache
            return Status(False, f"cannot build the kernels: {e}")
    try:
        ext = _import(path)
    except ImportError as e:
        return Status(False, f"cannot load {path.name}: {e}")
    if ext.BUILT_WITH_MLX != mx.__version__:
        return Status(False, f"built against MLX {ext.BUILT_WITH_MLX}, running {mx.__version__}")
    try:  # a module built with another nanobind ABI rejects mx.array arguments
        x = mx.zeros((1, 32))
        w, s, b = mx.quantize(mx.zeros((1, 32)), group_size=32, bits=4)
        mx.eval(ext.qmatmul(x, w, s, b, format=1004, group_size=32, stream=mx.cpu))
    except TypeError:
        return Status(False, f"{path.name} does not accept mx.array (nanobind ABI differs)")
    if choice != "native":
        if not ext.set_isa(choice):
            return Status(False, f"{ENV}={choice}: not an instruction set this CPU runs")
    else:
        missing = _missing_instructions(ext)
        if missing:
            return Status(False, missing, isa="scalar")
    _ext = ext
    ext.set_threads(default_threads())  # the loader narrows it to this rank's share
    return Status(True, "", ext.isa(), ext.threads(), str(path))


def status() -> Status:
    """Which path quantized CPU products take (loading, or building, the module once)."""
    global _status
    if _off:
        return _OFF
    if _status is None:
        _status = _load()
    return _status


@contextmanager
def off() -> Iterator[None]:
    """Inside: everything runs as without the extension (models loaded inside hold GGUF
    converted to MLX's layout; products called inside use MLX's kernel). For comparing
    the two paths in one process."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def ext() -> ModuleType | None:
    """The loaded module when the native path is on, else None."""
    return _ext if status().native else None


def set_threads(n: int) -> None:
    """Threads of the kernels' pool (this process)."""
    if ext() is not None:
        _ext.set_threads(n)
        _status.threads = _ext.threads()


def fallback_warning() -> str | None:
    """The one warning of a process whose products fall back to MLX (None after the first
    call, when the native path is on, or when the user chose MLX's)."""
    global _warned
    st = status()
    if st.native or _warned or st is _OFF or st.reason == f"{ENV}=mlx":
        return None
    _warned = True
    return f"warning: quantized matrix products use MLX's slower kernel: {st.reason}"
