"""The supervised command, taken apart and put back together for each generation of ranks.

    python -m llama_tp.launch -n 2 --restart [--restart-limit 5 --restart-window 600] \\
        -m llama_tp.serve --port 8080 --api-key secret ...

splits into the launcher's flags (`-n 2`, `--hostfile`, `--backend` ...: passed on
unchanged), the supervisor's own (`--restart*`) and the server's arguments. The supervisor
reads only the few server flags it needs (where to listen, the key, the queue bound, the
timeouts, the model and its split); the ranks parse and check all of them.
Each generation runs the same command with rank 0 on a private address instead of the
public one (`rank_argv`), and, when re-placed over fewer hosts, another hostfile and
`--split memory` (`rank_argv(..., replaced=True)`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..cluster.launcher import split_argv
from ..console.cli import DEFAULT_LOAD_TIMEOUT, DEFAULT_TIMEOUT, UsageError

SERVE = "llama_tp.serve"
RESTART_LIMIT = 5  # failures (faults and launches that never served) ...
RESTART_WINDOW = 600.0  # ... within this many seconds, and the supervisor stops
_OWN = {"--restart": False, "--restart-limit": True, "--restart-window": True}  # takes a value
_MESH = ("--tp", "--pp", "--dp")


@dataclass
class Spec:
    """What the supervisor needs to know about the command it runs."""

    launcher: list[str]  # the launcher's flags, the supervisor's own taken out
    prefix: list[
        str
    ]  # how the command names the server: ["-m", SERVE] or ["--", python, "-m", SERVE]
    serve: list[str]  # the server's arguments as given
    host: str = "127.0.0.1"  # the public address (the front door's)
    port: int = 8080
    api_key: str | None = None
    max_queue: int = 64  # requests held while recovering, at most (the server's --max-queue)
    step_timeout: float = DEFAULT_TIMEOUT  # 0: off
    load_timeout: float = DEFAULT_LOAD_TIMEOUT  # 0: off
    model: str | None = None
    split: str | None = None
    cors: list[str] | None = None
    allowed_hosts: list[str] | None = None  # the server's --allowed-hosts (the front's too)
    max_body: int = 0  # the server's --max-body-bytes (0: the server's own bound)
    restart_limit: int = RESTART_LIMIT
    restart_window: float = RESTART_WINDOW
    mesh: list[str] = field(default_factory=list)  # --tp/--pp/--dp given (dropped when re-placed)


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _serve_parser() -> argparse.ArgumentParser:
    """The server flags the supervisor reads (the rest are the ranks' to check)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    p.add_argument("--load-timeout", type=float, default=DEFAULT_LOAD_TIMEOUT)
    p.add_argument("--model", default=None)
    p.add_argument("--split", default=None)
    p.add_argument("--cors", default=None)
    p.add_argument("--allowed-hosts", default=None)
    p.add_argument("--max-body-bytes", type=int, default=0)
    for flag in _MESH:
        p.add_argument(flag, type=int, default=None)
    return p


def _own_flags(flags: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the launcher's flags, the supervisor's own as {flag: value})."""
    rest, own, i = [], {}, 0
    while i < len(flags):
        name, eq, value = flags[i].partition("=")
        if name not in _OWN:
            rest.append(flags[i])
            i += 1
            continue
        if _OWN[name] and not eq:
            if i + 1 >= len(flags):
                raise UsageError(f"{name} needs a value")
            value = flags[i + 1]
            i += 1
        own[name] = value
        i += 1
    return rest, own


def _serve_args(command: list[str] | None, module: str | None) -> tuple[list[str], list[str]]:
    """(prefix, the server's arguments) of the command, which must be llama_tp.serve."""
    if module == SERVE:
        return ["-m", SERVE], list(command or [])
    if command and module is None and SERVE in command:  # -- python -m llama_tp.serve ...
        i = command.index(SERVE)
        if i >= 1 and command[i - 1] == "-m":
            return ["--", *command[: i + 1]], command[i + 1 :]
    shown = f"-m {module}" if module else " ".join(command or []) or "nothing"
    raise UsageError(f"--restart supervises -m {SERVE} only, got {shown}")


def parse(argv: list[str]) -> Spec:
    """The supervised command of `python -m llama_tp.launch ... --restart ...` (UsageError
    for what it cannot run)."""
    try:
        flags, command, module = split_argv(argv)
    except ValueError as e:
        raise UsageError(str(e)) from None
    launcher, own = _own_flags(flags)
    prefix, serve = _serve_args(command, module)
    try:
        args, _ = _serve_parser().parse_known_args(serve)
        limit = _positive(int)(own.get("--restart-limit", str(RESTART_LIMIT)))
        window = _positive(float)(own.get("--restart-window", str(RESTART_WINDOW)))
    except (argparse.ArgumentError, argparse.ArgumentTypeError, ValueError) as e:
        raise UsageError(f"--restart: {e}") from None
    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {args.max_queue}")
    cors = [o.strip() for o in args.cors.split(",") if o.strip()] if args.cors else None
    hosts = args.allowed_hosts
    hosts = [h.strip() for h in hosts.split(",") if h.strip()] if hosts else None
    return Spec(
        launcher=launcher,
        prefix=prefix,
        serve=serve,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_queue=args.max_queue,
        step_timeout=args.timeout,
        load_timeout=args.load_timeout,
        model=args.model,
        split=args.split,
        cors=cors,
        allowed_hosts=hosts,
        max_body=args.max_body_bytes,
        restart_limit=limit,
        restart_window=window,
        mesh=[f for f in _MESH if getattr(args, f[2:]) is not None],
    )


def without(args: list[str], names: tuple[str, ...]) -> list[str]:
    """`args` without the flags `names` and their values (`--port 1` and `--port=1`)."""
    out, i = [], 0
    while i < len(args):
        name = args[i].partition("=")[0]
        if name in names:
            i += 1 if "=" in args[i] else 2
            continue
        out.append(args[i])
        i += 1
    return out


def rank_argv(
    spec: Spec,
    host: str,
    port: int,
    hostfile: Path | None = None,
    ranks: int | None = None,
) -> list[str]:
    """`python -m llama_tp.launch ...` for one generation: rank 0 listens on `host`:`port`.
    Re-placed (`hostfile`: the hosts that remain, `ranks` of them): that hostfile, the
    memory-weighted split when several ranks remain, no mesh flags."""
    launcher, serve = list(spec.launcher), without(spec.serve, ("--host", "--port"))
    if hostfile is not None:
        launcher = [*without(launcher, ("--hostfile", "--hosts")), "--hostfile", str(hostfile)]
        serve = without(serve, ("--split", *_MESH))
        if (ranks or 1) > 1:
            serve += ["--split", "memory"]
    command = [*spec.prefix, *serve, "--host", host, "--port", str(port)]
    return [sys.executable, "-m", "llama_tp.launch", *launcher, *command]
