"""A warm interpreter for the suite's processes: single runs and launched ranks are forked
from it instead of starting Python again.

Every process of the suite first imports MLX, mlx-lm and with it transformers: 2.3 s of
CPU here (transformers 5 reads its 3,000 model files to build its lazy import table),
more than most children then spend on their work (a `plan`, an error line, a few tokens
of a tiny model on each rank). The zygote imports those third-party modules once per
pytest worker and forks a child per run; the child takes the run's working directory,
environment, arguments and standard streams, runs the module, script or code as
`python` does (`-m MOD`, `PATH`, `-c CODE`) and exits with its code. Nothing of
llama_tp is imported in the zygote: each child imports it afresh, so what llama_tp reads
from the environment at import time is the run's.

- `run_python` (conftest.py) asks it directly (`Zygote.run`);
- a launched rank runs `python tests/zygote.py exec ARGS...`: this stand-in hands its own
  standard streams, environment and arguments to the zygote, passes the signals it gets
  on to the forked rank and exits as the rank exits (killed by the same signal, too); the
  rank runs in a session of its own at the stand-in's priority (the launcher lowers its
  session while pinned ranks run); a rank whose stand-in dies (SIGKILL) kills itself
  (a pipe held by the stand-in tells).

Anything else starts Python as before: another interpreter flag, an environment whose
start-up variables (PYTHON*, LD_*, OPENBLAS_*, OMP_*) differ from the zygote's, or a
zygote that is not there. Linux only (fork, file descriptors over a Unix socket);
LLAMA_TP_TEST_ZYGOTE=0 turns it off.

    python tests/zygote.py serve SOCKET    the zygote (started by `Zygote`)
    python tests/zygote.py exec ARGS...    run `python ARGS...` forked from it
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

SOCKET_ENV = "LLAMA_TP_TEST_ZYGOTE_SOCKET"
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
_STARTUP = ("PYTHON", "LD_", "OPENBLAS_", "OMP_", "MKL_")
_MSG = 1 << 20


def startup_env(env=None) -> dict[str, str]:
    """The variables that shape an interpreter's start (read before any of our code runs)."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith(_STARTUP)}


def usable(args: list[str]) -> bool:
    """Whether `python args` is a form the zygote runs (-m MOD, -c CODE, a .py path)."""
    if not args:
        return False
    if args[0] in ("-m", "-c"):
        return len(args) >= 2
    return args[0].endswith(".py") and not args[0].startswith("-")


# -- the zygote -------------------------------------------------------------------------


def _run_child(req: dict) -> int:
    """Run the request as `python ARGV` would, in this (forked) process; its exit code."""
    import atexit
    import runpy
    import threading
    import traceback

    os.chdir(req["cwd"])
    env = dict(req["env"])
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # as mlx_lm's import sets it
    os.environ.clear()
    os.environ.update(env)
    argv, rest = req["argv"], sys.path[1:]
    code = 0
    try:
        if argv[0] == "-m":
            sys.path[:] = [os.getcwd(), *rest]
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.path[:] = ["", *rest]
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            script = os.path.abspath(argv[0])
            sys.path[:] = [os.path.dirname(os.path.realpath(script)), *rest]
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
    except BaseException:
        sys.excepthook(*sys.exc_info())
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


def _lifeline(fd: int) -> None:
    """Die as the stand-in died: a thread waits for the end of its pipe."""
    import threading

    def wait() -> None:
        while os.read(fd, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, daemon=True).start()


def _own_session(nice: int | None) -> None:
    """A session of its own at the stand-in's autogroup nice: the launcher lowers its
    session while pinned ranks run (llama_tp/cluster/affinity.py), and a rank left in the
    pytest worker's session at nice 0 would starve the other sessions as it describes."""
    os.setsid()
    if nice:
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
        except OSError:
            pass


