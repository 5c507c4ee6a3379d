"""README.md and every docs/*.md page run as written, by docs/conventions.md:

- ```python blocks run, each in a fresh process in an empty directory (a fragment is
  compiled; one labelled `<!-- with server: CMD -->` runs while CMD serves);
- ```bash blocks hold only llama_tp commands, run line by line from (a copy of the
  top of) the repository, with the documented reductions (`shorter` below);
- ```sh blocks: each llama_tp command's flags must parse (a dry run), a --hostfile exist,
  a `python bench/NAME.py` driver exist and take its flags;
- ```text blocks are labelled `<!-- example output -->` or `<!-- output of: CMD -->`
  (then they are exactly what CMD prints).

A broken snippet fails here: a flag renamed, a function moved, a command that errors.
The blocks and commands are read by doc_blocks.py; links are checked by test_doc_links.py.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _PORTS, BIN, ROOT, python_cmd
from doc_blocks import DRIVER, PAGES, Command, command, lines_of, parse, simple_commands

WARN = "exited with code"
EXAMPLE = "<!-- example output -->"
OUTPUT_OF = re.compile(r"<!-- output of: (.+) -->")
WITH_SERVER = re.compile(r"<!-- with server: (.+) -->")
BLOCKS = [b for p in PAGES for b in parse(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]


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
            tiny = {"moe": "moe-tiny-", "deepseek": "deepseek-tiny-"}.get(size.split("-")[0])
            args[i] = (tiny or "tiny-") + dtype
    elif c.name == "perplexity":
        args = _set(args, ("--limit-tokens",), "24")
    elif c.name == "doctor" and "--quick" not in args:
        args.append("--quick")
    return args


def argv(c: Command, args: list[str], warm: bool = False) -> list[str]:
    """The command line of `c`; `warm`: its llama_tp process (or llama_tp.launch's ranks,
    not the launcher) forked from the warm interpreter, as `launch` (conftest.py) starts
    them: the same command without importing MLX, mlx-lm and transformers again (about
    2 s of CPU a process)."""
    run = [sys.executable, "-m", f"llama_tp.{c.name}", *args]
    if warm and (c.launcher is None or c.via == "llama_tp.launch"):
        run = python_cmd(run[1:])
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
    cmd = argv(c, shorter(c, tiny), warm=True)
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
        served = lang == "python" and WITH_SERVER.fullmatch(b.label)
        marks += [pytest.mark.slow, pytest.mark.ranks] if served else []
        params.append(pytest.param(b, id=f"{Path(b.page).stem}-line{b.line}", marks=marks))
    return params


def test_every_block_follows_the_conventions():
    langs = {b.lang for b in BLOCKS}
    assert langs <= {"python", "bash", "sh", "text", "json", ""}, langs
    assert sum(b.lang == "bash" for b in BLOCKS) >= 5 and sum(b.lang == "python" for b in BLOCKS)
    for b in BLOCKS:
        if b.lang == "bash":
            for line in lines_of(b):
                c = command(line)
                assert c, f"{b.where}: bash blocks hold llama_tp commands: {line}"
                assert c.name != "serve", f"{b.where}: serve runs until stopped: use sh"
        if b.lang == "text":
            assert b.label == EXAMPLE or OUTPUT_OF.fullmatch(b.label), (
                f"{b.where}: a text block needs {EXAMPLE} or <!-- output of: CMD -->"
            )
        if WITH_SERVER.fullmatch(b.label):
            c = command(WITH_SERVER.fullmatch(b.label).group(1))
            assert c and c.name == "serve", (
                f"{b.where}: <!-- with server: --> needs a serve command"
            )


_PY_RESULTS: dict[str, subprocess.CompletedProcess] = {}


@pytest.mark.parametrize("block", by_lang("python"))
def test_python_block(block, tmp_path, request):
    if block.label == "<!-- fragment -->":  # needs several ranks, a model or other names
        compile(block.text, f"{block.page}:{block.line}", "exec")
        return
    code = block.text
    served = WITH_SERVER.fullmatch(block.label)
    if served:  # one server per command, for all the blocks that name it
        port = request.getfixturevalue("servers")(served.group(1))
        code = code.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    if code not in _PY_RESULTS:  # the same block on two pages runs once
        _PY_RESULTS[code] = subprocess.run(
            python_cmd(["-c", code]), cwd=tmp_path, capture_output=True, text=True, timeout=300
        )
    r = _PY_RESULTS[code]
    assert r.returncode == 0, f"{block.where}:\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), r.stderr[-3000:]


@pytest.fixture(scope="module")
def servers(tiny_dir):
    """The port of a server of a `<!-- with server: -->` command, started at its first
    block and stopped when the module ends."""
    started: dict[str, tuple[subprocess.Popen, int]] = {}

    def port(text: str) -> int:
        if text not in started:
            started[text] = start_server(command(text), tiny_dir)
        return started[text][1]

    yield port
    for server, _ in started.values():
        stop_server(server)


def start_server(c: Command, tiny: Path) -> tuple[subprocess.Popen, int]:
    """`c` (a serve command, shortened) on a free port, once its /health answers 200."""
    import socket
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    c = Command(c.name, _set(c.args, ("--port",), str(port)), c.launcher, c.feed, c.via)
    p = subprocess.Popen(
        argv(c, shorter(c, tiny), warm=True),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return p, port
        except OSError:
            time.sleep(0.5)
    stop_server(p)
    pytest.fail(f"the server did not start: {p.stderr.read()[-3000:]}")


def stop_server(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.parametrize("block", by_lang("bash"))
def test_bash_block(block, workdir, tiny_dir):
    for line in lines_of(block):
        c = command(line)
        r = run_line(c, workdir, tiny_dir)
        where = f"{block.where}: {line}\n$ {r.args}\n"
        assert r.returncode == 0 and WARN not in r.stderr, where + r.stderr[-3000:]
        assert "Traceback" not in r.stderr and "error:" not in r.stderr, where + r.stderr[-3000:]


class _DryRun(Exception):
    pass


def test_sh_blocks_parse(monkeypatch, capsys):
    """Each llama_tp command and bench/ driver of a sh block: its flags parse (nothing
    runs)."""
    import argparse
    import importlib
    import runpy

    parse = argparse.ArgumentParser.parse_args

    def dry(self, *a, **kw):
        parse(self, *a, **kw)
        raise _DryRun

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", dry)
    checked = drivers = 0
    for b in BLOCKS:
        if b.lang != "sh":
            continue
        for line in (part for ln in lines_of(b) for part in simple_commands(ln)):
            if d := DRIVER.match(line):
                assert (ROOT / d.group(1)).is_file(), f"{b.where}: no {d.group(1)}"
                argv = [d.group(1), *shlex.split(d.group(2))]
                monkeypatch.setattr(sys, "argv", argv)
                with pytest.raises(_DryRun):
                    try:
                        runpy.run_path(str(ROOT / d.group(1)), run_name="__main__")
                    except SystemExit as e:
                        pytest.fail(f"{b.where}: {line}\n{capsys.readouterr().err}{e}")
                drivers += 1
                continue
            c = command(line)
            if c is None:
                continue
            if c.launcher and "--hostfile" in c.launcher:
                hostfile = c.launcher[c.launcher.index("--hostfile") + 1]
                assert (ROOT / hostfile).is_file(), f"{b.where}: no {hostfile}"
            monkeypatch.setattr(sys, "argv", [f"llama_tp.{c.name}", *c.args])
            module = importlib.import_module(f"llama_tp.{c.name}")
            if not hasattr(module, "main"):  # a package (python -m llama_tp.kernels)
                module = importlib.import_module(f"llama_tp.{c.name}.__main__")
            main = module.main
            with pytest.raises(_DryRun):
                try:
                    main()
                except SystemExit as e:
                    pytest.fail(f"{b.where}: {line}\n{capsys.readouterr().err}{e}")
            checked += 1
    assert checked >= 8 and drivers >= 5, (checked, drivers)


@pytest.mark.parametrize(
    "block", [b for b in by_lang("text") if OUTPUT_OF.fullmatch(b.values[0].label)]
)
def test_text_block_is_the_output_of_its_command(block, workdir, tiny_dir):
    line = OUTPUT_OF.fullmatch(block.label).group(1)
    c = command(line)
    r = run_line(c, workdir, tiny_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout == block.text, f"{block.where}: {line} now prints\n{r.stdout}"
