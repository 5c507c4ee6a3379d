"""No hangs: a watchdog thread for collectives that never return, and quiet peer failures.

MLX collectives have no timeout: a stopped or unreachable peer blocks every other
rank inside `mx.eval` forever. The main thread then sits in C++ with the GIL
released, so a Python daemon thread keeps running and can end the process:

    watchdog.install(step_timeout=60, load_timeout=600)   # the commands do this
    with watchdog.stage("loading", "load"):
        load(...)
    # stream_generate arms "prompt processing" and then "generation step N" itself

A stage is armed for its timeout; `progress()` restarts the clock (and renames
the stage). When an armed stage makes no progress for its timeout, the rank
prints one line and exits with code 3 (`os._exit`: the main thread is stuck).
Every live rank does so, each naming itself, because any rank, rank 0
included, may be the one that stopped. Without `install()` (the Python API, a
single process) every call here is a cheap no-op.

A crashed peer is usually reported by MLX itself ("[ring] connection to a peer
was lost", which the commands turn into one line), but not always: a
send or receive queued after MLX's socket thread gave up waits forever. So the
watchdog also watches the ring's own sockets (peeking, never reading): when a
neighbour's end is closed and this process has not finished within
`HANGUP_GRACE` seconds, it reports the lost peer and exits (code 3).

MLX's ring backend also writes every failed socket call of a broken connection
to stderr ("[ring] Socket 5 was closed by the peer", ...); `filter_ring_noise()`
puts a pipe in front of file descriptor 2 that drops those lines and forwards
everything else.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator

EXIT_PEER = 3  # a peer crashed, stopped or became unreachable
HANGUP_GRACE = 2.0  # seconds a rank may still run after a neighbour closed its connection
PEER_LOST = "lost the connection to a peer rank (it crashed or was stopped)"


def rank_label() -> str:
    """This process's rank as its launcher set it (mlx.launch or mpirun; "0" alone)."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return os.environ[name]
    return "0"


