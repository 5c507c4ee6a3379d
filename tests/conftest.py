"""Shared fixtures: tiny random-weight checkpoints and a bounded `mlx.launch` runner."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from zygote import Zygote, usable

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Each launch gets its own block of ports so that tests cannot collide, and the
# base moves with the process id so that two suites on one machine do not either.
# Listening ports for launched ranks, 10 per launch, below Linux's ephemeral range
# (32768-60999): a port there can be held by any outgoing connection (TIME_WAIT ones
# from earlier tests' rings included) and the ring's bind then fails. Concurrent test
# runs get different quarters by their pid; LLAMA_TP_TEST_PORT_BASE pins a base (one per
# checkout when several checkouts run tests on one machine).
# pytest-xdist's workers (`make test`) take blocks of their own within the base's.
_BASE = os.environ.get("LLAMA_TP_TEST_PORT_BASE")
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
# Every bound on a child's time is a guard against a hang, never a speed assertion: under
# `make test`'s 2 workers a child shares the cores with another test's, so the bounds
# stretch (LLAMA_TP_TEST_TIMEOUT_SCALE sets the factor).
TIMEOUT_SCALE = float(
    os.environ.get("LLAMA_TP_TEST_TIMEOUT_SCALE")
    or (3 if "PYTEST_XDIST_WORKER" in os.environ else 1)
)
_PORTS = itertools.count(
    (int(_BASE) if _BASE else 10000 + (os.getpid() % 4) * 5000) + _WORKER * 1000, 10
)


def launch(
    n: int,
    args: list[str],
    timeout: float = 300,
    input: str | None = None,
    launcher: str = "llama_tp",
    extra: list[str] | None = None,
    ring: bool = False,
) -> subprocess.CompletedProcess:
    """Run `python args...` on `n` local ranks (bounded by `timeout`).

    `launcher="llama_tp"` (the default) starts them with `python -m llama_tp.launch`,
    which blocks instead of spinning, passes `input` on with its end of file and exits
    with the first failing rank's code; `launcher="mlx"` uses `mlx.launch` itself,
    which exits 0 whatever the ranks do and spins on a core (its stdin is then kept
    open until the ranks are done: at end of file it spins harder still).
    `--` keeps the launcher from taking the command's own flags (e.g. --verbose).
    `extra`: more launcher flags (e.g. ["--backend", "mpi"]). More ranks than cores
    run on Open MPI's backend where it is installed (`_open_mpi`), others on the ring;
    `ring`: the ring whatever the count (a test of what the launcher says of its ranks).
    """
    port = ["--starting-port", str(next(_PORTS))]
    env = None
    if launcher == "mlx":
        cmd = [str(BIN / "mlx.launch"), "-n", str(n), *port, *(extra or [])]
    else:
        if not extra and not ring and n > _CORES and _open_mpi():
            # more ranks than cores: Open MPI's backend, not the ring, whose socket
            # threads spin while they wait (4 ranks on 2 cores: 8 flagship checks in
            # 17-27 s instead of 46-49 s)
            port, env = ["--backend", "mpi"], dict(os.environ, **_MPI_ENV)  # as it is now
        # --no-openblas: ranks use the BLAS a single-process run_python uses, so that
        # their float32 results can be compared bit for bit (test_launch checks the preload)
        cmd = [sys.executable, "-m", "llama_tp.launch", "--no-openblas", "-n", str(n), *port]
        cmd += extra or []
    if launcher != "mlx" and not extra and _WARM and usable(args) and _ZYGOTE.start():
        # each rank forked from the warm interpreter by a stand-in (tests/zygote.py)
        cmd += ["--", sys.executable, str(ROOT / "tests" / "zygote.py"), "exec", *args]
    else:
        cmd += ["--", sys.executable, *args]
    read_end, write_end = os.pipe()
    if input:
        os.write(write_end, input.encode())
    if launcher != "mlx":
        os.close(write_end)  # the end of file reaches the ranks
        write_end = None
    try:
        p = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdin=read_end,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
        os.close(read_end)
        try:
            out, err = p.communicate(timeout=timeout * TIMEOUT_SCALE)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher and every rank it started
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    finally:
        if write_end is not None:
            os.close(write_end)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


_ZYGOTE = Zygote()
_CORES = len(os.sched_getaffinity(0))
# mpirun refuses to run as root unless told (CI runs as root)
_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _open_mpi() -> bool:
    """Whether Open MPI can carry local ranks (`LLAMA_TP_TEST_RING=1`: the ring always)."""
    from llama_tp.cluster.backend_choice import open_mpi

    return os.environ.get("LLAMA_TP_TEST_RING") != "1" and open_mpi() is None


_WARM = True  # this test's processes may come from the zygote (not an exclusive test's)


def python_cmd(args: list[str]) -> list[str]:
    """The command line of `python args` for a process a test starts itself (a server, a
    rank of `Ranks`, a documented command): a stand-in that forks it from the warm
    interpreter (tests/zygote.py) where it can, as `launch`'s ranks are, else Python."""
    if _WARM and usable(args) and _ZYGOTE.start():
        return [sys.executable, str(ROOT / "tests" / "zygote.py"), "exec", *args]
    return [sys.executable, *args]


