"""Which backend `python -m llama_tp.launch` gives local ranks when none is named.

Ranks on one machine exchange their all-reduces faster through Open MPI's shared memory
than through the ring's loopback TCP (docs/performance.md has the measurements: a
token of the built-in model makes 61 of them on 2 ranks). So when every rank is local
and Open MPI is installed, the launcher picks `--backend mpi`; the ring stays where:

- a backend is named (`--backend ring|mpi|jaccl|nccl`), or a ring-only flag is given
  (`--starting-port`, `--connections-per-ip`): the user chose;
- hosts are given (`--hostfile`, `--hosts`): the ranks may be on other machines;
- Open MPI is missing (`mpirun`, `ompi_info`, `libmpi.so`).

More ranks than cores take Open MPI too: mlx's hostfile gives mpirun a slot per rank, and
the ring's socket threads spin while they wait for a peer, which starves the ranks that
have work (docs/performance.md, "Open MPI for local ranks": 4 ranks on 2 cores).

As root, Open MPI refuses to start unless told: the launcher tells it
(`OMPI_ALLOW_RUN_AS_ROOT`) only for the backend it picked itself. `--verbose` prints
the choice and its reason.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from dataclasses import dataclass, field

RING_ONLY = ("--starting-port", "--connections-per-ip")
MPI_REASON = (
    "Open MPI's shared memory between local ranks (faster all-reduces than the ring over "
    "loopback); --backend ring to choose the ring"
)


@dataclass
class Choice:
    """Launcher flags to add, environment for mpirun itself, and why."""

    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    reason: str = ""

    @property
    def backend(self) -> str | None:
        return self.flags[-1] if self.flags else None


def open_mpi() -> str | None:
    """Why Open MPI cannot carry local ranks here, or None when it can."""
    if not shutil.which("mpirun") or not shutil.which("ompi_info"):
        return "Open MPI is not installed (apt-get install openmpi-bin)"
    name = os.environ.get("MLX_MPI_LIBNAME", "libmpi.so")
    try:
        ctypes.CDLL(name)  # what MLX's MPI backend opens
    except OSError:
        return f"{name} cannot be loaded (apt-get install libopenmpi-dev)"
    return None


def default_backend(flags: list[str], ranks: int, given: str | None, remote: bool) -> Choice:
    """The backend for a launch with launcher `flags` of `ranks` ranks, `given` the
    backend the user named (or None), `remote` whether hosts were given."""
    if given is not None:
        return Choice(reason=f"{given} (--backend)")
    if remote:
        return Choice(reason="ring (hosts given: mlx's default)")
    if ranks < 2:
        return Choice()
    if any(f.split("=", 1)[0] in RING_ONLY for f in flags):
        return Choice(
            reason="ring (a ring flag was given: --starting-port or --connections-per-ip)"
        )
    missing = open_mpi()
    if missing:
        return Choice(reason=f"ring ({missing})")
    env = {}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return Choice(["--backend", "mpi"], env, f"mpi ({MPI_REASON})")
