"""The pure parts of sending weights: the schedule, the checksum, a checkpoint's
description and the cache folder (no ranks; tests/test_one_copy.py runs them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from llama_tp.checkpoints.description import decode, encode
from llama_tp.checkpoints.weights_cache import CacheError, WeightsCache, cache_root
from llama_tp.cluster.transfer import Need, checksum, ring_path, rounds, schedule


def test_ring_paths_go_the_short_way():
    assert ring_path(0, 1, 2) == (0, 1)
    assert ring_path(0, 2, 4) == (0, 1, 2)  # a tie: rightwards
    assert ring_path(0, 3, 4) == (0, 3)
    assert ring_path(3, 1, 5) == (3, 2, 1)


def test_schedule_shares_work_between_servers_and_relays_on_a_ring():
    needs = [Need(dst, i, 100, (0, 2), f"t{i}") for dst in (1, 3) for i in range(4)]
    jobs = schedule(needs, 4, ring=True)
    assert [j.dst for j in jobs] == [1, 3] * 4  # destinations in turn
    sent = {s: sum(j.nbytes for j in jobs if j.src == s) for s in (0, 2)}
    assert sent == {0: 400, 2: 400}  # both holders are neighbours of both: halves each
    assert all(len(j.path) == 2 for j in jobs)
    far = schedule([Need(2, 0, 100, (0,), "x")], 4, ring=True)
    assert far[0].path == (0, 1, 2)  # relayed by rank 1
    direct = schedule([Need(2, 0, 100, (0,), "x")], 4, ring=False)
    assert direct[0].path == (0, 2)
    with pytest.raises(ValueError, match="rank 1 needs x and no rank has it"):
        schedule([Need(1, 0, 1, (), "x")], 2, ring=True)


def test_rounds_cut_by_bytes():
    jobs = schedule([Need(1, i, 60, (0,)) for i in range(5)], 2, ring=True)
    assert [len(r) for r in rounds(jobs, 100)] == [2, 2, 1]


def test_checksum_sees_any_changed_byte_and_moved_pieces():
    a = mx.array(np.arange(4096, dtype=np.float32))
    mx.eval(a)
    base = checksum(a)
    assert base == checksum(mx.array(np.arange(4096, dtype=np.float32)))
    raw = np.arange(4096, dtype=np.float32)
    for i in (0, 1, 2047, 4095):
        b = raw.copy().view(np.uint8)
        b[i * 4 + 1] ^= 1
        assert checksum(mx.array(b.view(np.float32))) != base
    moved = np.concatenate([raw[64:128], raw[:64], raw[128:]])  # two pieces swapped
    assert checksum(mx.array(moved)) != base
    assert checksum(a[:4095]) != base  # cut short
    odd = mx.array(np.arange(7, dtype=np.uint8))  # not a whole word; bfloat16 viewed as bytes
    assert checksum(odd) != checksum(mx.array(np.arange(6, dtype=np.uint8)))
    assert checksum(mx.ones((3, 5), dtype=mx.bfloat16)) != checksum(mx.zeros((3, 5), mx.bfloat16))


def test_description_round_trip_keeps_arrays_and_files():
    desc = {
        "metadata": {"tokens": ["a", "\ud800b"], "types": np.arange(5, dtype=np.int32)},
        "files": {"tokenizer.model": b"\x00\x01\xff"},
        "shape": [2, 3],
    }
    back = decode(encode(desc))
    assert back["metadata"]["tokens"] == ["a", "\ud800b"]
    assert back["metadata"]["types"].dtype == np.int32
    assert back["metadata"]["types"].tolist() == [0, 1, 2, 3, 4]
    assert back["files"] == {"tokenizer.model": b"\x00\x01\xff"}


def test_cache_root_follows_the_flag_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_TP_WEIGHTS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "llama_tp" / "weights"
    assert cache_root("none") is None and cache_root(False) is None
    monkeypatch.setenv("LLAMA_TP_WEIGHTS_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.setenv("LLAMA_TP_WEIGHTS_CACHE", "none")
    assert cache_root() is None


def _tensors() -> tuple[dict, dict]:
    slices = {"a.weight": (0, 0, 4), "b.weight": None, "c.scales": (1, 2, 6)}
    tensors = {
        "a.weight": mx.arange(32, dtype=mx.float32).reshape(4, 8),
        "b.weight": mx.ones((16,), dtype=mx.bfloat16),
        "c.scales": mx.arange(12, dtype=mx.uint32).reshape(3, 4),
    }
    mx.eval(tensors)
    return slices, tensors


def test_cache_entry_round_trip_and_a_damaged_file_named(tmp_path, monkeypatch):
    import llama_tp.checkpoints.weights_cache as wc

    monkeypatch.setattr(wc, "FILE_BYTES", 1)  # one tensor per file
    cache = WeightsCache(tmp_path)
    slices, tensors = _tensors()
    assert cache.read_entry("fp", slices) == ({}, list(slices))
    assert cache.write_entry("fp", slices, tensors) == sum(a.nbytes for a in tensors.values())
    assert cache.has_entry("fp", slices)
    have, missing = cache.read_entry("fp", slices)
    assert missing == [] and all(mx.array_equal(have[k], tensors[k]) for k in slices)
    # another placement finds nothing
    assert not cache.has_entry("fp", {**slices, "a.weight": (0, 4, 8)})
    # a flipped byte in one file: that file's tensor is fetched again, the others kept
    entry = json.loads(next(tmp_path.glob("fp/slices-*/entry.json")).read_text())
    file = next(tmp_path.glob("fp/slices-*")) / entry["tensors"]["b.weight"]["file"]
    data = bytearray(file.read_bytes())
    data[-3] ^= 0xFF
    file.write_bytes(bytes(data))
    have, missing = cache.read_entry("fp", slices)
    assert missing == ["b.weight"] and sorted(have) == ["a.weight", "c.scales"]
    file.unlink()  # a missing file too
    assert cache.read_entry("fp", slices)[1] == ["b.weight"]
    # written again: whole, and no temporary folder left
    cache.write_entry("fp", slices, tensors)
    assert cache.read_entry("fp", slices)[1] == []
    assert sorted(p.name[:7] for p in (tmp_path / "fp").iterdir()) == ["slices-"]


def test_cache_write_that_fails_leaves_no_partial_folder(tmp_path, monkeypatch):
    import llama_tp.checkpoints.weights_cache as wc

    slices, tensors = _tensors()

    def full(path: Path, batch) -> None:
        path.write_bytes(b"x" * 10)
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(wc, "_save", full)
    with pytest.raises(CacheError, match=f"cannot cache the weights in {tmp_path}/fp: No space"):
        WeightsCache(tmp_path).write_entry("fp", slices, tensors)
    assert list((tmp_path / "fp").iterdir()) == []