def run_python(args: list[str], timeout: float = 300, input: str | None = None):
    """Run `python args...` as a single process (bounded by `timeout`): forked from a
    warm interpreter where it can (tests/zygote.py), else started afresh."""
    if _WARM:
        done = _ZYGOTE.run(args, ROOT, timeout * TIMEOUT_SCALE, input or "")
        if done is not None:
            return done
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout * TIMEOUT_SCALE,
        input=input or "",
    )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny fp32 Llama (8 query heads, 2 KV heads) with a sentencepiece tokenizer."""
    from fixtures import write_hf_model

    return write_hf_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def long_tiny(tmp_path_factory, tiny_dir) -> Path:
    """The tiny model with a context long enough for streams that run until the fault."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(tiny_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1 << 20
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The built-in SmolLM2-135M-Instruct GGUF (installed by `make test`)."""
    from llama_tp.loading.loader import default_model

    return default_model()


# -- `make test-fast`: the tests that start no ranks ------------------------------------

_RANK_STARTERS = ("launch(", "mlx.launch", "Ranks(")


def _source(fn) -> str:
    import inspect

    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _rank_starters(module, cache: dict) -> tuple[str, ...]:
    """What starts ranks in `module`: the direct starters, plus a call of any of the
    module's own functions that (transitively) uses one."""
    if module not in cache:
        import inspect

        own = {
            name: _source(f)
            for name, f in vars(module).items()
            if inspect.isfunction(f) and f.__module__ == module.__name__
        }
        starters = set(_RANK_STARTERS)
        while True:
            more = {
                f"{name}("
                for name, src in own.items()
                if f"{name}(" not in starters and any(s in src for s in starters)
            }
            if not more:
                break
            starters |= more
        cache[module] = tuple(starters)
    return cache[module]


def pytest_collection_modifyitems(config, items):
    """Mark `ranks` every test that starts several processes: its function or one of its
    fixtures calls `launch(...)`, runs mlx.launch, starts `Ranks(...)`, or calls a
    function of its module that does (`make test-fast` runs `pytest -m "not ranks"`).
    A test may also carry `@pytest.mark.ranks` itself."""
    cache: dict = {}
    for item in items:
        if item.get_closest_marker("ranks") or not hasattr(item, "function"):
            continue
        starters = _rank_starters(item.module, cache)
        fns = [item.function]
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        fns += [d.func for name in item.fixturenames for d in defs.get(name, ())]
        if any(s in _source(f) for f in fns for s in starters):
            item.add_marker(pytest.mark.ranks)
    # The longest modules first (measured with LLAMA_TP_TEST_COSTS): pytest-xdist hands
    # out whole files in this order, so that no long file is left running alone at the end.
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(Path(str(item.fspath)).stem, len(order)))


LONGEST_FIRST = [
    "test_generic", "test_hybrid", "test_flagships", "test_compiled_step", "test_sharded",
    "test_readme", "test_generic_drivers", "test_vocab_parallel", "test_moe", "test_mesh",
    "test_default_model", "test_speculative", "test_mesh_split", "test_one_copy",
    "test_dtype", "test_styles", "test_doctor", "test_determinism", "test_launch",
    "test_weighted_split", "test_split", "test_chat_tty", "test_convert",
    "test_family_tools", "test_serve_tools", "test_moe_refusals", "test_errors",
    "test_gguf_quants",
]  # fmt: skip


