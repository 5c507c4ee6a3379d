"""examples/chat_api.py and examples/tp_mlp.py on two ranks, and the hostfiles
(hostfiles/*.json) as mlx.launch reads them."""

from __future__ import annotations

from conftest import ROOT, launch

WARN = "exited with code"


def test_chat_api_example_two_ranks(tiny_dir):
    r = launch(2, ["examples/chat_api.py", "--model", str(tiny_dir), "--max-tokens", "10"])
    assert WARN not in r.stderr and "Traceback" not in r.stderr, r.stderr
    out = r.stdout.splitlines()
    assert out.count(">> What is the capital of France?") == 1
    assert out.count(">> And of Germany?") == 1
    assert sum(line.startswith("  assistant: ") for line in out) == 2
    stats = [line for line in r.stderr.splitlines() if "prompt tokens prefilled" in line]
    assert len(stats) == 2, r.stderr


def test_tp_mlp_example_two_ranks():
    r = launch(2, ["examples/tp_mlp.py"], timeout=120)
    assert WARN not in r.stderr and "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["rank 0/2", "rank 1/2"]
    for line in lines:
        assert "all-to-sharded weight (420, 64) -> h (4, 420)" in line
        assert "sharded-to-all weight (64, 420) -> y (4, 64)" in line
        assert float(line.rsplit("=", 1)[1]) < 1e-4


def test_hostfiles_parse_as_mlx_launch_reads_them():
    from mlx._distributed_utils.common import Hostfile

    files = sorted((ROOT / "hostfiles").glob("*.json"))
    readme = (ROOT / "hostfiles" / "README.md").read_text()
    assert {f.name for f in files} >= {"ring-local-2.json", "ring-2-macs.json"}
    for f in files:
        assert f"`{f.name}`" in readme, f"{f.name} is not described in hostfiles/README.md"
        hostfile = Hostfile.from_file(f)
        hosts = hostfile.hosts
        assert len(hosts) >= 2
        backend = hostfile.backend or "ring"
        if backend == "ring":
            assert all(h.ips for h in hosts), f.name
        elif backend.startswith("jaccl"):
            # The checks mlx.launch makes: an address for rank 0, one RDMA entry
            # per rank with null for the rank itself and a device for every peer.
            assert hosts[0].ips, f.name
            n = len(hosts)
            for i, h in enumerate(hosts):
                assert len(h.rdma) == n and h.rdma[i] is None, f.name
                assert all(h.rdma[j] for j in range(n) if j != i), f.name
        else:
            assert backend == "mpi", f.name
