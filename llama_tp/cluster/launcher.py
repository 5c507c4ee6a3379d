"""mlx.launch with an I/O loop that blocks instead of spinning.

MLX 0.32's launcher (`mlx._distributed_utils.launch`) gives every rank a thread
that calls `select()` with each rank's stdin pipe in the write set: an empty pipe
is always writable, so the select returns at once and the thread spins; its main
loop spins again once its own stdin reaches end of file (select on a closed
stdin is always readable). On a 2-core machine that takes a core from the ranks
(docs/getting-started.md, "Why not plain mlx.launch", has the measurement and the fix for upstream).

Everything else is mlx's own: its argument parser, hostfiles, backends, the ssh
and mpirun plumbing, the hostfile it writes for the ranks. `main()` runs mlx's
`main()` with its `_launch_with_io` replaced by `forward_io` below, which:
- waits in one `selectors` call for output to forward or input to send (a rank's
  stdin is watched for writing only while there is something to write);
- forwards stdin to the ranks and, at its end of file, closes theirs (so
  `--prompt -` reads to the end without a pause);
- returns the first non-zero exit code of a rank (mlx.launch exits 0 whatever its
  ranks do) and, when a rank fails, gives the others `GRACE` seconds to notice
  (llama_tp's ranks end themselves with one line) before terminating them.

Local ranks get Open MPI when it is installed and no backend is named
(`backend_choice.py`).
"""

from __future__ import annotations

import os
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .affinity import CORES_ENV, launch_nice, rank_cores, usable_cores, yielding_session
from .backend_choice import default_backend

GRACE = 5.0  # seconds the other ranks get to end by themselves after one fails


@dataclass
class _Rank:
    rank: int
    command: Any  # mlx's RemoteProcess (or any CommandProcess)
    pending: bytes = b""  # stdin not yet written
    stdin_open: bool = True
    open_outputs: int = 2
    header: bytes | None = b""  # stdout before the launch script's pidfile line
    code: int | None = None
    extra: dict = field(default_factory=dict)


class Result:
    """What the last `forward_io` saw: the first non-zero exit code (0 if none)."""

    code = 0


def _write(stream, data: bytes) -> None:
    stream.buffer.write(data)
    stream.buffer.flush()


def _stdout_data(r: _Rank, data: bytes) -> bytes:
    """Strip the pidfile line mlx's launch script prints first (its preprocess_output)."""
    if r.header is None:
        return data
    r.header += data
    if b"\n" not in r.header:
        return b""
    head, _, rest = r.header.partition(b"\n")
    r.command.preprocess_output(head.decode(errors="replace") + "\n", True)
    r.header = None
    return rest


def forward_io(command_class, arguments, verbose: bool) -> None:
    """mlx's `_launch_with_io(command_class, arguments, verbose)`, blocking instead of polling."""
    from mlx._distributed_utils.common import log, log_warning

    ranks = [_Rank(i, command_class(*args, **kwargs)) for i, (args, kwargs) in enumerate(arguments)]
    sel = selectors.DefaultSelector()
    for r in ranks:
        p = r.command.process
        for f, kind in ((p.stdout, "out"), (p.stderr, "err")):
            os.set_blocking(f.fileno(), False)
            sel.register(f.fileno(), selectors.EVENT_READ, (r, kind))
        os.set_blocking(p.stdin.fileno(), False)
    stdin_fd = sys.stdin.fileno() if sys.stdin is not None else None
    try:
        sel.register(stdin_fd, selectors.EVENT_READ, (None, "stdin"))
    except (ValueError, OSError, TypeError, PermissionError):
        stdin_fd = None  # no stdin (closed, or a file selectors cannot watch)
        for r in ranks:
            _close_stdin(sel, r)
    deadline = None  # set when a rank has failed
    Result.code = 0
    try:
        while any(r.code is None for r in ranks):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            for key, _ in sel.select(timeout):
                r, kind = key.data
                if kind == "stdin":
                    data = _read(key.fd)
                    if data is None:
                        continue
                    if not data:
                        sel.unregister(key.fd)
                        stdin_fd = None
                    for other in ranks:
                        if data:
                            _queue(sel, other, data)
                        elif not other.pending:
                            _close_stdin(sel, other)
                elif kind == "in":
                    _flush_stdin(sel, r, closing=stdin_fd is None)
                else:
                    data = _read(key.fd)
                    if data is None:
                        continue
                    if not data:
                        sel.unregister(key.fd)
                        r.open_outputs -= 1
                        if r.open_outputs == 0:
                            _finish(sel, r, ranks, log, log_warning, verbose)
                            if r.code and deadline is None:
                                deadline = time.monotonic() + GRACE
                    elif kind == "out":
                        _write(sys.stdout, _stdout_data(r, data))
                    else:
                        _write(sys.stderr, data)
            if deadline is not None and time.monotonic() >= deadline:
                for r in ranks:
                    if r.code is None:
                        r.command.terminate()
                deadline = time.monotonic() + GRACE  # then wait for their pipes to close
    except KeyboardInterrupt:
        for r in ranks:
            if r.code is None:
                r.command.terminate()
        Result.code = Result.code or 130
    finally:
        sel.close()


