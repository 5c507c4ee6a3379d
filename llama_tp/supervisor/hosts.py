"""The hosts a launch names, whether each one answers, and the hostfile of those that remain.

`layout_of(flags)` reads them as mlx.launch does (mlx's own `Hostfile`): `--hostfile`,
`--hosts a,b` (each repeated `-n` times), or `-n N` ranks on this machine. One entry
per rank; a host may carry several. A host is local when mlx.launch starts its ranks
without ssh (`127.0.0.1`); the others answer when `ssh HOST true` succeeds, the way
mlx.launch itself reaches them.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..cluster.launcher import _value

LOCAL = "127.0.0.1"  # mlx.launch starts this host's ranks without ssh
PROBE_TIMEOUT = 10.0  # seconds an `ssh HOST true` may take


@dataclass
class Layout:
    """The ranks' hosts, one entry per rank (mlx's `Host`: ssh name, IPs, RDMA devices)."""

    hosts: list  # mlx._distributed_utils.common.Host
    backend: str = ""
    envs: list[str] = field(default_factory=list)
    from_file: bool = False  # --hostfile or --hosts (else -n N on this machine)

    def names(self) -> list[str]:
        """The distinct hosts, in rank order."""
        return list(dict.fromkeys(h.ssh_hostname for h in self.hosts))

    def remote(self) -> list[str]:
        return [n for n in self.names() if n != LOCAL]

    def host_of(self, rank: int) -> str:
        return self.hosts[rank].ssh_hostname

    def rank0_address(self) -> str:
        """Where the supervisor reaches rank 0's private port: loopback when rank 0 is
        local, else its first IP (the ring backend's address) or its name."""
        h = self.hosts[0]
        if h.ssh_hostname == LOCAL:
            return LOCAL
        return h.ips[0] if h.ips else h.ssh_hostname

    def without(self, gone: set[str]) -> Layout:
        """The layout over the hosts not in `gone` (ranks renumbered in order)."""
        from mlx._distributed_utils.common import Host

        kept = [h for h in self.hosts if h.ssh_hostname not in gone]
        hosts = [Host(i, h.ssh_hostname, h.ips, []) for i, h in enumerate(kept)]
        return Layout(hosts, self.backend, self.envs, self.from_file)

    def write(self, path: Path) -> Path:
        """This layout as an mlx.launch hostfile."""
        hosts = [{"ssh": h.ssh_hostname, "ips": h.ips} for h in self.hosts]
        data = {"backend": self.backend, "envs": self.envs, "hosts": hosts}
        path.write_text(json.dumps(data, indent=1) + "\n")
        return path


def layout_of(flags: list[str]) -> Layout:
    """The hosts of the launcher's `flags` (ValueError, mlx's message, for a bad hostfile)."""
    from mlx._distributed_utils.common import Hostfile

    n = int(_value(flags, "-n") or _value(flags, "--repeat-hosts") or 1)
    if path := _value(flags, "--hostfile"):
        f = Hostfile.from_file(path)
        return Layout(f.hosts, f.backend, f.envs, from_file=True)
    if hosts := _value(flags, "--hosts"):
        return Layout(Hostfile.from_list(hosts, n).hosts, from_file=True)
    return Layout(Hostfile.from_list(LOCAL, n).hosts)


async def unanswered(host: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """None when `host` answers (local, or `ssh HOST true` succeeds), else why not
    (ssh's last line or the timeout)."""
    if host == LOCAL:
        return None
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout)}", host, "true"]
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as e:
        return f"cannot run ssh: {e.strerror or e}"
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return f"ssh {host} did not answer in {timeout:g} s"
    if proc.returncode == 0:
        return None
    lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"ssh {host} exited with code {proc.returncode}"
