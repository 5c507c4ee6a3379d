"""The supervisor's pieces on their own (no ranks): the command taken apart and put back,
fault lines, stream events in the three APIs' shapes, and the re-placement check."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import run_python

from llama_tp.supervisor.command import parse, rank_argv, without
from llama_tp.supervisor.faults import from_exit, from_line
from llama_tp.supervisor.hosts import Layout, layout_of
from llama_tp.supervisor.streams import ERROR, OUTPUT, PREAMBLE, Events


def test_the_command_splits_and_each_generation_gets_a_private_rank_0(tmp_path):
    spec = parse(
        ["-n", "2", "--restart", "--restart-limit", "3", "--restart-window=60", "--backend",
         "ring", "-m", "llama_tp.serve", "--port", "8080", "--host", "0.0.0.0", "--api-key",
         "k", "--max-queue", "5", "--timeout", "7", "-m", "64", "--split", "3:1"]
    )  # fmt: skip
    assert spec.launcher == ["-n", "2", "--backend", "ring"]  # the supervisor's own taken out
    assert (spec.host, spec.port, spec.api_key, spec.max_queue) == ("0.0.0.0", 8080, "k", 5)
    assert (spec.step_timeout, spec.load_timeout) == (7.0, 600.0)
    assert (spec.restart_limit, spec.restart_window) == (3, 60.0)
    argv = rank_argv(spec, "127.0.0.1", 4321)
    assert argv[:3] == [sys.executable, "-m", "llama_tp.launch"]
    assert argv[3:] == [
        "-n", "2", "--backend", "ring", "-m", "llama_tp.serve", "--api-key", "k",
        "--max-queue", "5", "--timeout", "7", "-m", "64", "--split", "3:1",
        "--host", "127.0.0.1", "--port", "4321",
    ]  # fmt: skip
    # Re-placed over the hosts that remain: their hostfile, --split memory, no mesh.
    spec = parse(
        ["--hostfile", "h.json", "--restart", "--", "python3", "-m", "llama_tp.serve",
         "--tp", "2", "--split", "1:1:2"]
    )  # fmt: skip
    assert spec.prefix == ["--", "python3", "-m", "llama_tp.serve"] and spec.mesh == ["--tp"]
    argv = rank_argv(spec, "10.0.0.1", 99, tmp_path / "left.json", 2)
    assert argv[3:] == [
        "--hostfile", str(tmp_path / "left.json"), "--", "python3", "-m", "llama_tp.serve",
        "--split", "memory", "--host", "10.0.0.1", "--port", "99",
    ]  # fmt: skip
    assert without(["--port=1", "--x", "--port", "2"], ("--port",)) == ["--x"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "2", "--restart", "-m", "llama_tp.generate"],
         "--restart supervises -m llama_tp.serve only, got -m llama_tp.generate"),
        (["--restart", "--restart-limit", "0", "-m", "llama_tp.serve"],
         "--restart: must be > 0, got 0"),
        (["--restart", "-m", "llama_tp.serve", "--max-queue", "0"],
         "--max-queue must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_commands_the_supervisor_refuses(argv, message):
    from llama_tp.console.cli import UsageError

    with pytest.raises(UsageError) as e:
        parse(argv)
    assert str(e.value) == message


def test_the_launcher_says_so_in_one_line():
    r = run_python(["-m", "llama_tp.launch", "-n", "2", "--restart", "-m", "llama_tp.chat"])
    assert r.returncode == 2
    assert r.stderr == "error: --restart supervises -m llama_tp.serve only, got -m llama_tp.chat\n"


def test_hosts_from_a_hostfile(tmp_path):
    path = tmp_path / "hosts.json"
    hosts = [{"ssh": "127.0.0.1", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]},
             {"ssh": "b", "ips": ["10.0.0.2"]}, {"ssh": "c", "ips": ["10.0.0.3"]}]  # fmt: skip
    path.write_text(json.dumps(hosts))
    layout = layout_of(["--hostfile", str(path)])
    assert layout.names() == ["127.0.0.1", "b", "c"] and layout.remote() == ["b", "c"]
    assert layout.rank0_address() == "127.0.0.1"  # local: loopback
    left = layout.without({"127.0.0.1", "c"})
    assert [h.ssh_hostname for h in left.hosts] == ["b", "b"] and left.rank0_address() == "10.0.0.2"
    left.write(tmp_path / "left.json")
    assert layout_of(["--hostfile", str(tmp_path / "left.json")]).names() == ["b"]
    assert layout_of(["-n", "3"]).names() == ["127.0.0.1"]


@pytest.mark.parametrize(
    "line, text, weight",
    [
        ("\x1b[33m[WARN] Node with rank 1 exited with code -9 \x1b[0m",
         "rank 1 was killed by SIGKILL", 6),
        ("mpirun noticed that process rank 2 with PID 77 on node b exited on signal 9 (Killed).",
         "rank 2 (host b) was killed by SIGKILL", 6),
        ("error: rank 1: cannot read /m/model.safetensors",
         "rank 1 failed: cannot read /m/model.safetensors", 5),
        ("[WARN] Node with rank 0 exited with code 1", "rank 0 exited with code 1", 4),
        ("error: rank 0: no progress for 5 s in generation step (2 sequences) (waiting on 1 "
         "other rank); a peer may be stopped or unreachable",
         "rank 0 reported: no progress for 5 s in generation step (2 sequences) (waiting on 1 "
         "other rank); a peer may be stopped or unreachable", 3),
        ("error: rank 1: lost the connection to a peer rank (it crashed or was stopped)",
         "rank 1 reported: lost the connection to a peer rank (it crashed or was stopped)", 2),
    ],
)  # fmt: skip
def test_fault_lines(line, text, weight):
    fault = from_line(line)
    assert (fault.text(), fault.weight) == (text, weight)


def test_lines_that_are_no_fault():
    for line in ("[WARN] Node with rank 1 exited with code 3", "serve: stopped", "error: x"):
        assert from_line(line) is None
    assert from_exit(-15).text() == "the ranks' launcher was killed by SIGTERM"


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def test_stream_events_in_each_api():
    from llama_tp.server.anthropic_answers import sse as anthropic_sse
    from llama_tp.server.responses import chunk

    e = Events("openai", "text/event-stream; charset=utf-8")
    role = chunk_of(chunk, role=True)
    token = chunk_of(chunk, text="Hi")
    # Bytes arrive in pieces: whole events come out.
    data = sse(role) + sse(token)
    assert e.feed(data[:10]) == [] and e.feed(data[10:]) == [sse(role), sse(token)]
    assert [e.kind(sse(role)), e.kind(sse(token))] == [PREAMBLE, OUTPUT]
    assert e.kind(b"data: [DONE]\n\n") == OUTPUT
    assert e.kind(sse({"error": {"message": "x"}})) == ERROR
    assert e.kind(sse({"choices": [], "usage": {"total_tokens": 3}})) == OUTPUT
    assert json.loads(e.fault_event("gone")[6:])["error"]["message"] == "gone"
    a = Events("anthropic", "text/event-stream")
    kinds = [
        a.kind(anthropic_sse(name, {"type": name}).encode())
        for name in ("message_start", "content_block_start", "ping", "content_block_delta",
                     "error")
    ]  # fmt: skip
    assert kinds == [PREAMBLE, PREAMBLE, PREAMBLE, OUTPUT, ERROR]
    assert a.fault_event("gone").startswith(b"event: error\ndata: ")
    o = Events("ollama", "application/x-ndjson")
    assert o.feed(b'{"message": {"role": "assistant", "content": ""}}\n{"resp') == [
        b'{"message": {"role": "assistant", "content": ""}}\n'
    ]
    assert o.kind(b'{"message": {"role": "assistant", "content": ""}}\n') == PREAMBLE
    assert o.kind(b'{"response": "Hi", "done": false}\n') == OUTPUT
    assert o.kind(b'{"error": "gone"}\n') == ERROR
    assert o.fault_event("gone") == b'{"error": "gone"}\n'


def chunk_of(chunk, role: bool = False, text: str = ""):
    """The server's own stream chunk (server/responses.py)."""
    from llama_tp.conversation.reply import ReplyDelta
    from llama_tp.server.protocol import Defaults, parse_chat

    req = parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True}, Defaults())
    return chunk(req, "chatcmpl-1", "m", ReplyDelta(content=text), role=role)


