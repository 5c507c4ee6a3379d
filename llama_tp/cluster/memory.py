"""This machine's memory: its total and what is available now, in bytes; and this
process's peak (`max_rss`).

    total, available = memory_figures(rank)

Linux: /proc/meminfo (MemTotal, MemAvailable). macOS: the physical memory (sysctl
hw.memsize) and, as available, the free, inactive, speculative and purgeable pages of
`vm_stat` (what the system hands out without swapping); with MLX's GPU, at most its
recommended working set (`mx.device_info()`), the most Metal keeps resident.

`--split memory` (weights from each rank's available memory, gathered at start-up)
and `doctor` read these. Testing aid: LLAMA_TP_FAKE_MEMORY="24G:12G,8G:4G" makes
rank r report the r-th entry (total:available, with K/M/G/T suffixes, powers of
1024), so that the tests can give ranks on one machine different memories.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

FAKE_ENV = "LLAMA_TP_FAKE_MEMORY"
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class MemoryFiguresError(RuntimeError):
    """The memory figures cannot be read (or the testing aid is malformed)."""


def parse_size(text: str) -> int:
    """'12G' -> 12 * 2**30; '1.5M', '4096' (bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise MemoryFiguresError(f"{text!r} is not a size like 12G, 512M or 4096")
    return int(float(m.group(1)) * _SUFFIX[m.group(2).upper()])


def fake_figures(text: str, rank: int) -> tuple[int, int]:
    """Rank `rank`'s entry of LLAMA_TP_FAKE_MEMORY ('T:A,T:A,...')."""
    entries = [e for e in text.split(",") if e.strip()]
    if rank >= len(entries):
        raise MemoryFiguresError(
            f"{FAKE_ENV}={text} has {len(entries)} entries, none for rank {rank}"
        )
    total, sep, available = entries[rank].partition(":")
    if not sep:
        raise MemoryFiguresError(f"{FAKE_ENV} entry {entries[rank]!r}: expected TOTAL:AVAILABLE")
    return parse_size(total), parse_size(available)


def linux_figures(meminfo: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from the text of /proc/meminfo."""
    fields = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if rest.strip():
            fields[name] = int(rest.split()[0]) * 1024  # kB
    return fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0))


def darwin_available(vm_stat: str) -> int:
    """Free + inactive + speculative + purgeable pages, in bytes, from `vm_stat`'s text."""
    size = re.search(r"page size of (\d+) bytes", vm_stat)
    page = int(size.group(1)) if size else 16384
    pages = 0
    for key in ("free", "inactive", "speculative", "purgeable"):
        m = re.search(rf"^Pages {key}:\s+(\d+)", vm_stat, re.MULTILINE)
        pages += int(m.group(1)) if m else 0
    return pages * page


def _metal_limit() -> int | None:
    import mlx.core as mx

    if mx.default_device().type != mx.gpu:
        return None
    return mx.device_info().get("max_recommended_working_set_size")


def memory_figures(rank: int = 0) -> tuple[int, int]:
    """(total, available) bytes of this machine (see the module docstring); `rank` picks
    the entry of the LLAMA_TP_FAKE_MEMORY testing aid."""
    fake = os.environ.get(FAKE_ENV)
    if fake:
        return fake_figures(fake, rank)
    try:
        if sys.platform == "darwin":
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            text = subprocess.run(["vm_stat"], capture_output=True, text=True, check=True).stdout
            available = darwin_available(text)
        else:
            with open("/proc/meminfo") as f:
                total, available = linux_figures(f.read())
    except (OSError, ValueError, KeyError, subprocess.CalledProcessError) as e:
        raise MemoryFiguresError(f"cannot read this machine's memory: {e}") from None
    limit = _metal_limit()
    return total, min(available, limit) if limit else available


def max_rss() -> int:
    """The process's resident-memory high-water mark, in bytes.

    Linux: VmHWM (getrusage's ru_maxrss survives exec, so a child would
    report its parent's peak); elsewhere getrusage (bytes on macOS).
    """
    import resource

    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024
