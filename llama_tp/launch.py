"""`python -m llama_tp.launch`: mlx.launch's flags and hostfiles, without its busy loop.

    python -m llama_tp.launch -n 2 -m llama_tp.generate --prompt "hi"
    python -m llama_tp.launch --hostfile hostfiles/ring-2-macs.json -m llama_tp.chat
    python -m llama_tp.launch -n 2 -- python -m llama_tp.generate --prompt "hi"

Everything (hostfiles, backends ring/mpi/jaccl/nccl, ssh, the hostfile the ranks
get) is mlx's own launcher; only its I/O forwarding is replaced (see
`llama_tp/cluster/launcher.py`): it blocks instead of spinning on a core,
forwards stdin with its end of file, and exits with the first failing rank's
code. `-m MODULE` runs `python -m MODULE` on every rank; with local ranks on
Linux, Debian's OpenBLAS is preloaded when installed (`--no-openblas`: don't).

    python -m llama_tp.launch -n 2 --restart -m llama_tp.serve --port 8080

`--restart` (serve only) keeps the server up: a supervisor owns the port and relaunches
the ranks when one dies, hangs or loses its link (`llama_tp/supervisor/`;
`--restart-limit K` failures in `--restart-window SECONDS`, default 5 in 600, stop it).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .cluster.launcher import install_sigterm, run

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv in ([], ["-h"], ["--help"]):
        print(__doc__.strip())
        print()
        argv = argv or ["--help"]
    if _supervised(argv):
        from .supervisor.service import run as supervise

        return supervise(argv)
    openblas = "--no-openblas" not in argv
    argv = [a for a in argv if a != "--no-openblas"]
    install_sigterm()
    try:
        return run(argv, openblas)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _supervised(argv: list[str]) -> bool:
    """`--restart` among the launcher's own flags."""
    from .cluster.launcher import split_argv

    try:
        return "--restart" in split_argv(argv)[0]
    except ValueError:  # run() says what is wrong
        return False


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
