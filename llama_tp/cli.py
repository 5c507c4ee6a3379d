"""What every command-line entry point shares: rank-aware argument errors and
turning exceptions into one line on stderr with a non-zero exit code.

Exit codes: 0 success, 1 an error (rank 0 prints it), 2 a usage error (bad
flags or input), 3 a peer rank crashed, stopped or became unreachable (every
surviving rank prints one line naming itself: rank 0 may be the one that died),
130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from . import watchdog
from .distributed import is_rank0

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PEER = watchdog.EXIT_PEER
DEFAULT_TIMEOUT = 60.0  # seconds, for each generation step
DEFAULT_LOAD_TIMEOUT = 600.0  # seconds, for loading, the start-up checks, the prompt


class UsageError(ValueError):
    """Bad command-line input: exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that prints usage errors on rank 0 only (every rank parses the same argv)."""

    def error(self, message: str) -> NoReturn:
        if is_rank0():
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)


def add_model_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """The model and sampling flags that generate and chat share (mlx_lm's names)."""
    p.add_argument(
        "--model",
        help="GGUF file, Hugging Face/MLX directory or hub repo id "
        "(default: the built-in SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--max-tokens",
        "-m",
        type=int,
        default=max_tokens,
        help=f"new tokens at most (default {max_tokens})",
    )
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--min-p", type=float, default=0.0, help="keep tokens >= min-p * the best")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system-prompt", default=None)
    p.add_argument(
        "--no-vocab-parallel",
        action="store_true",
        help="keep the embedding and output head whole on every rank",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="with several ranks: give up when a generation step makes no progress for "
        f"this long, e.g. a stopped peer (default {DEFAULT_TIMEOUT:g}; 0: never)",
    )
    p.add_argument(
        "--load-timeout",
        type=float,
        default=DEFAULT_LOAD_TIMEOUT,
        metavar="SECONDS",
        help="the same for loading, the start-up checks and processing the prompt "
        f"(default {DEFAULT_LOAD_TIMEOUT:g}; 0: never)",
    )


def check_model_args(args: argparse.Namespace) -> None:
    """Raise UsageError, naming the value, for sampling flags out of range."""
    if args.max_tokens <= 0:
        raise UsageError(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.temp < 0:
        raise UsageError(f"--temp must be >= 0, got {args.temp}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.min_p <= 1:
        raise UsageError(f"--min-p must be in [0, 1], got {args.min_p}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {args.top_k}")
    for flag in ("timeout", "load_timeout"):
        value = getattr(args, flag)
        if not value >= 0:  # NaN too
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 0 seconds, got {value}")


def start_watchdog(args: argparse.Namespace) -> None:
    """With several ranks: the watchdog with the command's timeouts (see llama_tp.watchdog)."""
    watchdog.install(args.timeout, args.load_timeout)


def peer_lost(e: BaseException) -> bool:
    """Is `e` MLX telling us that a collective lost its connection to another rank?"""
    return isinstance(e, RuntimeError) and "connection to a peer was lost" in str(e)


def run(main: Callable[[], int | None]) -> NoReturn:
    """Run `main` and exit: its return code, or one `error: ...` line from rank 0.

    Under mlx.launch (MLX_RANK set), MLX's ring backend's socket messages are
    kept off stderr, and a lost peer ends every surviving rank with one line
    each (exit code 3) without waiting for MLX to tear down its broken group.
    """
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
            line = f"error: rank {watchdog.rank_label()}: {watchdog.PEER_LOST}"
            watchdog.report_and_exit(line, EXIT_PEER)
        _report(e)
        code = EXIT_ERROR
    watchdog.uninstall()
    sys.stdout.flush()
    watchdog.close_filter()
    sys.exit(code)


def _report(e: Exception) -> None:
    try:
        rank0 = is_rank0()
    except Exception:  # the group itself failed to form
        rank0 = watchdog.rank_label() == "0"
    if rank0:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {text}", file=sys.stderr, flush=True)
