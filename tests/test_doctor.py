"""`python -m llama_tp.doctor` on 1, 2 and 3 ranks: the report, --json, and a failing check."""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re

import mlx.core as mx
from conftest import launch, run_python

import llama_tp

DOCTOR = ["-m", "llama_tp.doctor", "--quick"]
VERSIONS = {
    "python": platform.python_version(),
    "mlx": mx.__version__,
    "mlx-lm": importlib.metadata.version("mlx-lm"),
    "llama_tp": llama_tp.__version__,
}


def assert_no_failed_rank(r) -> None:
    """mlx.launch exits 0 whatever its ranks do; it reports every non-zero exit."""
    assert r.returncode == 0, r.stderr
    assert "[WARN] Node with rank" not in r.stderr, r.stderr
    assert "error:" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def check_lines(stdout: str) -> dict[str, tuple[str, str]]:
    """The check table: name -> (status, detail)."""
    out = {}
    for line in stdout.splitlines():
        names = "ranks|versions|blas|kernels|split|all-reduce|weights|logits|mlx-lm classes"
        m = re.match(rf"({names})\s+(ok|warn|FAILED|n/a)\s+(.*)", line)
        if m:
            out[m[1]] = (m[2], m[3])
    return out


def rank_rows(stdout: str) -> dict[int, list[str]]:
    """The rank table: rank -> [host, pid, python, mlx, mlx-lm, llama_tp, ...]."""
    table = stdout.split("\nrank  host", 1)[1].split("\n\n", 1)[0]
    return {int(r[0]): r[1:] for r in map(str.split, table.splitlines()[1:])}


