"""README.md runs as written, by the conventions its Quick start states:

- ```python blocks run, each in a fresh process in an empty directory;
- ```bash blocks hold only llama_tp commands, run line by line from (a copy of the
  top of) the repository, with the documented reductions (SHORTER below);
- ```sh blocks: each llama_tp command's flags must parse (a dry run), a --hostfile exist;
- ```text blocks are labelled `<!-- example output -->` or `<!-- output of: CMD -->`
  (then they are exactly what CMD prints).

A broken snippet fails here: a flag renamed, a function moved, a command that errors.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import _PORTS, BIN, ROOT

README = ROOT / "README.md"
WARN = "exited with code"
PYTHONS = ("python", "python3", ".venv/bin/python")
EXAMPLE = "<!-- example output -->"
OUTPUT_OF = re.compile(r"<!-- output of: (.+) -->")


@dataclass
class Block:
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    label: str  # the HTML comment on the line before, or ""


def parse(markdown: str) -> list[Block]:
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
        blocks.append(Block(m.group(1), "\n".join(body) + "\n", start + 1, label))
        i += 1
    return blocks


BLOCKS = parse(README.read_text(encoding="utf-8"))


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


def _set(args: list[str], flags: tuple[str, ...], value: str) -> list[str]:
    """`args` with every value of `flags` replaced by `value` (the flag added if absent)."""
    out, i, found = [], 0, False
    while i < len(args):
        if args[i] in flags:
            out += [args[i], value]
            i, found = i + 2, True
            continue
        out.append(args[i])
        i += 1
    return out if found else out + [flags[0], value]


def shorter(c: Command, tiny: Path) -> list[str]:
    """The documented reductions (README, "Conventions of this README")."""
    args = list(c.args)
    own_model = "--model" in args or "--synthetic" in args or c.name in ("doctor", "plan")
    if c.launcher is not None and not own_model:  # mlx.launch or llama_tp.launch
        args += ["--model", str(tiny)]  # several ranks: the tiny random-weight model
    if c.name in ("generate", "chat"):
        args = _set(args, ("--max-tokens", "-m"), "8")
    elif c.name == "bench":
        args = _set(args, ("--prompt-tokens", "-p"), "32")
        args = _set(args, ("--generation-tokens", "-g"), "8")
        args = _set(args, ("--num-trials", "-n"), "1")
        args = _set(args, ("--collective-steps",), "2")
        if "--synthetic" in args:
            i = args.index("--synthetic") + 1
            size, _, dtype = args[i].rpartition("-")
            args[i] = ("moe-tiny-" if size.startswith("moe") else "tiny-") + dtype
    elif c.name == "perplexity":
        args = _set(args, ("--limit-tokens",), "24")
    elif c.name == "doctor" and "--quick" not in args:
        args.append("--quick")
    return args


def argv(c: Command, args: list[str]) -> list[str]:
    run = [sys.executable, "-m", f"llama_tp.{c.name}", *args]
    if c.launcher is None:
        return run
    port = ["--starting-port", str(next(_PORTS))]
    if c.via == "llama_tp.launch":
        return [sys.executable, "-m", "llama_tp.launch", *port, *c.launcher, "--", *run]
    return [str(BIN / "mlx.launch"), *port, *c.launcher, "--", *run]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The repository's top level, linked into a scratch directory: paths such as
    tests/data/paris.txt resolve, and what the commands write stays out of the checkout."""
    d = tmp_path_factory.mktemp("readme")
    for entry in ROOT.iterdir():
        if not entry.name.startswith("."):
            (d / entry.name).symlink_to(entry)
    return d


_RESULTS: dict[str, subprocess.CompletedProcess] = {}


