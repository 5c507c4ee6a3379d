"""Local ranks under any launcher: the defaults they apply themselves
(cluster/local_ranks.py), and the backend `llama_tp.launch` picks for them
(cluster/backend_choice.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import _PORTS, BIN, ROOT, requires

from llama_tp.cluster import backend_choice, local_ranks

PROBE = (
    "import os; from llama_tp.cluster.distributed import world; r = world().rank(); "
    "e = os.environ; p = os.getppid(); "
    "cores = sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in "
    "os.listdir('/proc/self/task')}); "
    "nice = sorted({os.getpriority(os.PRIO_PROCESS, int(t)) "
    "for t in os.listdir(f'/proc/{p}/task')}); "
    "session = open('/proc/self/autogroup').read().split()[-1]; "
    "os.write(1, f\"{r} {e.get('LLAMA_TP_KERNEL_THREADS')} {e.get('LLAMA_TP_CORES')} "
    '{cores} {nice} {session}\\n".encode())'
)
_OURS = ("LLAMA_TP_KERNEL_THREADS", "LLAMA_TP_CORES", "LLAMA_TP_LAUNCHER_NICE")
_OURS += ("LLAMA_TP_SESSION_NICE",)


def test_local_ranks_from_the_hostfile_and_from_mpi(tmp_path, monkeypatch):
    for k in ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "MLX_HOSTFILE"):
        monkeypatch.delenv(k, raising=False)
    assert local_ranks.local_ranks(0, 2) is None  # nothing tells
    hosts = tmp_path / "hosts.json"
    # ranks 0 and 2 here (loopback), rank 1 on a documentation address (never this host)
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["192.0.2.7:5001"], ["127.0.0.1:5002"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hosts))
    assert local_ranks.local_ranks(0, 3) == (0, 2)
    assert local_ranks.local_ranks(2, 3) == (1, 2)
    assert local_ranks.local_ranks(1, 3) is None  # not here: it cannot be
    assert local_ranks.local_ranks(0, 2) is None  # a hostfile of another size
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert local_ranks.local_ranks(5, 8) == (1, 4)


def test_ranks_under_mlx_launch_apply_the_local_defaults():
    """mlx.launch passes nothing: each rank finds both ranks local, takes its share of
    the cores for the kernels' threads and its own core, and lowers mlx.launch (the
    parent that polls in a loop) to nice 19, and its session (mlx.launch's) to nice 10
    while it runs, as `llama_tp.launch` does for the ranks it pins (pinned ranks starve
    the other sessions); what is set already is kept."""
    from llama_tp.cluster.affinity import SESSION_NICE, parse_cores, rank_cores, usable_cores

    env = {k: v for k, v in os.environ.items() if k not in _OURS}

    def ranks(extra: dict) -> list[str]:
        cmd = [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(next(_PORTS))]
        cmd += ["--", sys.executable, "-c", PROBE]
        r = subprocess.run(
            cmd, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=120,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        return sorted(x for x in r.stdout.splitlines() if x[:1].isdigit())

    usable = usable_cores()
    spec = rank_cores(2, usable)
    threads = max(1, len(usable) // 2)
    want = [f"{r} {threads} {spec} {[tuple(parse_cores(spec, r))]} [19]" for r in (0, 1)]
    assert ranks({}) == [f"{w} {SESSION_NICE}" for w in want]
    assert ranks({"LLAMA_TP_SESSION_NICE": "3"}) == [f"{w} 3" for w in want]
    mine = ranks({"LLAMA_TP_CORES": "off", "LLAMA_TP_LAUNCHER_NICE": "0"})
    ours = os.getpriority(os.PRIO_PROCESS, 0)  # mlx.launch left at this process's nice
    # not pinned: the session (a new one, at nice 0) is left as it is
    assert mine == [f"{r} {threads} off {[tuple(usable)]} [{ours}] 0" for r in (0, 1)]


HOLD = (
    "from llama_tp.cluster.affinity import lower_session_for_exit; "
    "print(lower_session_for_exit(10), flush=True); input()"
)
SESSION = f"""
import subprocess, sys
from llama_tp.cluster.affinity import session_nice
rank = lambda: subprocess.Popen(
    [sys.executable, "-c", {HOLD!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
)
a, b = rank(), rank()
print(a.stdout.readline().strip(), b.stdout.readline().strip(), session_nice())
b.communicate("")
print(session_nice())
a.communicate("")
print(session_nice())
"""


def test_the_last_rank_of_a_session_restores_it():
    """Ranks of one session that lower it hold it together: the first to exit leaves it
    lowered under the one still running, and the last puts it back (the race in which a
    rank of a 2-rank launch read its session's nice as 0: its peer had ended first). What
    killed ranks left of another session is removed."""
    from llama_tp.cluster.affinity import _holders_file

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Path(_holders_file("999999999"))
    stale.write_text(json.dumps({"pids": [gone.pid], "restore": 0}))
    r = subprocess.run(
        [sys.executable, "-c", SESSION], cwd=ROOT, capture_output=True, text=True,
        timeout=60, start_new_session=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["0 0 10", "10", "0"], r.stdout
    assert not stale.exists()


def test_the_backend_for_local_ranks(monkeypatch):
    monkeypatch.setattr(backend_choice, "open_mpi", lambda: None)
    pick = backend_choice.default_backend
    mpi = pick(["-n", "2"], 2, None, False)
    assert mpi.flags == ["--backend", "mpi"] and mpi.reason.startswith("mpi (")
    assert pick(["-n", "2", "--backend", "ring"], 2, "ring", False).flags == []
    assert pick(["-n", "2", "--starting-port", "5000"], 2, None, False).backend is None
    assert "hosts given" in pick(["--hostfile", "h.json"], 2, None, True).reason
    assert pick(["-n", "3"], 3, None, False).backend == "mpi"  # more ranks than cores too
    monkeypatch.setattr(backend_choice, "open_mpi", lambda: "Open MPI is not installed (...)")
    assert pick(["-n", "2"], 2, None, False).reason == "ring (Open MPI is not installed (...))"


@requires("mpi")
def test_local_ranks_get_open_mpi_with_the_reason(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in _OURS}
    env["OMPI_MCA_orte_tmpdir_base"] = str(tmp_path)  # its session directory
    # Each rank writes its own file: Open MPI forwards the ranks' stdout in pieces that
    # may interleave mid-line.
    code = (
        "import pathlib; from llama_tp.cluster.distributed import launched_backend, world; "
        f"g = world(); pathlib.Path({str(tmp_path)!r}, f'rank{{g.rank()}}').write_text("
        "f'{g.rank()} {g.size()} {launched_backend()}')"
    )
    cmd = [sys.executable, "-m", "llama_tp.launch", "--verbose", "-n", "2"]
    cmd += ["--", sys.executable, "-c", code]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = [(tmp_path / f"rank{i}").read_text() for i in range(2)]
    assert got == ["0 2 mpi", "1 2 mpi"], r.stderr
    assert f"launch: backend mpi ({backend_choice.MPI_REASON})" in r.stderr
