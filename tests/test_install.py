"""A clean install: the wheel `python -m build` makes installs in a fresh venv, without
deprecation warnings from our metadata, and its console scripts run, under mlx.launch too.

To stay fast and offline-friendly the fresh venv borrows the dependencies (mlx, mlx-lm,
the built-in model, ...) of the test's own environment through a .pth file; llama_tp
itself comes only from the wheel (checked).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import _PORTS, BIN, ROOT

pytestmark = pytest.mark.slow

SCRIPTS = ("generate", "chat", "convert", "bench", "doctor", "perplexity", "plan")


def clean_env() -> dict[str, str]:
    """No PYTHONPATH: nothing but the venv decides where llama_tp comes from."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("install")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    log = build.stdout + build.stderr
    assert build.returncode == 0, log[-3000:]
    assert "deprecat" not in log.lower(), log  # e.g. setuptools on `license = {text=...}`
    (wheel,) = (tmp / "dist").glob("llama_tp-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True)
    py = tmp / "venv" / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "_borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps"]
        + ["--no-index", "--no-compile", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert "deprecat" not in (pip.stdout + pip.stderr).lower(), pip.stdout + pip.stderr
    return tmp / "venv"


def test_wheel_in_a_fresh_venv_runs_the_console_scripts(venv, tmp_path):
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import llama_tp; print(llama_tp.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(),
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr
    for name in SCRIPTS:
        assert (venv / "bin" / f"llama_tp.{name}").is_file(), name
    r = subprocess.run(
        [str(venv / "bin" / "llama_tp.generate"), "--prompt", "hi", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(),
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
    plan = subprocess.run(
        [str(venv / "bin" / "llama_tp.plan"), "-n", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(),
        timeout=300,
    )
    assert plan.returncode == 0 and "rank" in plan.stdout, plan.stderr
    # the wheel carries the native kernels' sources: the same build (keyed by them) loads
    kernels = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "llama_tp.kernels"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=clean_env(),
        timeout=600,
    )
    assert kernels.returncode == 0 and "native kernels" in kernels.stdout, kernels.stderr
    # and the server's chat page (package data, GET /)
    page = "from importlib import resources as r; "
    page += "print(r.files('llama_tp.server').joinpath('page', 'index.html').read_text()[:15])"
    shown = subprocess.run(
        [str(venv / "bin" / "python"), "-c", page], capture_output=True, text=True, cwd=tmp_path
    )
    assert shown.stdout.startswith("<!doctype html>"), shown.stderr


def test_console_script_under_mlx_launch(venv, tiny_dir, tmp_path):
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--starting-port", str(next(_PORTS)), "--"]
    cmd += [str(venv / "bin" / "llama_tp.generate"), "--model", str(tiny_dir)]
    cmd += ["--prompt", "hi", "--max-tokens", "4"]
    read_end, write_end = os.pipe()  # mlx.launch spins at the end of its input
    p = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        stdin=read_end,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        start_new_session=True,
    )
    os.close(read_end)
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    finally:
        os.close(write_end)
    assert p.returncode == 0 and "exited with code" not in err, err[-3000:]
    assert out.strip() and "error" not in err, err[-3000:]