def _fork(req: dict, fds: list[int], close: list[socket.socket]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        for s in close:
            s.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for i, f in enumerate(fds[:3]):
            os.dup2(f, i)
        for f in fds[:3]:
            if f > 2:
                os.close(f)
        if len(fds) > 3:  # a launched rank: in a session at its stand-in's priority
            _lifeline(fds[3])
            _own_session(req.get("session_nice"))
        code = _run_child(req)
    except BaseException:
        code = 1
    os._exit(code)


def serve(path: str) -> None:
    """Fork a child per request on the Unix socket `path`; on each connection, report the
    child's pid, then its exit code (negative: the signal that ended it). Ends with its
    parent (the pytest worker)."""
    for name in PRELOAD:
        __import__(name)
    env = startup_env()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                data, fds, _, _ = socket.recv_fds(conn, _MSG, 4)
                req = json.loads(data)
            except (OSError, ValueError):
                conn.close()
                continue
            if startup_env(req["env"]) != env:
                conn.sendall(b'{"refused": "start-up environment"}\n')
                conn.close()
            else:
                pid = _fork(req, fds, [listener, conn, *waiting.values()])
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                waiting[pid] = conn
            for f in fds:
                os.close(f)
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    code = os.waitstatus_to_exitcode(status)
                    conn.sendall(json.dumps({"code": code}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


# -- its clients ------------------------------------------------------------------------


class Call:
    """One request to the zygote: `python args` with these standard streams."""

    def __init__(
        self, path: str, args: list[str], fds: list[int], cwd: str, nice: int | None = None
    ) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.buf = b""
        req = {"argv": args, "cwd": cwd, "env": dict(os.environ), "session_nice": nice}
        socket.send_fds(self.sock, [json.dumps(req).encode()], fds)
        first = self.line(None)
        if "pid" not in first:
            self.sock.close()
            raise OSError(first.get("refused", "refused"))
        self.pid: int = first["pid"]

    def line(self, timeout: float | None) -> dict:
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            data = self.sock.recv(4096)
            if not data:
                raise OSError("the zygote is gone")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def code(self, timeout: float | None = None) -> int:
        """The child's exit code (TimeoutError after `timeout` seconds)."""
        return self.line(timeout)["code"]


class Zygote:
    """The pytest worker's zygote, started on first use."""

    def __init__(self) -> None:
        import tempfile

        self.proc = None
        self.path = os.path.join(tempfile.mkdtemp(prefix="zygote-"), "sock")
        self.off = os.environ.get("LLAMA_TP_TEST_ZYGOTE", "1") == "0" or not hasattr(os, "fork")

    def start(self) -> str | None:
        """The zygote's socket (started and ready), or None when it is off or broken."""
        import subprocess
        import time

        if self.off:
            return None
        if self.proc is not None and self.proc.poll() is None:
            return self.path
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", self.path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.off = True
                return None
            time.sleep(0.02)
        os.environ[SOCKET_ENV] = self.path  # launched ranks' stand-ins find it here
        return self.path

    def run(self, args: list[str], cwd, timeout: float, input: str):
        """`python args` forked from the zygote, as subprocess.run(capture_output=True,
        text=True) returns it; None when it cannot (the caller starts Python itself)."""
        import subprocess
        import tempfile

        if not usable(args):
            return None
        path = self.start()
        if path is None:
            return None
        cmd = [sys.executable, *args]
        files = [tempfile.TemporaryFile() for _ in range(3)]
        try:
            files[0].write(input.encode())
            files[0].seek(0)
            try:
                call = Call(path, args, [f.fileno() for f in files], str(cwd))
            except OSError:
                return None
            try:
                code, timed_out = call.code(timeout), False
            except TimeoutError:
                os.kill(call.pid, signal.SIGKILL)
                code, timed_out = call.code(None), True
            out, err = [
                (f.seek(0), f.read().decode("utf-8", errors="replace"))[1] for f in files[1:]
            ]
        finally:
            for f in files:
                f.close()
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(cmd, code, out, err)


def _session_nice() -> int | None:
    """This session's autogroup nice (None: no autogroups here)."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def stand_in(args: list[str]) -> None:
    """`python args` forked from the zygote with this process's streams; exits as it exits.
    Without a zygote (or refused), this process becomes `python args`."""
    path = os.environ.get(SOCKET_ENV)
    call = None
    if path and usable(args) and os.environ.get("LLAMA_TP_TEST_ZYGOTE", "1") != "0":
        read_end, write_end = os.pipe()  # the rank's lifeline: it ends when we do
        try:
            call = Call(path, args, [0, 1, 2, read_end], os.getcwd(), _session_nice())
        except OSError:
            call = None
        os.close(read_end)
    if call is None:
        os.execv(sys.executable, [sys.executable, *args])

    def forward(sig, _frame) -> None:
        try:
            os.kill(call.pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2, signal.SIGCONT):  # fmt: skip
        signal.signal(sig, forward)
    while True:
        try:
            code = call.code(None)
            break
        except InterruptedError:
            continue
    if code < 0:  # killed by a signal: so are we
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        stand_in(sys.argv[2:])