def test_doctor_single_process():
    r = run_python(DOCTOR, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("llama_tp doctor: 1 rank(s), backend single process"), r.stdout
    rows = rank_rows(r.stdout)
    assert list(rows) == [0]
    assert rows[0][2:6] == list(VERSIONS.values()), r.stdout
    checks = check_lines(r.stdout)
    assert checks["ranks"][0] == "ok" and checks["versions"][0] == "ok", r.stdout
    assert checks["all-reduce"] == ("n/a", "single process: nothing to reduce"), r.stdout
    assert checks["weights"] == ("n/a", "single process: nothing to send"), r.stdout
    assert checks["logits"][0] == "ok", r.stdout
    # a tiny model on mlx-lm's classes (the path of architectures not implemented here)
    assert checks["mlx-lm classes"][0] == "ok", r.stdout
    assert checks["mlx-lm classes"][1].startswith("tiny Gemma 2: max abs diff "), r.stdout
    assert checks["blas"][0] in ("ok", "warn"), r.stdout
    # which path quantized products take (make test builds the native kernels)
    assert checks["kernels"][0] == "ok" and checks["kernels"][1].startswith("native kernels (")
    assert "doctor: healthy" in r.stdout.splitlines()[-1], r.stdout


def test_doctor_two_ranks(tiny_dir, monkeypatch):
    # Unequal machines, faked (cluster/memory.py): 12 and 6 GiB available.
    monkeypatch.setenv("LLAMA_TP_FAKE_MEMORY", "24G:12G,8G:6G")
    r = launch(2, [*DOCTOR, "--model", str(tiny_dir)], timeout=150)
    assert_no_failed_rank(r)
    assert r.stdout.startswith("llama_tp doctor: 2 rank(s), backend ring"), r.stdout
    rows = rank_rows(r.stdout)
    assert sorted(rows) == [0, 1], r.stdout
    assert rows[0][1] != rows[1][1], "each rank reports its own pid"
    for row in rows.values():
        assert row[2:6] == list(VERSIONS.values()), r.stdout
    table = r.stdout.split("all-reduce (fp32 all_sum", 1)[1].splitlines()[1:6]
    assert table[0].split() == ["size", "iterations", "median", "p90", "bus", "bandwidth"]
    assert [" ".join(line.split()[:2]) for line in table[1:]] == ["4 B", "8 KB", "1 MB", "16 MB"]
    checks = check_lines(r.stdout)
    assert checks["all-reduce"][0] == "ok", r.stdout
    assert checks["logits"][0] == "ok", r.stdout
    assert "even plan: query heads 2+2" in checks["logits"][1], r.stdout
    status, detail = checks["mlx-lm classes"]
    assert status == "ok" and detail.startswith("tiny Gemma 2: max abs diff "), detail
    assert detail.endswith("(2 pipeline stages)"), detail
    # each rank's memory, and what the tiny model's weights take on each, balanced or 2:1
    memory = r.stdout.split("memory (weights only", 1)[1].splitlines()[1:4]
    header = " ".join(memory[0].split())  # (the speed weights depend on the timing)
    assert header.startswith("rank total available matmul holds balanced ") and (
        header.endswith(" holds --split 2:1")
    ), header
    assert memory[1].split()[:5] == ["0", "24.00", "GiB", "12.00", "GiB"], memory
    assert memory[2].split()[:5] == ["1", "8.00", "GiB", "6.00", "GiB"], memory
    status, detail = checks["split"]
    # which path runs the model, then whether its weights fit
    path = "native (model_type 'llama' is implemented natively); "
    assert status == "ok" and detail.startswith(path + "weights fit balanced (rank "), detail
    assert "; for speed " in detail and detail.endswith("; for memory --split 2:1"), detail
    assert checks["kernels"][0] == "ok" and checks["kernels"][1].endswith("on every rank")
    # where each rank's weights come from (every rank has the file here), and the link's rate
    status, detail = checks["weights"]
    assert status == "ok" and detail == f"{tiny_dir}: rank 0 locally; rank 1 locally", detail
    assert "doctor: healthy" in r.stdout.splitlines()[-1], r.stdout


def test_split_advice_says_when_weights_cannot_fit(tiny_dir):
    from llama_tp.checks.split import _fit

    advice = {"memory": (1.0, 3.0)}
    status, text = _fit(str(tiny_dir), 2, 1, [100 << 10, 300 << 10], advice)
    held = sum(advice["holds"]["balanced"])
    assert status == "FAILED" and held > 400 << 10
    assert text == (
        f"{tiny_dir} cannot fit: its weights take {held / 1024:.2f} KiB over 2 rank(s) (with "
        "what each repeats), 400.00 KiB are available (rank 0 100.00 KiB, rank 1 300.00 KiB)"
    )
    status, text = _fit(str(tiny_dir), 2, 1, [150 << 10, 400 << 10], advice)
    assert status == "warn" and text.startswith("weights fit with --split 1:3 (rank "), text


def test_doctor_three_ranks_json():
    r = launch(3, [*DOCTOR, "--json"], timeout=90, ring=True)
    assert_no_failed_rank(r)
    report = json.loads(r.stdout)  # rank 0 only: one JSON document
    assert report["ok"] is True and report["ranks"] == 3 and report["backend"] == "ring"
    assert [h["rank"] for h in report["hosts"]] == [0, 1, 2]
    assert len({h["pid"] for h in report["hosts"]}) == 3
    for h in report["hosts"]:
        assert {k: h[k] for k in VERSIONS} == VERSIONS
        assert h["blas"]["seconds"] > 0
    sizes = [row["bytes"] for row in report["all_reduce"]]
    assert sizes == [4, 8 << 10, 1 << 20, 16 << 20]
    for row in report["all_reduce"]:
        assert row["iterations"] >= 3 and 0 < row["median_us"] <= row["p90_us"]
        assert row["bus_gbps"] > 0
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["logits"]["status"] == "ok"
    # 4 query heads over 3 ranks: the uneven plan must reproduce the logits as well.
    assert "uneven plan: query heads 2+1+1" in checks["logits"]["detail"]
    assert checks["all-reduce"]["status"] == "ok"


def test_doctor_failing_check_fails_every_rank():
    r = launch(2, [*DOCTOR, "--json", "--inject-fault", "1"], timeout=90)
    for rank in range(2):  # a rank that is slower to fail may be stopped by mlx.launch
        assert re.search(rf"Node with rank {rank} exited with code (1|-15)\b", r.stderr), r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] is False
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["logits"]["status"] == "FAILED"
    assert "max abs diff" in checks["logits"]["detail"]
    assert checks["all-reduce"]["status"] == "ok"  # the other checks still ran
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert errors[0].startswith("error: doctor: 1 check(s) failed: logits: sharded logits"), (
        r.stderr
    )
    assert "Traceback" not in r.stderr


class _Group:
    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


