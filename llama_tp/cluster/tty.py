"""Is the user at a terminal, seen from a rank that mlx.launch started?

mlx.launch gives every rank pipes for stdin, stdout and stderr, so a rank cannot ask
`isatty` about the user's terminal. The launcher can be found instead: it is the
highest ancestor in the rank's process group (mlx.launch starts the ranks in its own
group, through bash), and on Linux /proc tells what its descriptors are.
"""

from __future__ import annotations

import os


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, pgrp, session, tty_nr, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def launcher_on_terminal(fd: int) -> bool | None:
    """Is the launcher's descriptor `fd` (0 stdin, 1 stdout, 2 stderr) this process's
    controlling terminal? None where that cannot be told (no /proc: not Linux)."""
    if not os.path.isdir("/proc/self"):
        return None
    try:
        me = _stat_fields(os.getpid())
        pgrp, tty_nr = int(me[2]), int(me[4])
        pid = top = os.getpid()
        while True:
            pid = int(_stat_fields(pid)[1])
            if pid <= 1 or int(_stat_fields(pid)[2]) != pgrp:
                break
            top = pid
        st = os.stat(f"/proc/{top}/fd/{fd}")
    except (OSError, ValueError, IndexError):
        return False
    major, minor = (tty_nr >> 8) & 0xFFF, (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00)
    return tty_nr != 0 and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (major, minor)
