"""Two "hosts": network namespaces joined by a veth pair, the ring backend between them.

Each rank runs in its own namespace (`ip netns exec NS env MLX_RANK=r ... python ...`)
on its own address, so the ranks talk over a real (virtual) link that a test can
take down. Needs iproute2 (`ip`, `tc`: skipped with the install line where missing, a
failure under CI) and root with namespaces: skipped, with the reason, where creating one
fails.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import time

import pytest
from conftest import requires, run_python
from mp_ranks import Ranks

pytestmark = [requires("iproute2"), pytest.mark.exclusive]

PEER_LOST = "lost the connection to a peer rank (it crashed or was stopped)"
NO_PROGRESS = (
    r"error: rank {rank}: no progress for 5 s in generation step \d+ "
    r"\(waiting on 1 other rank\); a peer may be stopped or unreachable"
)


_IDS = itertools.count(1)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


@pytest.fixture
def two_hosts(request):
    """(namespaces, addresses, the veth end in the first namespace); removed afterwards."""
    n = next(_IDS)
    tag = f"ltp{os.getpid() % 100000}x{n}"  # unique per test and per test run (<= 15 chars)
    names = [f"{tag}a", f"{tag}b"]
    addresses = [f"10.{77 + os.getpid() % 150}.{n}.{i}" for i in (1, 2)]
    created: list[str] = []

    def cleanup() -> None:
        for ns in created:
            ip("netns", "del", ns, check=False)  # removes its end of the veth pair too

    request.addfinalizer(cleanup)
    try:
        for ns in names:
            ip("netns", "add", ns)
            created.append(ns)
    except (OSError, subprocess.CalledProcessError) as e:
        reason = getattr(e, "stderr", "") or str(e)
        pytest.skip(f"cannot create network namespaces here: {reason.strip()}")
    links = [f"{tag}0", f"{tag}1"]
    ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
    for ns, link, address in zip(names, links, addresses, strict=True):
        ip("link", "set", link, "netns", ns)
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", link)
        ip("-n", ns, "link", "set", link, "up")
        ip("-n", ns, "link", "set", "lo", "up")
    return names, addresses, links[0]


def in_namespaces(two_hosts, args, tmp_path) -> Ranks:
    names, addresses, _ = two_hosts
    return Ranks(
        2,
        args,
        tmp_path,
        hosts=addresses,
        prefix=lambda rank: ["ip", "netns", "exec", names[rank]],
    )


def generate(model, max_tokens: int, *extra: str) -> list[str]:
    return [
        "-m",
        "llama_tp.generate",
        "--model",
        str(model),
        "--prompt",
        "hi",
        "--ignore-chat-template",
        "--max-tokens",
        str(max_tokens),
        *extra,
    ]


def test_generation_across_namespaces_equals_one_process(two_hosts, tiny_dir, tmp_path):
    r0, r1 = in_namespaces(two_hosts, generate(tiny_dir, 24), tmp_path).wait(120)
    single = run_python(generate(tiny_dir, 24), timeout=120)
    assert single.returncode == 0 and single.stdout.strip(), single.stderr
    assert r0.code == r1.code == 0, (r0.err, r1.err)
    assert r0.out == single.stdout and r1.out == ""
    assert r0.err == r1.err == ""


def test_link_down_mid_generation_ends_every_rank(two_hosts, tmp_path, long_tiny):
    names, _, link = two_hosts
    model = long_tiny  # the tiny model with a context long enough to keep going
    ranks = in_namespaces(two_hosts, generate(model, 500000, "--timeout", "5"), tmp_path)
    ranks.wait_for_output(100)
    ip("-n", names[0], "link", "set", link, "down")
    ranks.mark = time.monotonic()
    for r in ranks.wait(5 + 10):
        # Normally no error reaches either side and each rank's watchdog ends it;
        # a socket error would end it as a lost peer instead.
        [line] = r.error_lines()
        assert re.fullmatch(NO_PROGRESS.format(rank=r.rank), line) or line == (
            f"error: rank {r.rank}: {PEER_LOST}"
        ), line
        assert r.code == 3 and r.seconds <= 15, (r.code, r.seconds)


def test_added_delay_gives_the_same_output(two_hosts, tiny_dir, tmp_path):
    names, _, link = two_hosts
    netem = ip(
        "netns",
        "exec",
        names[0],
        "tc",
        "qdisc",
        "add",
        "dev",
        link,
        "root",
        "netem",
        "delay",
        "5ms",
        check=False,
    )
    if netem.returncode != 0:
        pytest.skip(f"tc netem is not available in this kernel: {netem.stderr.strip()}")
    r0, r1 = in_namespaces(two_hosts, generate(tiny_dir, 24), tmp_path).wait(120)
    single = run_python(generate(tiny_dir, 24), timeout=120)
    assert r0.code == r1.code == 0, (r0.err, r1.err)
    assert r0.out == single.stdout and single.stdout.strip()