def reports(available: int, n: int) -> list[dict]:
    return [
        {"rank": r, "host": "h", "machine_available": available, "active_memory": 0}
        for r in range(n)
    ]


def test_replacement_fits_or_says_why_with_the_numbers(tiny_dir):
    from mlx._distributed_utils.common import Host

    from llama_tp.supervisor.replacement import _shape, check, rank_bytes

    full = Layout([Host(i, n, [f"10.0.0.{i}"], []) for i, n in enumerate("abc")], from_file=True)
    shape, _ = _shape(str(tiny_dir))
    whole = rank_bytes(shape, None)[0]
    third = rank_bytes(shape, [1.0, 1.0, 1.0])
    two = full.without({"c"})
    # Each host reported a third of the model available: a and b get c's share too.
    fit = check(str(tiny_dir), full, full, two, reports(whole // 3, 3), None, False)
    assert fit.fits, fit.line
    assert fit.line.startswith("re-placing model over 2 of 3 hosts (a, b): rank 0 on a holds ")
    # On a alone, the whole model: it had a third, and a third available.
    one = full.without({"b", "c"})
    fit = check(str(tiny_dir), full, full, one, reports(whole // 3, 3), None, False)
    assert not fit.fits
    from llama_tp.parallel.plan_text import human_bytes

    have = whole // 3 + third[0]
    assert fit.line == (
        f"cannot re-place model over 1 of 3 hosts (a): rank 0 on a would hold "
        f"{human_bytes(whole)} of {human_bytes(have)} available ({human_bytes(whole)} in all)"
    )
    # Without figures from the ranks the launch goes ahead unchecked, saying so.
    fit = check(str(tiny_dir), full, full, one, [], None, False)
    assert fit.fits and fit.line.endswith(
        "(memory not checked: the last ranks reported no memory figures)"
    )
