"""`python -m llama_tp.chat` through pipes: on one rank and two, its replies equal the
chat API's (`llama_tp.Chat`, test_chat.py), the slash commands, a context overflow
reported without stopping, and its usage errors. The terminal itself is exercised in
test_chat_tty.py."""

from __future__ import annotations

import pytest
from conftest import launch, run_python

WARN = "exited with code"


def expected_replies(model_dir, turns, max_tokens):
    """What `python -m llama_tp.chat` should answer, computed with the API in this process."""
    from llama_tp import Chat, load

    chat = Chat(*load(model_dir), max_tokens=max_tokens)
    out = []
    for turn in turns:
        if turn.startswith("/system "):
            chat.system = turn.removeprefix("/system ")
        else:
            out.append(chat.send(turn))
    return out


@pytest.mark.parametrize("n", [1, 2])
def test_chat_command_through_pipes(tiny_dir, monkeypatch, n):
    monkeypatch.setenv("LLAMA_TP_TERMINAL", "lines")  # even when the suite runs at a terminal
    hello, hi = expected_replies(tiny_dir, ["hello", "/system Be brief.", "hi"], 16)
    stdin = "hello\n/system Be brief.\n/help\n\nhi\n/nope\n/quit\n"
    args = ["-m", "llama_tp.chat", "--model", str(tiny_dir), "--max-tokens", "16"]
    if n == 1:
        r = run_python(args, timeout=120, input=stdin)
        assert r.returncode == 0, r.stderr
    else:
        r = launch(n, args, timeout=120, input=stdin)  # never sees the end of stdin: /quit
    assert WARN not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == f"{hello}\n{hi}\n"  # each reply once, nothing else on stdout
    assert "[system prompt set]" in r.stderr and "/reset" in r.stderr  # /help
    assert "unknown command /nope" in r.stderr


def test_chat_command_reports_overflow_and_goes_on(tiny_dir, monkeypatch):
    monkeypatch.setenv("LLAMA_TP_TERMINAL", "lines")
    args = ["-m", "llama_tp.chat", "--model", str(tiny_dir), "--max-tokens", "10"]
    r = run_python([*args, "--max-context", "45"], timeout=120, input="hello\nhello again\n")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stderr
    assert "error: the conversation needs" in r.stderr
    r = run_python([*args, "--max-context", "45", "--drop-oldest"], input="hello\nhello again\n")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2, r.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-tokens", "0"], "--max-tokens must be positive"),
        (["--temp", "-1"], "--temp must be >= 0"),
        (["--top-p", "2"], "--top-p must be in (0, 1]"),
        (["--top-k", "-1"], "--top-k must be >= 0"),
        (["--max-context", "0"], "--max-context must be positive"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_chat_command_usage_errors(flags, message):
    r = run_python(["-m", "llama_tp.chat", *flags], timeout=60)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