class RingNoiseFilter:
    """Drops the lines MLX's ring backend writes to fd 2 ("[ring] ..."), forwards the rest.

    A thread copies the pipe to the real stderr; `close()` puts the real stderr
    back on fd 2 and waits until everything written before has been forwarded.
    """

    PREFIX = b"[ring]"

    def __init__(self) -> None:
        sys.stderr.flush()
        self.real_fd = os.dup(2)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._read_fd = read_fd
        self._mid_line = False  # the last bytes forwarded did not end a line
        self._dropping = False  # inside a "[ring]" line
        self._held = b""  # the start of a line that may become a "[ring]" line
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._pump, name="llama_tp-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                self._write(self._held)  # an unfinished line at the end: keep it
                os.close(self._read_fd)
                return
            self._write(self.filter(data))

    def filter(self, data: bytes) -> bytes:
        """The part of `data` to forward (keeps state across calls: lines arrive in pieces)."""
        out = bytearray()
        data, self._held = self._held + data, b""
        while data:
            nl = data.find(b"\n")
            piece = data if nl < 0 else data[: nl + 1]
            data = data[len(piece) :]
            if self._mid_line or (not self._dropping and not piece.startswith(self.PREFIX)):
                if nl < 0 and not self._mid_line and self.PREFIX.startswith(piece):
                    self._held = piece  # "[ri": wait to see whether it is a ring line
                    break
                out += piece
                self._mid_line = nl < 0
            else:  # a ring line, possibly in several pieces (std::cerr is unbuffered)
                self._dropping = nl < 0
        return bytes(out)

    def _write(self, data: bytes) -> None:
        # Never stop reading: a full pipe would block every writer of fd 2.
        with contextlib.suppress(OSError):
            while data:
                data = data[os.write(self.real_fd, data) :]

    def close(self, timeout: float = 2.0, final: bool = False) -> None:
        """Forward what is still in the pipe and restore fd 2 (idempotent, any thread).

        `final` (the process is about to exit): fd 2 goes to /dev/null instead, because
        MLX's threads may still be writing a "[ring]" line, piece by piece, and tearing
        its groups down at exit writes more; write last words to `real_fd`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        target = os.open(os.devnull, os.O_WRONLY) if final else self.real_fd
        os.dup2(target, 2)  # the pipe's last writer is gone: the pump sees its end
        self._thread.join(timeout)


class Watchdog:
    """Ends the process when an armed stage makes no progress for its timeout.

    `timeouts` maps a kind ("step", "load") to seconds; 0 or None disables that kind.
    """

    def __init__(self, timeouts: dict[str, float | None], poll: float = 0.2) -> None:
        self.timeouts = dict(timeouts)
        self.rank = rank_label()
        self.size: int | None = None  # set once the group exists
        self._state: tuple[str, float, float] | None = None  # (stage, timeout, deadline)
        self._cleanups: list[Callable[[], None]] = []
        self._peers: list[socket.socket] = []  # duplicates of the ring's connections
        self._hangup: float | None = None  # when a neighbour's connection was found closed
        self._poll = poll
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="llama_tp-watchdog", daemon=True)
        self._thread.start()

    def arm(self, name: str, kind: str = "step") -> None:
        """Start (or restart) the clock for stage `name` with the timeout of `kind`."""
        timeout = self.timeouts.get(kind)
        self._state = (name, timeout, time.monotonic() + timeout) if timeout else None

    def disarm(self) -> None:
        self._state = None

    @contextlib.contextmanager
    def stage(self, name: str, kind: str = "step") -> Iterator[None]:
        before = self._state
        self.arm(name, kind)
        try:
            yield
        finally:
            # The enclosing stage continues with a fresh clock.
            self._state = None if before is None else (*before[:2], time.monotonic() + before[1])

    def on_exit(self, cleanup: Callable[[], None]) -> None:
        """Run `cleanup` (from the watchdog thread) before exiting, e.g. restore a terminal."""
        self._cleanups.append(cleanup)

    def watch_peers(self) -> None:
        """Start watching the ring backend's connections to the neighbouring ranks."""
        self._peers = ring_sockets()

    def stop(self) -> None:
        self._state = None
        self._stopped.set()

    def message(self, name: str, timeout: float) -> str:
        others = "the other ranks"
        if self.size is not None:
            others = f"{self.size - 1} other rank{'s' * (self.size > 2)}"
        return (
            f"error: rank {self.rank}: no progress for {timeout:g} s in {name} "
            f"(waiting on {others}); a peer may be stopped or unreachable{detail()}"
        )

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll):
            state, now = self._state, time.monotonic()
            if state is not None and now > state[2]:
                self._fire(self.message(state[0], state[1]))
            if self._hangup is None and any(map(_hung_up, self._peers)):
                self._hangup = now
            if self._hangup is not None and now - self._hangup > HANGUP_GRACE:
                self._fire(lost_line(self.rank))

    def _fire(self, line: str) -> None:
        if self._stopped.is_set():  # the process is finishing on its own
            return
        for cleanup in self._cleanups:
            with contextlib.suppress(Exception):
                cleanup()
        report_and_exit(line, EXIT_PEER)


