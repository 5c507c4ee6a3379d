"""What every command-line entry point shares: rank-aware argument errors and
turning exceptions into one line on stderr with a non-zero exit code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from .distributed import is_rank0

EXIT_ERROR = 1
EXIT_USAGE = 2


class UsageError(ValueError):
    """Bad command-line input: exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that prints usage errors on rank 0 only (every rank parses the same argv)."""

    def error(self, message: str) -> NoReturn:
        if is_rank0():
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)


def run(main: Callable[[], int | None]) -> NoReturn:
    """Run `main` and exit: its return code, or one `error: ...` line from rank 0."""
    try:
        code = main() or 0
    except KeyboardInterrupt:
        code = 130
    except UsageError as e:
        _report(e)
        code = EXIT_USAGE
    except Exception as e:  # the entry point's job: one line, never a traceback
        _report(e)
        code = EXIT_ERROR
    sys.stdout.flush()
    sys.exit(code)


def _report(e: Exception) -> None:
    if is_rank0():
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {text}", file=sys.stderr, flush=True)
