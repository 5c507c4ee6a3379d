"""Benchmark results beside the page that reports them: each driver in bench/ rewrites
its own section of docs/benchmarks.md (between `<!-- results: NAME -->` and
`<!-- end of results: NAME -->`, the rest of the page untouched) and keeps its raw
results in docs/benchmarks/NAME.json, with the machine, the date and the command."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent.parent / "docs"
PAGE = DOCS / "benchmarks.md"


def begin(name: str) -> str:
    return f"<!-- results: {name} -->"


def end(name: str) -> str:
    return f"<!-- end of results: {name} -->"


def run_facts(driver: str) -> dict:
    """What every result records: the machine, the command that made it, the date."""
    return {
        "machine": (
            f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
        ),
        "command": " ".join(["python", driver, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "load_average": os.getloadavg()[0],  # a shared machine's load weighs on every figure
    }


def facts_line(res: dict) -> str:
    load = f"; load average {res['load_average']:.1f} at the start" if "load_average" in res else ""
    return f"Machine: {res['machine']}; `{res['command']}`; {res['date']}{load}."


def replace_section(name: str, markdown: str, page: str | os.PathLike = PAGE) -> Path:
    """Put `markdown` between NAME's markers in `page` (appended when they are absent)."""
    page = Path(page)  # the drivers' --out is a string
    section = f"{begin(name)}\n\n{markdown.strip()}\n\n{end(name)}\n"
    text = page.read_text() if page.exists() else ""
    pattern = re.escape(begin(name)) + ".*?" + re.escape(end(name)) + "\n?"
    if re.search(pattern, text, flags=re.S):
        text = re.sub(pattern, lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    page.write_text(text)
    return page


def write_results(name: str, res: dict, docs: Path = DOCS) -> Path:
    """The raw results of section NAME: docs/benchmarks/NAME.json."""
    path = docs / "benchmarks" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    return path
