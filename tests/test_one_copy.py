"""One copy of the model: ranks that cannot see `--model` receive their slices from one that can.

Every rank but 0 runs in its own mount namespace (`unshare -m`) where the models folder
is another (`VIEW`: empty, or holding a different copy of one model) and a 64 KiB
tmpfs stands for a full disk; rank 0 sees the real folder. Each launch covers several
cases (tests/mp_one_copy.py): greedy tokens and every rank's weights (CRC-32) equal to
the same launch loading a copy every rank sees, bytes received = the rank's share as
`plan` places it, the receiver's peak memory, the second start from the cache, a
damaged cache file, a full disk, copies that differ, a path nobody has. Needs root
with mount namespaces: skipped, with the reason, where `unshare -m` cannot mount.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
from conftest import launch
from mp_ranks import Ranks

SMALL = "64k"  # the tmpfs that fills up
# rank r > 0: the models folder replaced by VIEW, a small tmpfs on SMALL, then the command
HIDE = 'mount --bind "$0" "$1" && mount -t tmpfs -o size=' + SMALL + ' tmpfs "$2" && shift 2 && exec "$@"'


def _link_tree(src, dst) -> None:
    """A copy every rank sees, by hard links where the filesystem allows (no bytes copied)."""
    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """(root, a `prefix` for Ranks that hides root/models from ranks > 0)."""
    root = tmp_path_factory.mktemp("one_copy")
    for d in ("models", "shared", "view", "small", "cache"):
        (root / d).mkdir()
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", HIDE, str(root / "view"), str(root / "models"),
         str(root / "small"), "true"],
        capture_output=True, text=True,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"cannot hide a folder in a mount namespace here: {probe.stderr.strip()}")

    def prefix(rank: int) -> list[str]:
        if rank == 0:
            return []
        paths = [root / "view", root / "models", root / "small"]
        return ["unshare", "-m", "sh", "-c", HIDE, *map(str, paths)]

    return root, prefix


def model(root, name: str, make) -> None:
    """root/models/NAME (rank 0 only) and the same files at root/shared/NAME (every rank)."""
    make(root / "models" / name)
    src, dst = root / "models" / name, root / "shared" / name
    if src.is_dir():
        _link_tree(src, dst)
    else:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy(src, dst)


def run(hosts, n: int, cases: list[dict], timeout: float = 240, **kw) -> tuple[dict, list]:
    root, prefix = hosts
    spec = root / f"spec-{n}.json"
    for c in cases:
        c.setdefault("options", {})
        c.setdefault("cache", root / "cache")
        c.setdefault("tokens", 8)
    spec.write_text(json.dumps({"cases": cases}, default=str))
    ranks = Ranks(n, ["tests/mp_one_copy.py", str(spec)], root, prefix=prefix, **kw)
    results = ranks.wait(timeout)
    for r in results:
        assert r.code == 0, (r.rank, r.code, r.err[-3000:])
    lines = [json.loads(line) for line in results[0].out.splitlines() if line.startswith("{")]
    return {c["name"]: c for c in lines}, results


def assert_same_as_local(out: dict, name: str, local: str) -> None:
    """Greedy tokens and every rank's weights equal to the all-local run's, and each
    receiver got exactly its share over the link (and rank 0 sent it)."""
    got, ref = out[name], out[local]
    assert "error" not in got, got
    assert got["tokens"] == ref["tokens"] and got["tokens"], (got["tokens"], ref["tokens"])
    assert [r["crc"] for r in got["ranks"]] == [r["crc"] for r in ref["ranks"]]
    receivers = got["ranks"][1:]
    for r in receivers:
        s = r["stats"]
        assert s["source"] == "link" and s["bytes_received"] == s["placement_bytes"], s
    assert got["ranks"][0]["stats"]["bytes_sent"] == sum(
        r["stats"]["placement_bytes"] for r in receivers
    )


def test_two_ranks_one_copy(hosts, default_gguf):
    """GGUF, HF, MLX 4-bit, --split 2:1; the cache, damaged and full; differing copies;
    a path nobody has: one launch."""
    from fixtures import write_hf_model

    root, _ = hosts
    model(root, "tiny", write_hf_model)
    model(root, "q4", lambda p: write_hf_model(p, quantize=(4, 32), dim=128, hidden_dim=256))
    model(root, "smol.gguf", lambda p: os.link(default_gguf, p))
    write_hf_model(root / "models" / "other")  # rank 0's copy ...
    write_hf_model(root / "view" / "other", seed=1)  # ... and another one for the others
    hidden, shared = root / "models", root / "shared"
    split = {"options": {"split": "2:1"}}
    cases = [
        {"name": "hf", "model": hidden / "tiny"},
        {"name": "hf local", "model": shared / "tiny"},
        {"name": "hf cached", "model": hidden / "tiny"},
        {"name": "hf damaged", "model": hidden / "tiny", "damage": 1},
        {"name": "gguf", "model": hidden / "smol.gguf"},
        {"name": "gguf local", "model": shared / "smol.gguf"},
        {"name": "q4", "model": hidden / "q4"},
        {"name": "q4 local", "model": shared / "q4"},
        {"name": "split", "model": hidden / "tiny", "cache": root / "small", **split},
        {"name": "split local", "model": shared / "tiny", **split},
        {"name": "differ", "model": hidden / "other"},
        {"name": "nowhere", "model": hidden / "nowhere"},
    ]
    out, results = run(hosts, 2, cases)
    for name in ("hf", "gguf", "q4", "split"):  # HF, GGUF blocks as stored, 4-bit, --split 2:1
        assert_same_as_local(out, name, f"{name} local")
    # the receiver's peak: its share, one tensor in flight and a little (headers, buffers)
    for r in out["gguf"]["ranks"][1:]:
        s = r["stats"]
        assert s["peak_memory"] <= s["placement_bytes"] + r["largest"] + (1 << 20), s
    # the second start reads the cache and nothing is sent
    cached = out["hf cached"]
    assert cached["tokens"] == out["hf"]["tokens"]
    assert [r["crc"] for r in cached["ranks"]] == [r["crc"] for r in out["hf"]["ranks"]]
    s = cached["ranks"][1]["stats"]
    assert s["source"] == "cache" and s["bytes_received"] == 0, s
    assert s["bytes_from_cache"] == s["placement_bytes"], s
    assert cached["ranks"][0]["stats"]["bytes_sent"] == 0
    # a damaged cache file is found and its tensors fetched again
    damaged = out["hf damaged"]
    assert damaged["ranks"][1]["damaged"], damaged
    assert damaged["tokens"] == out["hf"]["tokens"]
    s = damaged["ranks"][1]["stats"]
    assert s["source"] == "link" and s["bytes_received"] == s["placement_bytes"], s
    # a full disk: one warning on rank 0's terminal, no partial folder left, the model loaded
    full = out["split"]["ranks"][1]
    assert not [f for f in full["cache_files"] if "slices" in f], full["cache_files"]
    warnings = [line for line in results[0].err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and re.fullmatch(
        rf"warning: rank 1: cannot cache the weights in {root}/small/\w+: No space left on "
        r"device; the partial copy was removed \(the model is loaded\)",
        warnings[0],
    ), results[0].err
    # copies that differ are refused, naming both; a path nobody has names every host
    assert re.fullmatch(
        rf"{root}/models/other differs between ranks: rank 0 on \S+ has \w+, rank 1 on \S+ "
        r"has \w+ \(size, header and samples compared\); make the copies the same, or remove "
        r"one: a rank without the file receives its slices",
        out["differ"].get("error", ""),
    ), out["differ"]
    assert re.fullmatch(
        rf"{root}/models/nowhere: no such file or directory on any host \(\S+ \(ranks 0, 1\)\); "
        r"put the model on one of them: the others receive their slices from it",
        out["nowhere"].get("error", ""),
    ), out["nowhere"]