def _read(fd: int) -> bytes | None:
    """Up to 64 KiB from `fd`; b"" at end of file (or a broken pipe); None if it would block."""
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _queue(sel: selectors.BaseSelector, r: _Rank, data: bytes) -> None:
    if not r.stdin_open:
        return
    had = bool(r.pending)
    r.pending += data
    if not had:
        sel.register(r.command.process.stdin.fileno(), selectors.EVENT_WRITE, (r, "in"))


def _flush_stdin(sel: selectors.BaseSelector, r: _Rank, closing: bool) -> None:
    fd = r.command.process.stdin.fileno()
    try:
        n = os.write(fd, r.pending)
        r.pending = r.pending[n:]
    except BlockingIOError:
        return
    except OSError:  # the rank closed its stdin or exited
        r.pending = b""
    if not r.pending:
        sel.unregister(fd)
        if closing:
            _close_stdin(sel, r)


def _close_stdin(sel: selectors.BaseSelector, r: _Rank) -> None:
    if r.stdin_open:
        r.stdin_open = False
        try:
            r.command.process.stdin.close()
        except OSError:
            pass


def _finish(sel, r: _Rank, ranks: list[_Rank], log, log_warning, verbose: bool) -> None:
    """The rank's outputs are closed: wait for it and record its exit."""
    if r.pending:
        sel.unregister(r.command.process.stdin.fileno())
        r.pending = b""
    _close_stdin(sel, r)
    r.command.process.wait()
    code, killed = r.command.exit_status
    r.code = code if code is not None else 0
    if killed:
        log_warning(f"Node with rank {r.rank} was killed")
    elif r.code != 0:
        log_warning(f"Node with rank {r.rank} exited with code {r.code}")
    else:
        log(verbose, f"Node with rank {r.rank} completed")
    if r.code and not Result.code:
        Result.code = r.code


def split_argv(argv: list[str]) -> tuple[list[str], list[str] | None, str | None]:
    """(launcher flags, the command or None, the module of `-m` or None).

    `-m MODULE args...` and `-- command...` end the launcher's flags: everything
    after them belongs to the command (so its own `--verbose` is not the launcher's).
    """
    takes_value = {
        "--hosts", "-n", "--repeat-hosts", "--hostfile", "--backend", "--env", "--mpi-arg",
        "--connections-per-ip", "--starting-port", "-p", "--cwd", "--nccl-port", "--python",
    }  # fmt: skip
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return argv[:i], argv[i + 1 :], None
        if a == "-m":
            if i + 1 >= len(argv):
                raise ValueError("-m needs a module name, e.g. -m llama_tp.generate")
            return argv[:i], argv[i + 2 :], argv[i + 1]
        i += 2 if a in takes_value else 1
    return argv, None, None


