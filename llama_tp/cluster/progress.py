"""Progress bars for long work (loading, converting, benchmark trials, perplexity windows).

    for window in progress(windows, "perplexity", unit="window"):
        ...

`progress(...)` is tqdm on rank 0's stderr, with what is being done, how far and an
estimate of the time left. It is disabled (tqdm's `disable`: it iterates and ignores
`update`, showing nothing) when:

- this is not rank 0 (`MLX_RANK` set and not 0);
- stderr is not a terminal. Under `mlx.launch` a rank's stderr is a pipe to the
  launcher: rank 0 shows progress when the launcher's stderr is its terminal
  (`cluster.tty`; without /proc, when the launcher passed `COLUMNS` on, which it
  does when its output is a terminal);
- `set_quiet()` was called (the commands' `--quiet`, and `--json`, which must stay
  alone on its stream), or `LLAMA_TP_PROGRESS=0` is in the environment
  (`LLAMA_TP_PROGRESS=1` forces bars on, e.g. for a log file).

The bars clear themselves when done, so the terminal keeps only the command's output.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

_quiet = False


def set_quiet(quiet: bool = True) -> None:
    """Turn every progress bar of this process off (or back on)."""
    global _quiet
    _quiet = quiet


def active() -> bool:
    """Would `progress` show a bar here and now?"""
    forced = os.environ.get("LLAMA_TP_PROGRESS", "")
    if _quiet or forced == "0" or os.environ.get("MLX_RANK", "0") != "0":
        return False
    if forced == "1":
        return True
    try:
        if os.isatty(sys.stderr.fileno()):
            return True
    except (AttributeError, OSError, ValueError):  # replaced or closed stderr
        return False
    if "MLX_RANK" not in os.environ:
        return False
    from .tty import launcher_on_terminal

    on_terminal = launcher_on_terminal(2)
    return "COLUMNS" in os.environ if on_terminal is None else on_terminal


def progress(
    iterable: Iterable | None = None,
    desc: str = "",
    total: float | None = None,
    enabled: bool = True,
    *,
    unit: str = "it",
    unit_scale: bool = False,
    delay: float = 0.0,
    **kwargs: Any,
):
    """A tqdm bar on rank 0's stderr over `iterable` (or, without one, to `update()` by
    hand up to `total`), disabled where it must not show (see the module's docstring).

    `delay`: show the bar only once the work has taken this many seconds (for work
    that is often quick, such as loading a small model)."""
    from tqdm import tqdm  # a dependency of transformers and huggingface_hub

    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        unit_scale=unit_scale,
        delay=delay,
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
        disable=not (enabled and active()),
        **kwargs,
    )