def test_backend_from_launch_environment(monkeypatch):
    from llama_tp.cluster.diagnostics import backend_name

    for var in ("NCCL_HOST_IP", "MLX_WORLD_SIZE", "MLX_HOSTFILE", "MLX_RANK", "MLX_IBV_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    for var in ("MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert backend_name(_Group(1)) == "single process"
    assert backend_name(_Group(2)) == "unknown"
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # mpirun
    assert backend_name(_Group(2)) == "mpi"
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("MLX_RANK", "0")  # mlx.launch sets it for every backend
    monkeypatch.setenv("MLX_IBV_DEVICES", "/tmp/devices.json")
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "10.0.0.1:5000")
    assert backend_name(_Group(2)) == "jaccl"
    monkeypatch.delenv("MLX_IBV_DEVICES")
    monkeypatch.delenv("MLX_JACCL_COORDINATOR")
    monkeypatch.setenv("MLX_HOSTFILE", "/tmp/hosts.json")
    assert backend_name(_Group(2)) == "ring"
    monkeypatch.delenv("MLX_HOSTFILE")
    monkeypatch.setenv("NCCL_HOST_IP", "10.0.0.1")
    monkeypatch.setenv("MLX_WORLD_SIZE", "2")
    assert backend_name(_Group(2)) == "nccl"


def test_version_differences_name_ranks_and_values():
    from llama_tp.cluster.diagnostics import version_differences

    same = {"python": "3.11.7", "mlx": "0.32.4", "mlx-lm": "0.32.2", "llama_tp": "0.1.0"}
    infos = [{"rank": 0, **same}, {"rank": 1, **same, "mlx": "0.31.0"}]
    assert version_differences(infos) == ["mlx (rank 0: 0.32.4, rank 1: 0.31.0)"]
    assert version_differences([{"rank": 0, **same}, {"rank": 1, **same}]) == []


def test_report_warns_when_versions_differ():
    from llama_tp.doctor import format_report

    detail = "ranks differ: mlx (rank 0: 0.32.4, rank 1: 0.31.0)"
    report = {
        "ranks": 2,
        "backend": "ring",
        "hosts": [
            {"rank": r, "host": "h", "pid": 1, **VERSIONS, "mlx": v}
            for r, v in enumerate(["0.32.4", "0.31.0"])
        ],
        "all_reduce": [],
        "checks": [
            {"name": "ranks", "status": "ok", "detail": "2 rank(s) answered on 1 host(s)"},
            {"name": "versions", "status": "warn", "detail": detail},
        ],
        "ok": True,
    }
    lines = format_report(report).splitlines()
    assert f"WARNING: {detail}" in lines
    assert lines[-1] == "doctor: healthy: 1 ok, 1 warning(s), 0 failed"


def test_doctor_checks_a_tp2_x_pp2_mesh():
    r = launch(4, [*DOCTOR, "--json", "--tp", "2", "--pp", "2"], timeout=120, ring=True)
    assert_no_failed_rank(r)
    report = json.loads(r.stdout)
    mesh = report["mesh"]
    assert (mesh["tp"], mesh["pp"], mesh["dp"]) == (2, 2, 1)
    # One host: the stages in rank order, each tensor group on it.
    places = [(x["rank"], x["replica"], x["stage"], x["tensor_rank"]) for x in mesh["ranks"]]
    assert places == [(0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 0), (3, 0, 1, 1)]
    assert mesh["tensor_all_reduce_us"] > 0 and mesh["stage_hop_us"] > 0
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["mesh"] == {
        "name": "mesh",
        "status": "ok",
        "detail": "--tp 2 x --pp 2: every tensor group on one host",
    }
    # A mesh that does not fit the ranks: the loader's line, before any collective.
    r = run_python([*DOCTOR, "--pp", "2"], timeout=60)
    assert (
        r.returncode == 2 and r.stderr.strip() == "error: --pp 2 does not divide the 1 running rank"
    )


def test_tensor_groups_across_hosts_are_named():
    from llama_tp.checks.mesh import spanning_groups

    # Two Macs, ranks interleaved by the hostfile and placed in rank order: both split.
    places = [(0, 0), (0, 0), (0, 1), (0, 1)]
    assert spanning_groups(places, ["a", "b", "a", "b"]) == [(0, 0, ["a", "b"]), (0, 1, ["a", "b"])]
    assert spanning_groups(places, ["a", "a", "b", "b"]) == []