def _value(flags: list[str], name: str) -> str | None:
    for i, a in enumerate(flags):
        if a == name and i + 1 < len(flags):
            return flags[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def openblas_env(flags: list[str]) -> list[str]:
    """`--env` flags that preload Debian's OpenBLAS for local ranks on Linux, with one
    BLAS thread per rank's share of the cores unless the user set OPENBLAS_NUM_THREADS
    (theirs is kept); nothing when the user set LD_PRELOAD or gave hosts."""
    from .blas import find_openblas

    if _remote(flags):
        return []  # remote hosts may not have it at the same path
    given = _given(flags)
    if "LD_PRELOAD" in given:
        return []
    lib = find_openblas()
    if lib is None:
        return []
    if "OPENBLAS_NUM_THREADS" in given:  # the user's count reaches the ranks as it is
        return ["--env", f"LD_PRELOAD={lib}"]
    threads = _threads_per_rank(flags)
    return ["--env", f"LD_PRELOAD={lib}", "--env", f"OPENBLAS_NUM_THREADS={threads}"]


def _ranks(flags: list[str]) -> int:
    return int(_value(flags, "-n") or _value(flags, "--repeat-hosts") or 1)


def _threads_per_rank(flags: list[str]) -> int:
    """This machine's cores over the local ranks."""
    return max(1, len(usable_cores()) // _ranks(flags))


KERNEL_THREADS = "LLAMA_TP_KERNEL_THREADS"  # read by llama_tp.kernels.native


def kernel_threads_env(flags: list[str]) -> list[str]:
    """`--env LLAMA_TP_KERNEL_THREADS=<cores / ranks>` for local ranks: the native
    kernels' threads per rank (nothing when the user set it or gave hosts)."""
    if _remote(flags) or KERNEL_THREADS in _given(flags):
        return []
    return ["--env", f"{KERNEL_THREADS}={_threads_per_rank(flags)}"]


def cores_env(flags: list[str]) -> list[str]:
    """`--env LLAMA_TP_CORES=0/1` (each local rank on its own cores, `affinity.py`) when
    the ranks fit on this machine's cores (nothing when the user set it or gave hosts)."""
    if _remote(flags) or CORES_ENV in _given(flags):
        return []
    spec = rank_cores(_ranks(flags), usable_cores())
    return [] if spec is None else ["--env", f"{CORES_ENV}={spec}"]


def pins_ranks(flags: list[str], cores: list[str]) -> bool:
    """The local ranks will be pinned: by the launcher (`cores`, cores_env's flags), or
    by the user's own value."""
    if cores:
        return True
    given = [e.split("=", 1)[1] for e in _envs(flags) if e.startswith(CORES_ENV + "=")]
    value = given[-1] if given else os.environ.get(CORES_ENV, "")
    return not _remote(flags) and value not in ("", "off")


def _envs(flags: list[str]) -> list[str]:
    return [flags[i + 1] for i, a in enumerate(flags[:-1]) if a == "--env"]


def _given(flags: list[str]) -> set[str]:
    """The variables the user set: in the launcher's environment or with --env."""
    return {e.split("=", 1)[0] for e in _envs(flags)} | set(os.environ)


def _remote(flags: list[str]) -> bool:
    """Hosts given: the ranks may be on other machines (nothing local is assumed)."""
    return bool(_value(flags, "--hostfile") or _value(flags, "--hosts"))


def run(argv: list[str], openblas: bool = True) -> int:
    """Launch like `mlx.launch argv...` (plus `-m MODULE`); the first failing rank's code."""
    from mlx._distributed_utils import launch

    flags, command, module = split_argv(argv)
    if module is not None:
        command = ["-m", module, *command]
        if _value(flags, "--python") is None:
            command = [sys.executable, *command]  # mlx prefixes --python itself
    blas = openblas_env(flags) if openblas else []
    threads = kernel_threads_env(flags)
    cores = cores_env(flags)
    backend = default_backend(flags, _ranks(flags), _value(flags, "--backend"), _remote(flags))
    extra = blas + threads + cores + backend.flags
    # Pinned ranks hold every core: the session yields to the others (affinity.py).
    polite = yielding_session(launch_nice() if pins_ranks(flags, cores) else 0)
    if "--verbose" in flags:
        for what, env in (("preloading", blas), ("native kernels:", threads), ("cores:", cores)):
            if env:
                print(f"launch: {what} {' '.join(env[1::2])}", file=sys.stderr, flush=True)
        if backend.reason:
            print(f"launch: backend {backend.reason}", file=sys.stderr, flush=True)
    real_io, real_run = launch._launch_with_io, launch.run

    def run_and_record(cmd, *args, **kwargs):  # mpirun's exit code (mlx drops it)
        is_mpirun = isinstance(cmd, list) and cmd and str(cmd[0]).endswith("mpirun")
        if is_mpirun:
            cmd = _mpirun_compatible(cmd)
            if backend.env:  # for mpirun itself (as root, the backend we picked)
                kwargs["env"] = {**os.environ, **backend.env}
        out = real_run(cmd, *args, **kwargs)
        if is_mpirun:
            Result.code = out.returncode
        return out

    saved = sys.argv
    sys.argv = ["python -m llama_tp.launch", *extra, *flags]
    if command is not None:
        sys.argv += ["--", *command]
    launch._launch_with_io, launch.run = forward_io, run_and_record
    Result.code = 0
    try:
        with polite:
            launch.main()
    except KeyboardInterrupt:
        return 130
    finally:
        launch._launch_with_io, launch.run = real_io, real_run
        sys.argv = saved
    return Result.code


def _mpirun_compatible(cmd: list[str]) -> list[str]:
    """mlx passes `--output :raw` (Open MPI 5); Open MPI 4 (Debian 12, Ubuntu 24.04)
    refuses the option, and its output is unbuffered without it: drop it there."""
    import subprocess

    if "--output" not in cmd:
        return cmd
    try:
        version = subprocess.run([cmd[0], "--version"], capture_output=True, text=True).stdout
    except OSError:
        return cmd
    major = next((w.split(".")[0] for w in version.split() if w[:1].isdigit()), "5")
    if int(major) >= 5:
        return cmd
    i = cmd.index("--output")
    return cmd[:i] + cmd[i + 2 :]


def install_sigterm() -> None:
    """SIGTERM ends the launcher as Ctrl-C does: the ranks are terminated first."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
