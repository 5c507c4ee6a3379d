"""A command's start and end, the same for every command (generate, chat, serve, bench,
perplexity, convert, plan, doctor): its flags parsed and checked, the watchdog armed over
the group; then whatever it raises turned into one `error: ...` line and an exit code.

    def main() -> int:
        args = start(_parser(), check_model_args, watch=True)
        ...

    cli = script(main)  # pyproject's console script, and `python -m`'s entry

Exit codes: 0 success, 1 an error (rank 0 prints it), 2 a usage error (bad flags or
input), 3 a peer rank crashed, stopped or became unreachable (every surviving rank prints
one line naming itself: rank 0 may be the one that died), 130 Ctrl-C.

Importing this module costs nothing: what it runs is imported when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

Check = Callable[[argparse.Namespace], None]


def start(
    parser: argparse.ArgumentParser, *checks: Check, watch: bool = False
) -> argparse.Namespace:
    """The command's flags from argv: parsed (usage errors printed by rank 0 only),
    `--quiet` (or `--json`) and `--no-compile` applied, held to `checks` in order (each
    raises UsageError); with `watch`, the watchdog armed with the flags' `--timeout` and
    `--load-timeout` (if any) over the group's ranks. Returns the parsed flags."""
    from ..cluster import watchdog
    from ..cluster.distributed import world
    from .cli import apply_compile_flag, quiet

    args = parser.parse_args()
    quiet(getattr(args, "quiet", False) or getattr(args, "json", False))
    apply_compile_flag(args)
    for check in checks:
        check(args)
    if watch:  # with several ranks: a stopped peer ends every rank with one line
        watchdog.install(args.timeout, getattr(args, "load_timeout", None))
        watchdog.set_group_size(world().size())
    return args


def script(main: Callable[[], int | None]) -> Callable[[], NoReturn]:
    """The console script of the command whose body is `main`: `run(main)`."""

    def cli() -> NoReturn:
        run(main)

    cli.__doc__ = f"The console script of `python -m {main.__module__}`."
    return cli


def run(main: Callable[[], int | None]) -> NoReturn:
    """Run `main` and exit: its return code, or one `error: ...` line from rank 0.

    Under mlx.launch (MLX_RANK set), MLX's ring backend's socket messages are
    kept off stderr, and a lost peer ends every surviving rank with one line
    each (exit code 3) without waiting for MLX to tear down its broken group.
    """
    from ..checkpoints.weights_cache import wait_for_writes
    from ..cluster import watchdog
    from .cli import EXIT_ERROR, EXIT_PEER, EXIT_USAGE, UsageError

    if "MLX_RANK" in os.environ and not os.environ.get("MLX_RING_VERBOSE"):
        watchdog.filter_ring_noise()
    try:
        code = main() or 0
    except KeyboardInterrupt:
        code = 130
    except UsageError as e:
        _report(e)
        code = EXIT_USAGE
    except Exception as e:  # the entry point's job: one line, never a traceback
        if peer_lost(e):
            watchdog.uninstall()
            watchdog.report_and_exit(watchdog.lost_line(watchdog.rank_label()), EXIT_PEER)
        _report(e)
        code = EXIT_ERROR
    watchdog.uninstall()
    sys.stdout.flush()
    wait_for_writes()  # the received weights' cache, written behind the load (and its warning)
    watchdog.close_filter(final=True)  # MLX's teardown at exit may still write "[ring]"
    sys.exit(code)


def peer_lost(e: BaseException) -> bool:
    """Is `e` MLX telling us that a collective lost its connection to another rank?"""
    return isinstance(e, RuntimeError) and "connection to a peer was lost" in str(e)


def _report(e: Exception) -> None:
    from ..cluster import watchdog
    from ..cluster.distributed import first_line, is_rank0

    try:
        rank0 = is_rank0()
    except Exception:  # the group itself failed to form
        rank0 = watchdog.rank_label() == "0"
    if rank0:
        print(f"error: {first_line(e)}", file=sys.stderr, flush=True)