def ring_sockets() -> list[socket.socket]:
    """Duplicates of this process's TCP connections to the addresses in MLX_HOSTFILE
    (the ring backend's links to its neighbours); empty for other backends."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            hosts = json.load(f)
        addresses = set()
        for node in hosts:
            for ip_port in node:
                ip, _, port = ip_port.rpartition(":")
                addresses.add((ip, int(port)))
        fds = [int(name) for name in os.listdir("/dev/fd")]
    except (KeyError, OSError, ValueError, TypeError, AttributeError):
        return []
    if socket.getdefaulttimeout() is not None:
        return []  # a socket object would switch MLX's descriptors to non-blocking mode
    found: list[socket.socket] = []
    for fd in fds:
        if any(s.fileno() == fd for s in found):
            continue  # our own duplicate, on a number that was free when listed
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            ends = {s.getsockname()[:2], s.getpeername()[:2]}
        except OSError:
            ends = set()
        if s.type == socket.SOCK_STREAM and ends & addresses:
            found.append(s)
        else:
            s.close()
    return found


def _hung_up(s: socket.socket) -> bool:
    """Has the other end closed this connection? (Peeks: MLX's data stays where it is.)"""
    try:
        return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False  # open, nothing to read
    except OSError:
        return True  # reset by the peer


_filter: RingNoiseFilter | None = None
_active: Watchdog | None = None
_doing: str | None = None  # what this rank is waiting for, for the lines above


def doing(what: str | None) -> None:
    """Say what this rank is in the middle of ("while receiving X from rank 0"), for the
    lost-peer and no-progress lines (None: nothing in particular). Cheap; any thread."""
    global _doing
    _doing = what


def detail() -> str:
    return f" {_doing}" if _doing else ""


def lost_line(rank: str) -> str:
    """The one line a rank prints when a peer is lost, with what it was doing."""
    return f"error: rank {rank}: {PEER_LOST}{detail()}"


def filter_ring_noise() -> RingNoiseFilter:
    """Install the fd-2 filter for this process (once)."""
    global _filter
    if _filter is None:
        _filter = RingNoiseFilter()
    return _filter


def close_filter(final: bool = False) -> int:
    """Forward what the filter holds and put the real stderr back, or with `final`
    (just before exiting) silence fd 2. Returns the fd of the real stderr."""
    if _filter is None:
        return 2
    _filter.close(final=final)
    return _filter.real_fd


_exiting = threading.Lock()


def report_and_exit(line: str, code: int) -> None:
    """Print `line` on the real stderr after everything written before it, and exit now
    (the first caller only: a second thread arriving here waits for the exit)."""
    _exiting.acquire()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    fd = close_filter(final=True)
    with contextlib.suppress(OSError):
        os.write(fd, (line + "\n").encode())
    os._exit(code)


_RANK_VARIABLES = {"MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}


def install(step_timeout: float | None, load_timeout: float | None) -> Watchdog | None:
    """Start this process's watchdog when it is one of several ranks: MLX_RANK set
    (mlx.launch, ring or JACCL) or an MPI launcher's rank variable (mpirun)."""
    global _active
    if not _RANK_VARIABLES & os.environ.keys():
        return None
    if _active is not None:
        _active.stop()
    _active = Watchdog({"step": step_timeout, "load": load_timeout})
    return _active


def uninstall() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def set_group_size(size: int) -> None:
    """Call once the group exists: the world size for the message, and the
    connections to watch (a single process needs no watchdog)."""
    if _active is not None:
        if size == 1:
            uninstall()
        else:
            _active.size = size
            _active.watch_peers()


def stage(name: str, kind: str = "step") -> contextlib.AbstractContextManager:
    """Arm the watchdog (if installed) for the duration of the `with` block."""
    return _active.stage(name, kind) if _active is not None else contextlib.nullcontext()


def progress(name: str, kind: str = "step") -> None:
    """The current stage moved on: restart its clock under a new name."""
    if _active is not None and _active._state is not None:
        _active.arm(name, kind)


def on_exit(cleanup: Callable[[], None]) -> None:
    if _active is not None:
        _active.on_exit(cleanup)


def state() -> dict:
    """This process's watchdog for a status page: whether one runs, its timeouts and
    the stage it is timing now (None between stages, e.g. on an idle server)."""
    w = _active
    if w is None:
        return {"active": False, "timeouts": {}, "stage": None, "seconds_left": None}
    current = w._state
    return {
        "active": True,
        "timeouts": {k: v for k, v in w.timeouts.items() if v},
        "stage": current[0] if current else None,
        "seconds_left": round(current[2] - time.monotonic(), 3) if current else None,
    }
