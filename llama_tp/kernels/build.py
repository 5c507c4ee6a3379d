"""Build the native extension against the MLX installed here, into a per-user cache.

Why a cache built at first use (and by `make setup`), not `setup.py build_ext`: the
extension's C++ ties it to the exact MLX it was compiled against, and the MLX that runs
is only known once it is installed (pip builds a package in an isolated environment,
with whatever MLX it fetched for the build; a later `pip install -U mlx` would leave a
stale binary behind). So the build key is the MLX version, the Python tag and a hash of
the sources: a new MLX or new kernel sources build anew, an old build is never loaded
against another MLX. Local ranks starting together build once, under a file lock; a
failed build is recorded with its reason (and not retried until `build(force=True)`,
`python -m llama_tp.kernels build`), and the caller falls back to MLX's kernel.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = sorted([HERE / "CMakeLists.txt", *(HERE / "src").glob("*.[ch]*")])
MIN_CMAKE = (3, 27)


class BuildError(RuntimeError):
    """The extension could not be built: the message says why in one line."""


def cache_root() -> Path:
    """Where builds go: $LLAMA_TP_KERNELS_CACHE, else $XDG_CACHE_HOME (~/.cache)/llama_tp."""
    if os.environ.get("LLAMA_TP_KERNELS_CACHE"):
        return Path(os.environ["LLAMA_TP_KERNELS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llama_tp" / "kernels"


def mlx_version() -> str:
    import mlx.core as mx

    return mx.__version__


def build_key() -> str:
    """mlx-<version>-<python tag>-<machine>-<hash of the sources>."""
    h = hashlib.sha256()
    for f in SOURCES:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    tag = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    return f"mlx-{mlx_version()}-{tag}-{platform.machine()}-{h.hexdigest()[:12]}"


def build_dir() -> Path:
    return cache_root() / build_key()


def _find_cmake() -> str:
    """A CMake >= 3.27: the one beside this Python (PyPI's `cmake`) first, then PATH."""
    beside = Path(sys.executable).parent / "cmake"
    candidates = [str(beside)] if beside.is_file() else []
    if shutil.which("cmake"):
        candidates.append(shutil.which("cmake"))
    found = []
    for c in candidates:
        try:
            out = subprocess.run([c, "--version"], capture_output=True, text=True).stdout
        except OSError:
            continue
        m = re.search(r"(\d+)\.(\d+)", out)
        if m:
            version = (int(m[1]), int(m[2]))
            if version >= MIN_CMAKE:
                return c
            found.append(f"{c} is {m[1]}.{m[2]}")
    old = f" ({'; '.join(found)})" if found else ""
    want = f"{MIN_CMAKE[0]}.{MIN_CMAKE[1]}"
    raise BuildError(f"no CMake >= {want}{old}: pip install 'cmake>={want}'")


def _check_tools() -> str:
    """The CMake to use; raises BuildError naming what is missing."""
    given = os.environ.get("CXX")
    if given:  # CMake takes $CXX when set
        if not shutil.which(given.split()[0]):
            raise BuildError(f"no C++ compiler ($CXX={given} not found): apt-get install g++")
    elif not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise BuildError("no C++ compiler (c++, g++ or clang++): apt-get install g++")
    try:
        import nanobind  # noqa: F401
    except ImportError:
        raise BuildError("nanobind is not installed: pip install nanobind") from None
    return _find_cmake()


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        lines = [x for x in log.read_text(errors="replace").splitlines() if "error" in x.lower()]
        first = lines[0].strip() if lines else f"{Path(cmd[0]).name} exited with {r.returncode}"
        raise BuildError(f"the build failed: {first[:200]} (log: {log})")


def _compile(out: Path) -> Path:
    """Configure and build into a temporary folder; the module's path inside `out`."""
    cmake = _check_tools()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "build.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="llama_tp_kernels_") as tmp:
        configure = [cmake, "-S", str(HERE), "-B", tmp, f"-DPython_EXECUTABLE={sys.executable}"]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        _run(configure, log)
        _run([cmake, "--build", tmp, "-j", str(os.cpu_count() or 1)], log)
        built = [p for p in Path(tmp).glob("_ext*") if p.suffix in (".so", ".pyd", ".dylib")]
        if not built:
            raise BuildError(f"the build made no _ext module (log: {log})")
        target = out / built[0].name
        shutil.copy2(built[0], out / (built[0].name + ".tmp"))
        os.replace(out / (built[0].name + ".tmp"), target)  # whole, or not at all
        selftest = Path(tmp) / "lt_selftest"
        if selftest.is_file():
            shutil.copy2(selftest, out / "lt_selftest")
    return target


def built_module() -> tuple[Path | None, str | None]:
    """(the built module, None), or (None, why not: a recorded failure or "not built")."""
    d = build_dir()
    record = d / "built.json"
    if record.is_file():
        info = json.loads(record.read_text())
        if info.get("ok") and (d / info["module"]).is_file():
            if info.get("mlx") != mlx_version():  # the key holds it; checked all the same
                return None, f"built against MLX {info.get('mlx')}, running {mlx_version()}"
            return d / info["module"], None
        if not info.get("ok"):
            return None, info.get("reason", "the build failed")
    return None, "not built"


def build(force: bool = False, quiet: bool = False) -> Path:
    """The built module's path, building it first if needed (under a lock shared by the
    processes of this machine). Raises BuildError with the reason when it cannot be built
    (also recorded, so that later calls fail fast until `force`)."""
    d = build_dir()
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / f"{d.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building: wait for it
        path, why = built_module()
        if path is not None and not force:
            return path
        if why != "not built" and not force:
            raise BuildError(why)
        if not quiet:
            print(
                f"llama_tp: building the native CPU kernels for MLX {mlx_version()} (once)...",
                file=sys.stderr,
                flush=True,
            )
        tic = time.perf_counter()
        d.mkdir(parents=True, exist_ok=True)
        record = {"mlx": mlx_version(), "python": sys.version.split()[0], "key": d.name}
        try:
            module = _compile(d)
        except BuildError as e:
            record |= {"ok": False, "reason": str(e)}
            (d / "built.json").write_text(json.dumps(record, indent=1))
            raise
        record |= {"ok": True, "module": module.name, "seconds": time.perf_counter() - tic}
        (d / "built.json").write_text(json.dumps(record, indent=1))
        return module