# -- optional system components: skipped with the install line, required under CI -------


def _has_mpi() -> bool:
    import ctypes
    import shutil

    if not shutil.which("mpirun"):
        return False
    try:
        ctypes.CDLL("libmpi.so")  # the name MLX's MPI backend opens
    except OSError:
        return False
    return True


def _has_openblas() -> bool:
    from llama_tp.cluster.blas import find_openblas

    return find_openblas() is not None


def _has(*programs: str):
    def check() -> bool:
        import shutil

        return all(shutil.which(p) for p in programs)

    return check


# name -> (is it there, what it adds, how to install it on Debian/Ubuntu)
COMPONENTS = {
    "mpi": (_has_mpi, "Open MPI (mpirun, libmpi.so)", "apt-get install openmpi-bin libopenmpi-dev"),
    "openblas": (_has_openblas, "Debian's OpenBLAS", "apt-get install libopenblas0-pthread"),
    "iproute2": (_has("ip", "tc"), "ip and tc (network namespaces)", "apt-get install iproute2"),
    "compiler": (_has("c++", "cmake"), "a C++ compiler and CMake", "apt-get install g++ cmake"),
    "arm64-cross": (
        _has("aarch64-linux-gnu-g++", "qemu-aarch64"),
        "an arm64 cross-compiler and qemu-user",
        "apt-get install g++-aarch64-linux-gnu qemu-user",
    ),
    "chromium": (
        _has("chromium", "chromedriver"),
        "Chromium and its driver",
        "apt-get install chromium chromium-driver",
    ),
}


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def requires(*components: str) -> pytest.MarkDecorator:
    """Mark a test that needs optional system components (names in COMPONENTS): where one
    is missing it is skipped with the install line, or fails under CI (`CI=true`, which
    .ci/run sets, after installing them), so CI still proves every backend."""
    unknown = [c for c in components if c not in COMPONENTS]
    assert not unknown, f"unknown component(s) {unknown}; known: {sorted(COMPONENTS)}"
    return pytest.mark.requires(*components)


def missing_components(names) -> list[str]:
    """The components of `names` that are not installed, each as 'what (install line)'."""
    out = []
    for name in names:
        present, what, install = COMPONENTS[name]
        if not present():
            out.append(f"{what} is not installed ({install})")
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Exclusive tests time themselves and stop or kill ranks: their processes (and their
    # fixtures', set up after this hook) start as users start them, not from the zygote.
    global _WARM
    _WARM = item.get_closest_marker("exclusive") is None
    for mark in item.iter_markers("requires"):
        missing = missing_components(mark.args)
        if missing and _in_ci():
            pytest.fail("; ".join(missing) + " and CI=true: .ci/run installs it", pytrace=False)
        if missing:
            pytest.skip("; ".join(missing))


# -- what each test costs: LLAMA_TP_TEST_COSTS=<file> ---------------------------------
# One line per test: seconds of wall time, seconds of CPU (this process and every process
# it waited for: ranks, launchers, servers), seconds of CPU of a cgroup (a cpuacct.usage
# file named by LLAMA_TP_TEST_CGROUP_CPU: every process the run started, ranks a killed
# launcher left included; -1 without one) and the test's id, appended to <file>.
_COSTS = os.environ.get("LLAMA_TP_TEST_COSTS")
_CGROUP_CPU = os.environ.get("LLAMA_TP_TEST_CGROUP_CPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _COSTS:
        yield
        return
    import resource
    import time

    def cpu() -> float:
        s, c = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def group() -> float:
        return int(Path(_CGROUP_CPU).read_text()) / 1e9 if _CGROUP_CPU else -1.0

    t0, c0, g0 = time.monotonic(), cpu(), group()
    yield
    with open(_COSTS, "a") as f:
        f.write(f"{time.monotonic() - t0:.2f}\t{cpu() - c0:.2f}\t{group() - g0:.2f}\t")
        f.write(f"{item.nodeid}\n")
