"""A server that heals itself across hosts (issue #42): three "hosts" (this machine's
network namespace and two more, on one bridge), the ring backend between them, ssh to
them played by tests/fake_ssh/ssh (`ip netns exec`; it fails while a host's link is
down, as ssh would).

One supervisor for the module, on the tiny model with a long context: a host's link
cut mid-stream and back (the ranks relaunched on all three); a host cut for good while
idle (the model re-placed over the other two, memory-weighted); the operator's POST
bringing the full cluster back; two hosts cut (the model does not fit the one left:
one line with the numbers, 503 with the reason) and back (serving again, unasked);
SIGTERM stopping everything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest
from conftest import ROOT, requires
from serve_client import KEY, http
from supervised import Supervised, Traffic, answer, started_by

pytestmark = [requires("iproute2"), pytest.mark.ranks, pytest.mark.exclusive]

STEP_TIMEOUT = 5
QUEUED = ["Name a colour.", "Name a fruit."]
HOSTS = ("b", "c")  # the namespaces; this machine is the first host


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


@pytest.fixture(scope="module")
def hosts(request):
    """{name: (namespace, address, link)} of the two namespace hosts, and this machine's
    address on their bridge; removed afterwards."""
    tag = f"lts{os.getpid() % 100000}"  # <= 15 characters with the suffixes
    net = f"10.{77 + os.getpid() % 150}.{200 + os.getpid() % 50}"
    bridge, made = f"{tag}br", []

    def cleanup() -> None:
        for ns in made:
            ip("netns", "del", ns, check=False)
        ip("link", "del", bridge, check=False)

    request.addfinalizer(cleanup)
    try:
        ip("link", "add", bridge, "type", "bridge")
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot create a bridge here: {getattr(e, 'stderr', '') or e}")
    ip("addr", "add", f"{net}.1/24", "dev", bridge)
    ip("link", "set", bridge, "up")
    out = {}
    for i, name in enumerate(HOSTS, start=2):
        ns, link, outer = f"{tag}{name}", f"{tag}{name}1", f"{tag}{name}0"
        ip("netns", "add", ns)
        made.append(ns)
        ip("link", "add", outer, "type", "veth", "peer", "name", link)
        ip("link", "set", link, "netns", ns)
        ip("link", "set", outer, "master", bridge, "up")
        ip("-n", ns, "addr", "add", f"{net}.{i}/24", "dev", link)
        ip("-n", ns, "link", "set", link, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        out[name] = (ns, f"{net}.{i}", link)
    return out, f"{net}.1"


def link(hosts, name: str, up: bool) -> None:
    ns, _, dev = hosts[0][name]
    ip("-n", ns, "link", "set", dev, "up" if up else "down")


@pytest.fixture(scope="module")
def sup(hosts, long_tiny, tmp_path_factory):
    model = long_tiny
    from llama_tp.supervisor.replacement import _shape, rank_bytes

    tmp = tmp_path_factory.mktemp("hosts")
    names, here = hosts
    entries = [{"ssh": "127.0.0.1", "ips": [here]}]
    entries += [{"ssh": names[h][0], "ips": [names[h][1]]} for h in HOSTS]
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps(entries))
    # Every host has half the model's bytes available: two hosts hold it (each gets a
    # half, with what its last rank held freed), one does not.
    whole = rank_bytes(_shape(str(model))[0], None)[0]
    memory = ",".join([f"8G:{whole // 2}"] * 3)
    env = {"PATH": f"{ROOT / 'tests' / 'fake_ssh'}:{os.environ['PATH']}"}
    env["LLAMA_TP_FAKE_MEMORY"] = memory
    s = Supervised(
        ["--hostfile", str(hostfile)],
        model,
        tmp,
        "--timeout", str(STEP_TIMEOUT),
        "--max-batch", "2",
        env=env,
    )  # fmt: skip
    s.whole = whole
    try:
        s.wait_serving(300)
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def expected(sup):
    c = sup.client()
    return {p: answer(c, p) for p in QUEUED}


def ranks(sup: Supervised, timeout: float = 30) -> int:
    """The ranks reporting to rank 0, once they have (about a second after it is up)."""
    deadline = time.monotonic() + timeout
    while not (s := sup.status())["ranks"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(s["ranks"])


def test_a_link_cut_mid_stream_and_back(sup, hosts, expected):
    assert ranks(sup) == 3  # the ranks' first reports may follow the first answers
    s = sup.status()
    assert [r["rank"] for r in s["ranks"]] == [0, 1, 2]
    assert s["supervisor"]["hosts"]["up"] == s["supervisor"]["hosts"]["total"] == 3
    c = sup.client()
    traffic = Traffic(c)
    traffic.stream("s1", "Count.", max_tokens=100000)
    traffic.stream("s2", "Talk.", max_tokens=100000)
    traffic.wait_streaming(["s1", "s2"])
    for i, prompt in enumerate(QUEUED):
        traffic.ask(f"q{i}", prompt, stream=i == 0)
    while sup.status()["queue"] < len(QUEUED):
        time.sleep(0.05)
    link(hosts, "b", False)
    t0 = time.monotonic()
    sup.wait_state(("recovering",), STEP_TIMEOUT + 30)
    link(hosts, "b", True)  # a flaky link: back before the relaunch (or its second probe)
    new = Traffic(c)
    new.ask("new", QUEUED[1])
    results = traffic.join()
    for name in ("s1", "s2"):
        kind, e = results[name]
        assert kind == "error" and re.search(rf"no progress for {STEP_TIMEOUT} s", str(e)), e
    for i, prompt in enumerate(QUEUED):
        assert results[f"q{i}"] == ("ok", expected[prompt]), results
    assert new.join()["new"] == ("ok", expected[QUEUED[1]])
    restored = new.done["new"] - t0
    print(f"\nlink cut: a new request answered {restored:.1f} s after the cut")
    assert restored < 30
    s = sup.wait_serving(30, 1)["supervisor"]
    assert s["hosts"]["up"] == 3 and s["restarts"] == 1


def test_a_host_gone_for_good_is_replaced_and_the_operator_brings_it_back(sup, hosts):
    gen = sup.status()["supervisor"]["generation"]
    link(hosts, "c", False)  # while idle: only the supervisor's monitor can see it
    s = sup.wait_state(("degraded",), STEP_TIMEOUT + 60, gen)
    c_ns = hosts[0]["c"][0]
    assert list(s["supervisor"]["hosts"]["missing"]) == [c_ns]
    assert s["supervisor"]["hosts"]["up"] == 2 and ranks(sup) == 2
    assert "exchanged no report" in s["supervisor"]["last_fault"]["what"]
    assert f"re-placing model over 2 of 3 hosts (127.0.0.1, {hosts[0]['b'][0]})" in sup.stderr()
    assert answer(sup.client(), "Hello")  # served by the two that remain
    link(hosts, "c", True)
    url = f"{sup.base}/v1/supervisor/restart"
    assert http(url, body={})[0] == 401
    code, body = http(url, body={}, headers={"Authorization": f"Bearer {KEY}"})
    assert code == 202, body
    s = sup.wait_serving(120, s["supervisor"]["generation"])
    assert s["supervisor"]["hosts"]["up"] == 3 and ranks(sup) == 3


def test_two_hosts_gone_the_model_does_not_fit_and_comes_back(sup, hosts):
    from llama_tp.parallel.plan_text import human_bytes

    gen = sup.status()["supervisor"]["generation"]
    for h in HOSTS:
        link(hosts, h, False)
    s = sup.wait_state(("down",), STEP_TIMEOUT + 60)["supervisor"]
    assert s["generation"] == gen  # nothing launched
    line = re.escape(
        f"cannot re-place model over 1 of 3 hosts (127.0.0.1): rank 0 on 127.0.0.1 would "
        f"hold {human_bytes(sup.whole)} of "
    )
    assert re.match(line + r"\S+ \S+ available \(", s["reason"]), s["reason"]
    assert sup.stderr().count(f"error: supervisor: {s['reason']}\n") == 1
    import openai

    with pytest.raises(openai.APIStatusError) as e:
        answer(sup.client(), "Hello")
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "5"
    assert "cannot re-place model" in str(e.value)
    for h in HOSTS:
        link(hosts, h, True)
    s = sup.wait_serving(120, s["generation"])  # unasked, at the next probe
    assert s["supervisor"]["hosts"]["up"] == 3


def test_sigterm_stops_every_rank_everywhere(sup):
    assert sorted(sup.ranks()) == [0, 1, 2]
    assert sup.stop() == 0, sup.stderr()
    assert started_by(sup.proc.pid) == {}