def run_line(c: Command, cwd: Path, tiny: Path, timeout: float = 300):
    """Run one command (reduced); identical commands in several places run once."""
    cmd = argv(c, shorter(c, tiny))
    key = shlex.join(cmd[3:] if c.launcher is not None else cmd) + c.feed + c.via
    if key in _RESULTS:
        return _RESULTS[key]
    line = (c.feed + " | " if c.feed else "") + shlex.join(cmd)
    stdin = "hi\n/quit\n" if c.name == "chat" else ""
    # mlx.launch spins on a CPU core at the end of its input: keep the pipe open.
    read_end, write_end = os.pipe()
    os.write(write_end, stdin.encode())
    if c.launcher is None:
        os.close(write_end)
    p = subprocess.Popen(
        ["bash", "-c", line],
        cwd=cwd,
        stdin=read_end,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    os.close(read_end)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        err += f"\n(killed after {timeout} s)"
    finally:
        if c.launcher is not None:
            os.close(write_end)
    _RESULTS[key] = subprocess.CompletedProcess(line, p.returncode, out, err)
    return _RESULTS[key]


def by_lang(lang: str) -> list:
    """The blocks in `lang`; bash blocks are `slow`, and `ranks` when they launch."""
    params = []
    for b in (b for b in BLOCKS if b.lang == lang):
        marks = [pytest.mark.slow] if lang == "bash" else []
        launched = "mlx.launch" in b.text or "llama_tp.launch" in b.text
        marks += [pytest.mark.ranks] if lang == "bash" and launched else []
        params.append(pytest.param(b, id=f"line{b.line}", marks=marks))
    return params


def test_every_block_follows_the_conventions():
    assert {b.lang for b in BLOCKS} <= {"python", "bash", "sh", "text", "json", ""}, BLOCKS
    assert sum(b.lang == "bash" for b in BLOCKS) >= 5 and sum(b.lang == "python" for b in BLOCKS)
    for b in BLOCKS:
        if b.lang == "bash":
            for line in lines_of(b):
                assert command(line), f"README line {b.line}: bash blocks hold llama_tp commands"
        if b.lang == "text":
            assert b.label == EXAMPLE or OUTPUT_OF.fullmatch(b.label), (
                f"README line {b.line}: a text block needs {EXAMPLE} or <!-- output of: CMD -->"
            )


@pytest.mark.parametrize("block", by_lang("python"))
def test_python_block(block, tmp_path):
    if block.label == "<!-- fragment -->":  # needs a server, several ranks or a model
        compile(block.text, f"README.md:{block.line}", "exec")
        return
    r = subprocess.run(
        [sys.executable, "-c", block.text],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"README line {block.line}:\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), r.stderr[-3000:]


@pytest.mark.parametrize("block", by_lang("bash"))
def test_bash_block(block, workdir, tiny_dir):
    for line in lines_of(block):
        c = command(line)
        r = run_line(c, workdir, tiny_dir)
        where = f"README line {block.line}: {line}\n$ {r.args}\n"
        assert r.returncode == 0 and WARN not in r.stderr, where + r.stderr[-3000:]
        assert "Traceback" not in r.stderr and "error:" not in r.stderr, where + r.stderr[-3000:]


class _DryRun(Exception):
    pass


def test_sh_blocks_parse(monkeypatch, capsys):
    """Each llama_tp command of a sh block: its flags parse (nothing runs)."""
    import importlib

    from llama_tp.console import cli

    parse = cli.ArgumentParser.parse_args

    def dry(self, *a, **kw):
        parse(self, *a, **kw)
        raise _DryRun

    monkeypatch.setattr(cli.ArgumentParser, "parse_args", dry)
    checked = 0
    for b in BLOCKS:
        if b.lang != "sh":
            continue
        for line in lines_of(b):
            c = command(line)
            if c is None:
                continue
            if c.launcher and "--hostfile" in c.launcher:
                hostfile = c.launcher[c.launcher.index("--hostfile") + 1]
                assert (ROOT / hostfile).is_file(), f"README line {b.line}: no {hostfile}"
            monkeypatch.setattr(sys, "argv", [f"llama_tp.{c.name}", *c.args])
            main = importlib.import_module(f"llama_tp.{c.name}").main
            with pytest.raises(_DryRun):
                try:
                    main()
                except SystemExit as e:
                    pytest.fail(f"README line {b.line}: {line}\n{capsys.readouterr().err}{e}")
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize(
    "block", [b for b in by_lang("text") if OUTPUT_OF.fullmatch(b.values[0].label)]
)
def test_text_block_is_the_output_of_its_command(block, workdir, tiny_dir):
    line = OUTPUT_OF.fullmatch(block.label).group(1)
    c = command(line)
    r = run_line(c, workdir, tiny_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout == block.text, f"README line {block.line}: {line} now prints\n{r.stdout}"
