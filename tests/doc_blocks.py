"""The code blocks of README.md and the docs/ pages, and the llama_tp commands in them,
as test_readme.py reads them (docs/conventions.md says what each kind of block means).

    blocks = parse(page.read_text(), "docs/serving.md")   # Block(lang, text, line, label)
    command("mlx.launch -n 2 -- python -m llama_tp.generate --prompt hi")  # a Command
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHONS = ("python", "python3", ".venv/bin/python")


@dataclass
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    label: str  # the HTML comment on the line before, or ""
    page: str = "README.md"  # relative to the repository

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"


def parse(markdown: str, page: str = "README.md") -> list[Block]:
    lines, blocks, i = markdown.splitlines(), [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        before = [line for line in lines[:start] if line.strip()][-1:]
        label = before[0].strip() if before and before[0].strip().startswith("<!--") else ""
        blocks.append(Block(m.group(1), "\n".join(body) + "\n", start + 1, label, page))
        i += 1
    return blocks


@dataclass
class Command:
    """One shell line's llama_tp command: `[ENV=...] [mlx.launch FLAGS --] PYTHON -m
    llama_tp.NAME ARGS` or `llama_tp.NAME ARGS`; `feed` is what a pipe puts before it."""

    name: str
    args: list[str]
    launcher: list[str] | None  # the launcher's own flags, None when not launched
    feed: str = ""
    via: str = "mlx.launch"  # or "llama_tp.launch"


def command(line: str) -> Command | None:
    feed, _, cmd = line.rpartition(" | ")
    tokens = shlex.split(cmd, comments=True)
    while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
        tokens.pop(0)  # environment assignments
    if tokens[:1] == ["mpirun"]:  # mpirun's own flags, then the command
        tokens = tokens[next((i for i, t in enumerate(tokens) if t in PYTHONS), len(tokens)) :]
    launcher, via = None, "mlx.launch"
    if len(tokens) >= 3 and tokens[0] in PYTHONS and tokens[1:3] == ["-m", "llama_tp.launch"]:
        from llama_tp.cluster.launcher import split_argv

        launcher, rest, module = split_argv(tokens[3:])
        if rest is None:
            return None
        tokens = [module, *rest] if module else rest
        via = "llama_tp.launch"
    elif tokens[:1] == ["mlx.launch"]:
        if "--" not in tokens:
            return None
        cut = tokens.index("--")
        launcher, tokens = tokens[1:cut], tokens[cut + 1 :]
    if len(tokens) >= 3 and tokens[0] in PYTHONS and tokens[1] == "-m":
        tokens = tokens[2:]
    if not tokens or not tokens[0].startswith("llama_tp."):
        return None
    return Command(tokens[0].removeprefix("llama_tp."), tokens[1:], launcher, feed, via)


def lines_of(block: Block) -> list[str]:
    """The block's command lines, with backslash continuations joined."""
    text = block.text.replace("\\\n", " ")
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def simple_commands(line: str) -> list[str]:
    """A shell line's simple commands: split at `;`, `&`, `&&`, `||`, with `do` dropped
    (so `for r in ...; do CMD & done; wait` gives CMD)."""
    parts = re.split(r"\s*(?:&&|\|\||;|&(?!&))\s*", line.split(" #", 1)[0])
    return [re.sub(r"^(do|then)\s+", "", p) for p in parts if p.strip()]


# A sh block's `python bench/NAME.py FLAGS` line (a benchmark driver and its flags)
DRIVER = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(?:python3?|\.venv/bin/python)\s+(bench/\w+\.py)(.*)$")
