"""A warm interpreter for the suite's single-process runs: `run_python` forks it instead
of starting Python again.

Every process of the suite first imports MLX, mlx-lm and with it transformers: 2.3 s of
CPU here (transformers 5 reads its 3,000 model files to build its lazy import table),
more than most `run_python` children then spend on their work (a `plan`, an error line,
a few tokens of a tiny model). The zygote imports those third-party modules once per
pytest worker and forks a child per run; the child takes the run's working directory,
environment, arguments and standard streams, runs the module, script or code as
`python` does (`-m MOD`, `PATH`, `-c CODE`) and exits with its code. Nothing of
llama_tp is imported in the zygote: each child imports it afresh, so what llama_tp reads
from the environment at import time is the run's. Anything else (another interpreter
flag, an environment whose PYTHON* variables differ from the zygote's, a second run
while one is going) starts Python as before. Linux only (fork, file descriptors over a
Unix socket); LLAMA_TP_TEST_ZYGOTE=0 turns it off.

    python tests/zygote.py FD    the zygote: serves requests on the socket FD
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PRELOAD = (
    "numpy",
    "mlx.core",
    "mlx.nn",
    "mlx_lm",  # imports transformers (and sets TRANSFORMERS_NO_ADVISORY_WARNINGS)
    "mlx_lm.tokenizer_utils",
    "mlx_lm.models.cache",
    "mlx_lm.models.base",
    "mlx_lm.models.switch_layers",
    "mlx_lm.sample_utils",
    "sentencepiece",
    "jinja2",
)
_MSG = 1 << 16


# The zygote's side.


def _run_child(req: dict) -> int:
    """Run the request as `python ARGV` would, in this (forked) process; its exit code."""
    import atexit
    import runpy
    import traceback

    os.chdir(req["cwd"])
    env = dict(req["env"])
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # as mlx_lm's import sets it
    os.environ.clear()
    os.environ.update(env)
    argv = req["argv"]
    path = [p for p in sys.path[1:]]
    code = 0
    try:
        if argv[0] == "-m":
            sys.path[:] = [os.getcwd(), *path]
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.path[:] = ["", *path]
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = os.path.abspath(argv[0])
            sys.path[:] = [os.path.dirname(os.path.realpath(script)), *path]
            sys.argv = list(argv)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # as the interpreter ends: its threads joined, its exit functions run
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def serve(fd: int) -> None:
    """Fork a child per request on the socket `fd` (one at a time); report its pid, then
    its exit code (negative: the signal that ended it)."""
    for name in PRELOAD:
        __import__(name)
    sock = socket.socket(fileno=fd)
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MSG, 3)
        except OSError:
            return
        if not data:
            return
        req = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            for i, f in enumerate(fds):
                os.dup2(f, i)
                os.close(f)
            os._exit(_run_child(req))
        for f in fds:
            os.close(f)
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        sock.sendall(json.dumps({"code": rc}).encode() + b"\n")


# The tests' side.


def _python_env() -> dict[str, str]:
    """The variables that shape an interpreter's start (PYTHONPATH, PYTHONUNBUFFERED...)."""
    return {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}


class Zygote:
    """One zygote per pytest worker, started on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.env: dict[str, str] = {}
        self.buf = b""
        self.lock = threading.Lock()
        self.off = os.environ.get("LLAMA_TP_TEST_ZYGOTE", "1") == "0" or not hasattr(os, "fork")

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock, self.buf, self.env = ours, b"", _python_env()

    def _usable(self, args: list[str]) -> bool:
        if self.off or not args:
            return False
        if args[0] in ("-m", "-c"):
            return len(args) >= 2
        return args[0].endswith(".py") and not args[0].startswith("-")

    def run(
        self, args: list[str], cwd: Path, timeout: float, input: str
    ) -> subprocess.CompletedProcess | None:
        """`python args` forked from the zygote, as subprocess.run(capture_output=True,
        text=True) returns it; None when it cannot (the caller starts Python itself)."""
        if not self._usable(args) or not self.lock.acquire(blocking=False):
            return None
        try:
            if self.proc is not None and self.env != _python_env():
                return None
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            return self._run(args, cwd, timeout, input)
        except (OSError, ValueError, KeyError):
            self.off = True  # start Python as before from now on
            return None
        finally:
            self.lock.release()

    def _line(self, timeout: float | None) -> dict:
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            data = self.sock.recv(4096)
            if not data:
                raise OSError("the zygote is gone")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def _run(self, args, cwd, timeout, input) -> subprocess.CompletedProcess:
        cmd = [sys.executable, *args]
        files = [tempfile.TemporaryFile() for _ in range(3)]
        try:
            files[0].write(input.encode())
            files[0].seek(0)
            req = {"argv": args, "cwd": str(cwd), "env": dict(os.environ)}
            socket.send_fds(self.sock, [json.dumps(req).encode()], [f.fileno() for f in files])
            pid = self._line(None)["pid"]
            try:
                code, timed_out = self._line(timeout)["code"], False
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                code, timed_out = self._line(None)["code"], True
            out, err = [
                (f.seek(0), f.read().decode("utf-8", errors="replace"))[1] for f in files[1:]
            ]
        finally:
            for f in files:
                f.close()
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(cmd, code, out, err)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
