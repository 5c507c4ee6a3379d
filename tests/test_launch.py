"""`python -m llama_tp.launch`: mlx.launch's launcher without its busy loop."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from conftest import _PORTS, ROOT, launch, requires, run_python

GREEDY = ["--temp", "0", "--max-tokens", "12"]


def _generate(model, prompt: str = "Hello world") -> list[str]:
    return ["-m", "llama_tp.generate", "--model", str(model), "--prompt", prompt, *GREEDY]


@pytest.mark.parametrize("n", [2, 3])
def test_same_text_as_mlx_launch(tiny_dir, n):
    ours = launch(n, _generate(tiny_dir), ring=True)
    theirs = launch(n, _generate(tiny_dir), launcher="mlx")
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == theirs.stdout and ours.stdout.strip(), (ours.stderr, theirs.stderr)


def test_module_form_and_stdin_with_its_end_of_file(tiny_dir):
    """`-m MODULE` runs it on every rank; `--prompt -` gets stdin up to its end of file."""
    single = run_python(_generate(tiny_dir, "Hello world"))
    cmd = [sys.executable, "-m", "llama_tp.launch", "-n", "2"]
    cmd += ["--starting-port", str(next(_PORTS)), *_generate(tiny_dir, "-")]
    r = subprocess.run(
        cmd, cwd=ROOT, input="Hello world", capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == single.stdout


def test_the_first_failing_rank_sets_the_exit_code():
    code = "import os, sys; sys.exit(3 if os.environ['MLX_RANK'] == '1' else 0)"
    r = launch(3, ["-c", code], timeout=120, ring=True)
    assert r.returncode == 3
    assert "Node with rank 1 exited with code 3" in r.stderr
    # one write per line: with PYTHONUNBUFFERED print() writes the newline separately
    code = "import os; os.write(1, f\"hi from {os.environ['MLX_RANK']}\\n\".encode())"
    ok = launch(2, ["-c", code], timeout=120)
    assert ok.returncode == 0
    assert sorted(ok.stdout.splitlines()) == ["hi from 0", "hi from 1"]


def test_bad_arguments_are_one_line():
    r = run_python(["-m", "llama_tp.launch", "-n", "2", "-m"], timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: -m needs a module name, e.g. -m llama_tp.generate"


@requires("mpi")
def test_mpi_backend_gives_the_ring_text(tiny_dir, tmp_path):
    # mpirun refuses root and more ranks than cores unless told; its session directory
    # goes under tmp_path (/tmp/ompi.HOST.UID keeps what MPI singletons leave behind).
    env = {
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_MCA_orte_tmpdir_base": str(tmp_path),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mpi = launch(2, _generate(tiny_dir), extra=["--backend", "mpi"])
        if mpi.returncode and not (mpi.stdout + mpi.stderr).strip():
            # one more try, then it counts
            mpi = launch(2, _generate(tiny_dir), extra=["--backend", "mpi"])
        if mpi.returncode and not (mpi.stdout + mpi.stderr).strip():
            mpi = _with_mpirun_diagnostics(mpi)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    ring = launch(2, _generate(tiny_dir))
    assert mpi.returncode == 0, (mpi.stdout, mpi.stderr)
    assert ring.returncode == 0 and ring.stdout.strip(), (ring.stdout, ring.stderr)
    assert mpi.stdout == ring.stdout, (mpi.stderr, ring.stderr)


def _with_mpirun_diagnostics(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """A silent failure says nothing: add what plain mpirun says, with this process's
    environment as the C library has it and as Python's os.environ has it. Open MPI 4
    exits 1 without a word when started by a process that itself ran MPI_Init (its
    setenv()s reach children that inherit the C environment): an in-process
    `mx.distributed.init()` in the test process, which world() no longer does."""
    cmd = ["mpirun", "-n", "2", "hostname"]
    inherited = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    snapshot = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=os.environ)
    extra = f"\nplain mpirun: exit {inherited.returncode} ({inherited.stderr.strip()[-300:]}); "
    extra += f"with os.environ passed explicitly: exit {snapshot.returncode}"
    if inherited.returncode and not snapshot.returncode:
        extra += ": this test process ran MPI_Init (an in-process mx.distributed.init())"
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout, r.stderr + extra)


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_launcher_sleeps_while_the_ranks_compute():
    """Its own CPU time (sampled from /proc until it exits) is a small part of the wall
    time; loose, because CI machines are noisy (mlx.launch: ~100% of a core). The ranks
    compute for a fixed 3 s and print a line every 20 ms, so there is output to forward
    and the run is long enough to measure whatever the machine's speed."""
    code = "import time\nend = time.time() + 3\nwhile time.time() < end:\n"
    code += "    t = time.time() + 0.02\n    while time.time() < t: pass\n"
    code += "    print('x' + __import__('os').environ['MLX_RANK'], flush=True)"
    cmd = [sys.executable, "-m", "llama_tp.launch", "-n", "2"]
    cmd += ["--starting-port", str(next(_PORTS)), "--", sys.executable, "-c", code]
    tic = time.perf_counter()
    p = subprocess.Popen(
        cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    cpu = [0.0]

    def watch() -> None:
        while (c := _cpu_seconds(p.pid)) is not None and p.poll() is None:
            cpu[0] = c
            time.sleep(0.05)

    t = threading.Thread(target=watch)
    t.start()
    out, err = p.communicate(timeout=300)
    t.join()
    wall = time.perf_counter() - tic
    assert p.returncode == 0, err
    # both ranks' lines were forwarded (how many a rank prints in 3 s is the machine's)
    assert out.count(b"x0") >= 10 and out.count(b"x1") >= 10, out[-200:]
    assert wall >= 3
    assert cpu[0] < 0.2 * wall, (cpu[0], wall)


@requires("openblas")
def test_local_ranks_preload_openblas():
    """Debian's OpenBLAS (installed by .ci/run) is preloaded for local ranks, one BLAS
    thread per rank's share of the cores (or the user's OPENBLAS_NUM_THREADS), unless
    the user set LD_PRELOAD already."""
    from llama_tp.cluster.blas import find_openblas

    lib = find_openblas()
    code = "import os; e = os.environ; os.write(1, f\"{e['MLX_RANK']} {e.get('LD_PRELOAD')} "
    code += "{e.get('OPENBLAS_NUM_THREADS')} {e.get('LLAMA_TP_KERNEL_THREADS')}\\n\".encode())"
    cmd = [sys.executable, "-m", "llama_tp.launch", "-n", "2", "--verbose"]
    cmd += ["--starting-port", str(next(_PORTS)), "--", sys.executable, "-c", code]
    given = ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "LLAMA_TP_KERNEL_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in given}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    threads = max(1, (os.cpu_count() or 1) // 2)
    # ... and the native kernels' pool gets the same share (llama_tp.kernels)
    assert sorted(r.stdout.split("\n")[:-1]) == [f"{i} {lib} {threads} {threads}" for i in (0, 1)]
    assert f"launch: preloading LD_PRELOAD={lib}" in r.stderr
    off = subprocess.run(
        cmd[:3] + ["--no-openblas"] + cmd[3:],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sorted(off.stdout.split("\n")[:-1]) == [f"{i} None None {threads}" for i in (0, 1)]
    # A thread count the user set is kept, and the library is still preloaded (it once
    # turned the preload off: ranks then ran MLX's slow reference BLAS).
    mine = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**env, "OPENBLAS_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    want = [f"{i} {lib} 1 {threads}" for i in (0, 1)]
    assert sorted(mine.stdout.split("\n")[:-1]) == want, mine.stderr


@requires("mpi")
def test_a_process_on_its_own_does_not_start_mpi(tmp_path):
    """world() outside a launcher is the ring backend's group of one: no MPI singleton
    (0.3 s and a session directory per start where Open MPI is installed)."""
    env = {**os.environ, "OMPI_MCA_orte_tmpdir_base": str(tmp_path)}
    for k in ("MLX_RANK", "MLX_HOSTFILE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        env.pop(k, None)

    def sessions(code: str) -> list[str]:
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == "1\n", r.stderr
        return [p.name for p in tmp_path.iterdir()]

    ours = "from llama_tp.cluster.distributed import world; print(world().size())"
    assert sessions(ours) == []
    plain = "import mlx.core as mx; print(mx.distributed.init().size())"
    assert sessions(plain), "mx.distributed.init() no longer starts MPI: the test shows nothing"


def test_local_ranks_each_get_their_own_cores():
    """Ranks launched on one machine are pinned to disjoint cores (`LLAMA_TP_CORES`,
    applied by `world()` to every thread, the backend's included), and their session
    runs at nice 10 meanwhile, restored after; `off` leaves them to the scheduler; more
    ranks than cores are not pinned. Each launch is its own session (pytest's untouched)."""
    from llama_tp.cluster.affinity import SESSION_NICE, parse_cores, rank_cores, usable_cores

    code = (
        "import os; from llama_tp.cluster.distributed import world; "
        "from llama_tp.cluster.affinity import session_nice; r = world().rank(); "
        "cores = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in "
        "os.listdir('/proc/self/task')}; "
        "os.write(1, f\"{r} {os.environ.get('LLAMA_TP_CORES')} {sorted(cores)} "
        '{session_nice()}\\n".encode())'
    )
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_TP_CORES"}
    after = "from llama_tp.cluster.affinity import session_nice; print('after', session_nice())"

    def ranks(n: int, extra: dict) -> list[str]:
        cmd = [sys.executable, "-m", "llama_tp.launch", "-n", str(n)]
        cmd += ["--starting-port", str(next(_PORTS)), "--", sys.executable, "-c", code]
        # the launch, then the same session's nice once it has ended
        script = '"$@" && "$0" -c "$1"'
        r = subprocess.run(
            ["sh", "-c", script.replace("$1", after), sys.executable, *cmd],
            cwd=ROOT,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[-1] == "after 0", r.stdout  # restored
        return sorted(lines[:-1])

    usable = usable_cores()
    spec = rank_cores(2, usable)
    assert spec is not None and len(usable) >= 2
    want = [f"{r} {spec} {[tuple(parse_cores(spec, r))]} {SESSION_NICE}" for r in (0, 1)]
    assert ranks(2, {}) == want
    # LLAMA_TP_SESSION_NICE chooses the value (0: the session as it was)
    assert ranks(2, {"LLAMA_TP_SESSION_NICE": "3"}) == [
        w[: -len(str(SESSION_NICE))] + "3" for w in want
    ]
    assert ranks(2, {"LLAMA_TP_SESSION_NICE": "0"}) == [
        w[: -len(str(SESSION_NICE))] + "0" for w in want
    ]
    r = subprocess.run(
        [sys.executable, "-m", "llama_tp.launch", "-n", "2", "--", sys.executable, "-c", "1"],
        env={**env, "LLAMA_TP_SESSION_NICE": "20"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r
    assert r.stderr == "error: LLAMA_TP_SESSION_NICE must be an integer from 0 to 19, got '20'\n"
    off = ranks(2, {"LLAMA_TP_CORES": "off"})
    assert off == [f"{r} off {[tuple(usable)]} 0" for r in (0, 1)]
    many = len(usable) + 1
    assert ranks(many, {}) == [f"{r} None {[tuple(usable)]} 0" for r in range(many)]
    # a value that cannot be applied: one warning per rank, the ranks run unpinned
    bad = ranks(2, {"LLAMA_TP_CORES": "0/x"})
    assert bad[0] == f"0 0/x {[(0,)]} {SESSION_NICE}"
    assert bad[1] == f"1 0/x {[tuple(usable)]} {SESSION_NICE}"


def test_rank_cores_groups():
    from llama_tp.cluster.affinity import parse_cores, rank_cores

    assert rank_cores(2, [0, 1]) == "0/1"
    assert rank_cores(2, [0, 1, 2, 3, 4]) == "0,1/2,3"
    assert rank_cores(3, [0, 1]) is None and rank_cores(1, [0, 1]) is None
    assert parse_cores("0,1/2,3", 1) == [2, 3] and parse_cores("0/1", 2) == [0]
    with pytest.raises(ValueError, match=r"LLAMA_TP_CORES: expected groups of cores like "):
        parse_cores("0/x", 1)
