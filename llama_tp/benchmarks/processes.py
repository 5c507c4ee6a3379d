"""Bench rows as processes: one `python -m llama_tp.bench --json` run as one process,
as N ranks started directly (MLX_RANK + a ring hostfile, what mlx.launch gives each rank,
without a launcher process beside them) or through `mlx.launch`; rank 0's JSON, the wall
time and the launcher's CPU seconds. Also the machine's description and the BLAS check
that benchmark pages print. Used by the drivers in bench/.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from ..cluster.blas import find_openblas


@dataclass
class Run:
    label: str
    model: list[str]  # the bench's model flags
    ranks: int
    blas: str = "reference"  # or "openblas"
    compare: bool = True
    pin: bool = False
    launcher: str = "direct"
    blas_threads: bool = True  # OPENBLAS_NUM_THREADS = cores / ranks on multi-rank rows
    env: dict = field(default_factory=dict)
    copies: int = 1  # > 1: that many independent 1-rank processes at once, on cores 0, 1, ...

    def __post_init__(self) -> None:
        if self.blas == "openblas" and self.ranks > 1 and self.blas_threads and not self.pin:
            # Each rank's OpenBLAS would start a thread per core: 2 ranks x 2 threads on
            # 2 cores, and the waiting rank's threads compete with the computing one's.
            self.env["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.ranks))

    def command(self, copy: int | None = None) -> list[str]:
        cmd = ["python", "-m", "llama_tp.bench", *self.model, "--json"]
        if self.compare:
            cmd += ["--compare", "mlx-lm"]
        if self.pin:
            cmd += ["--pin-core", "auto" if copy is None else str(copy)]
        return cmd

    def shell(self) -> str:
        """The command as one would type it (rank 0's JSON on stdout)."""
        env = "LD_PRELOAD=$OPENBLAS " if self.blas == "openblas" else ""
        env += "".join(f"{k}={v} " for k, v in self.env.items())
        cmd = " ".join(self.command())
        if self.copies > 1:
            return (
                " & ".join(env + " ".join(self.command(i)) for i in range(self.copies)) + " & wait"
            )
        if self.ranks == 1:
            return env + cmd
        if self.launcher == "mlx.launch":
            return f"{env}mlx.launch -n {self.ranks} -- {cmd}"
        last = self.ranks - 1
        return (
            f"for r in $(seq 0 {last}); do {env}MLX_RANK=$r MLX_HOSTFILE=ring{self.ranks}.json "
            f"{cmd} & done; wait"
        )


def ring_hostfile(ranks: int, port: int) -> str:
    """What mlx.launch writes for local ranks: one address per rank."""
    return json.dumps([[f"127.0.0.1:{port + r}"] for r in range(ranks)])


_PORTS = iter(range(35000 + (os.getpid() % 200) * 20, 65000, 10))


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of process `pid` (seconds), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(run: Run, env: dict) -> tuple[list[subprocess.Popen], Path | None]:
    """Start the run's processes: [rank 0, ...] or [the launcher]."""
    python = [sys.executable, *run.command()[1:]]
    kw = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if run.ranks == 1:
        copies = [
            [sys.executable, *run.command(i if run.copies > 1 else None)[1:]]
            for i in range(run.copies)
        ]
        return [subprocess.Popen(c, stdin=subprocess.DEVNULL, **kw) for c in copies], None
    port = next(_PORTS)
    if run.launcher == "mlx.launch":
        launcher = str(Path(sys.executable).parent / "mlx.launch")
        cmd = [launcher, "-n", str(run.ranks), "--starting-port", str(port), "--", *python]
        # stdin stays open: mlx.launch spins harder still once its stdin reaches its end
        return [subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True, **kw)], None
    hostfile = Path(tempfile.mkstemp(prefix="llama_tp-ring-", suffix=".json")[1])
    hostfile.write_text(ring_hostfile(run.ranks, port))
    procs = []
    for r in range(run.ranks):
        rank_env = {**env, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}
        out = subprocess.PIPE if r == 0 else subprocess.DEVNULL
        procs.append(
            subprocess.Popen(
                python,
                env=rank_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs, hostfile


def execute(run: Run, timeout: float) -> dict:
    """Run one row; rank 0's JSON plus the wall time and the launcher's CPU seconds."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")}
    env.update(run.env)
    if run.blas == "openblas":
        env["LD_PRELOAD"] = find_openblas()
    tic = time.perf_counter()
    procs, hostfile = start(run, env)
    launcher_cpu = [0.0]

    def watch(pid: int) -> None:  # the launcher's CPU time, sampled until it exits
        while (c := cpu_seconds(pid)) is not None:
            launcher_cpu[0] = c
            time.sleep(0.2)

    if run.launcher == "mlx.launch" and run.ranks > 1:
        threading.Thread(target=watch, args=(procs[0].pid,), daemon=True).start()
    outputs = [None] * len(procs)

    def collect(i: int) -> None:
        outputs[i] = procs[i].communicate()

    threads = [threading.Thread(target=collect, args=(i,)) for i in range(len(procs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    failed = None
    while any(t.is_alive() for t in threads):
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            failed = "a rank failed"
        if time.monotonic() > deadline:
            failed = f"timed out after {timeout:.0f} s"
        if failed:
            for p in procs:  # as mlx.launch does: one rank failing stops the others
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL) if run.launcher == "mlx.launch" else p.kill()
            break
        time.sleep(0.2)
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    if hostfile:
        hostfile.unlink(missing_ok=True)
    out, err = outputs[0]
    lines = [line for line in (out or "").splitlines() if line.startswith("{")]
    if failed or not lines:
        errors = " | ".join((o[1] or "").strip()[-400:] for o in outputs if o and o[1])
        return {"error": failed or "no JSON from rank 0", "stderr": errors, "wall_s": wall}
    result = json.loads(lines[-1])
    if run.copies > 1:
        result["copies_generation_tps"] = [
            json.loads(o[0].strip().splitlines()[-1])["llama_tp"]["generation_tps"] for o in outputs
        ]
    result["wall_s"] = wall
    result["launcher_cpu_s"] = launcher_cpu[0] if run.launcher == "mlx.launch" else None
    return result


def blas_product(env: dict, out: Path) -> float:
    """Median seconds of a (64, 4096) @ (4096, 4096) fp32 product in a fresh process."""
    code = (
        "import mlx.core as mx, numpy as np, time, sys\n"
        "a = mx.random.normal((64, 4096), key=mx.random.key(1))\n"
        "b = mx.random.normal((4096, 4096), key=mx.random.key(2))\n"
        "mx.eval(a, b, a @ b)\n"
        "ts = []\n"
        "for _ in range(5):\n"
        "    t = time.perf_counter(); c = a @ b; mx.eval(c); ts.append(time.perf_counter() - t)\n"
        "np.save(sys.argv[1], np.array(c))\n"
        "print(sorted(ts)[2])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    if r.returncode:
        raise RuntimeError(r.stderr.strip()[-300:])
    return float(r.stdout.strip())


def blas_check() -> dict:
    """The 4096x4096 fp32 product with a batch of 64, with and without OpenBLAS."""
    import numpy as np

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    openblas = find_openblas()
    with tempfile.TemporaryDirectory() as d:
        ref = blas_product(env, Path(d) / "ref.npy")
        res = {"reference_s": ref, "openblas": openblas}
        if openblas:
            res["openblas_s"] = blas_product({**env, "LD_PRELOAD": openblas}, Path(d) / "ob.npy")
            a, b = np.load(Path(d) / "ref.npy"), np.load(Path(d) / "ob.npy")
            res["max_abs_diff"] = float(np.abs(a - b).max())
            res["max_abs_value"] = float(np.abs(a).max())
            res["identical"] = bool((a == b).all())
    return res


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    openblas_pkg = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Version}", "libopenblas0-pthread"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gb": mem / 1e9,
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "mlx": metadata.version("mlx"),
        "mlx_lm": metadata.version("mlx-lm"),
        "llama_tp": metadata.version("llama_tp"),
        "openblas": openblas_pkg or None,
        "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
