"""`python -m llama_tp.launch ... --restart -m llama_tp.serve ...`: the supervisor's process.

It binds the public address itself (an error names it), then runs the front door
(uvicorn, on this process's event loop) and the supervisor's loop side by side. SIGTERM
stops the ranks and the front door and exits 0 (SIGINT: 130); giving up after too many
failures exits 1; ranks that fail to start the first time (before ever serving: bad
flags, a model that does not load) end it with their exit code, 1 or 2.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

from ..cluster.listen import bind
from ..console.cli import UsageError

MISSING = 'the supervisor needs FastAPI, uvicorn, prometheus_client and httpx2: pip install "llama_tp[serve]"'  # noqa: E501


def run(argv: list[str]) -> int:
    """The supervisor: 0 when stopped by a signal, 1 after giving up or on an error, 2
    for a usage error."""
    from .command import parse
    from .hosts import layout_of

    try:
        spec = parse(argv)
        layout = layout_of(spec.launcher)
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import fastapi  # noqa: F401
        import httpx2  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print(f"error: {MISSING}", file=sys.stderr)
        return 1
    try:
        sock = bind(spec.host, spec.port)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return asyncio.run(_serve(spec, layout, sock))


async def _serve(spec, layout, sock: socket.socket) -> int:
    import httpx2
    import uvicorn

    from .control import Supervisor, say
    from .front import build_front

    class Server(uvicorn.Server):
        def capture_signals(self):  # the supervisor handles SIGTERM and SIGINT itself
            import contextlib

            return contextlib.nullcontext()

    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=32)
    timeout = httpx2.Timeout(None, connect=5.0)  # a stream may wait long for its tokens
    async with httpx2.AsyncClient(timeout=timeout, limits=limits) as client:
        sup = Supervisor(spec, layout, client)
        config = uvicorn.Config(
            build_front(sup, client),
            log_level="warning",
            http="h11",
            ws="none",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=3,
        )
        server = Server(config)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, sup.request_stop, 0)
        loop.add_signal_handler(signal.SIGINT, sup.request_stop, 130)
        http = asyncio.create_task(server.serve(sockets=[sock]))
        ranks = len(layout.hosts)
        say(
            f"supervisor: listening on http://{spec.host}:{sock.getsockname()[1]}; starting "
            f"{ranks} rank{'s' * (ranks > 1)} (--restart-limit {spec.restart_limit} in "
            f"{spec.restart_window:g} s)"
        )
        try:
            code = await sup.run()
        finally:
            server.should_exit = True
            await asyncio.wait([http], timeout=10)
    return code
