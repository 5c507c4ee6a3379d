"""Who has the model: agreed at start-up, so that one copy is enough.

    shared = open_shared(path, group, model_group, blocks, weights_cache)   # collective
    shared.ckpt        # this rank's checkpoint: its own file's, or built from a description
    shared.holders     # the ranks that read `path` themselves (the others receive)

Every rank says whether it can read `path` (a GGUF file, a Hugging Face or MLX folder,
its own rank folder of a pre-split folder, or a hub id it can fetch) and, if so, the
source's fingerprint (`description.source_fingerprint`: sizes, headers and index, never
the whole file). Then, alike on every rank: holders whose copies differ are refused in
one line naming both; nobody holding it is one line naming the path and every host; a
rank without the file gets the checkpoint's description from the first holder
(`checkpoints/description.py`: config, tensor table, tokenizer files; or from its
cache, `checkpoints/weights_cache.py`), so that it computes the same placement as the
others. The weights follow (`engine/weight_transfer.py`).
"""

from __future__ import annotations

import atexit
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..checkpoints import _REPO_ID, _download, open_checkpoint
from ..checkpoints.base import Checkpoint, CheckpointError
from ..checkpoints.description import (
    decode,
    describe,
    encode,
    from_description,
    source_fingerprint,
)
from ..checkpoints.fingerprint import weights_fingerprint
from ..checkpoints.split import SHARD_CONFIG, is_split
from ..checkpoints.weights_cache import WeightsCache, cache_root
from ..cluster.distributed import PeerError, all_gather_bytes, all_gather_object, first_line


@dataclass
class Shared:
    """Where the model is: this rank's checkpoint and, by world rank, who can read what."""

    ckpt: Checkpoint
    group: mx.distributed.Group
    path: str
    holders: list[int]  # the ranks that read their own slices from the file
    model_ranks: list[int]  # every rank's rank in its copy of the model (--dp replicas)
    model_size: int
    serves: list[list[int] | None]  # a pre-split folder: the rank folders each rank sees
    blocks: bool = False  # GGUF blocks kept as stored (the native kernels)
    fingerprint: str | None = None  # the source's (None: every rank holds it)
    cache: WeightsCache | None = None
    stats: dict[str, Any] = field(default_factory=dict)  # the transfer's, for load_stats

    @property
    def everyone(self) -> bool:
        return len(self.holders) == self.group.size()

    @property
    def split(self) -> bool:
        return any(s is not None for s in self.serves)

    def servers(self, rank: int) -> tuple[int, ...]:
        """The ranks that can read rank `rank`'s slices."""
        if not self.split:
            return tuple(self.holders)
        m = self.model_ranks[rank]
        return tuple(r for r, seen in enumerate(self.serves) if seen and m in seen)

    def source_for(self, rank: int, opened: dict[int, Checkpoint]) -> Checkpoint:
        """The checkpoint this (serving) rank reads rank `rank`'s slices from: its own,
        or for a pre-split folder, rank `rank`'s folder (opened once)."""
        if not self.split:
            return self.ckpt
        m = self.model_ranks[rank]
        if m not in opened:
            opened[m] = open_checkpoint(Path(self.path), m, self.model_size, self.blocks)
        return opened[m]


def _present(path: str, model_rank: int) -> tuple[Path | None, list[int] | None, str | None]:
    """(the local path, or None where this rank cannot read `path`; the rank folders a
    pre-split folder has here; why a hub id could not be fetched). A hub id is fetched
    as mlx-lm does: a rank that cannot fetch it receives."""
    p = Path(path)
    if not p.exists() and _REPO_ID.match(path):
        try:
            p = _download(path)
        except CheckpointError as e:
            return None, None, str(e).partition(" failed (")[2].rstrip(")") or str(e)
    if not p.exists():
        return None, None, None
    if not is_split(p) or (p / SHARD_CONFIG).is_file():
        return p, None, None
    seen = sorted(int(d.name[5:]) for d in p.glob("rank-*") if (d / SHARD_CONFIG).is_file())
    return (p if model_rank in seen else None), seen, None


def _local(path: str, model_rank: int, model_size: int, blocks: bool, several: bool):
    """This rank's checkpoint (None: it has no copy), the source's fingerprint where it
    sees one, the rank folders it sees of a pre-split folder, why a hub id failed."""
    local, seen, why = _present(path, model_rank)
    ckpt = fingerprint = None
    if local is not None:
        ckpt = open_checkpoint(local, model_rank, model_size, blocks)
        if several:
            fingerprint = source_fingerprint(ckpt)
            ckpt.fingerprint = weights_fingerprint(ckpt)  # computed once
    elif seen:  # other ranks' folders only: it can still send them theirs
        fingerprint = source_fingerprint(open_checkpoint(Path(path), seen[0], model_size, blocks))
    return ckpt, fingerprint, seen, why


def open_shared(
    path: str | Path,
    group: mx.distributed.Group,
    model_group: mx.distributed.Group,
    blocks: bool = False,
    weights_cache: Any = None,
) -> Shared:
    """Every rank's checkpoint of `path` (collective over `group`; see the module
    docstring). `weights_cache`: `--weights-cache` (None: the default folder; False or
    'none': no cache). Raises alike on every rank."""
    path = str(path)
    mrank, msize = model_group.rank(), model_group.size()
    ckpt = fingerprint = seen = error = why = None
    try:
        ckpt, fingerprint, seen, why = _local(path, mrank, msize, blocks, group.size() > 1)
    except Exception as e:  # every rank learns of it below
        error = e
    mine = {
        "host": socket.gethostname(),
        "has": ckpt is not None,
        "fingerprint": fingerprint,
        "serves": seen,
        "model_rank": mrank,
        "error": None if error is None else first_line(error),
        "hub": why,
    }
    infos = all_gather_object(mine, group) if group.size() > 1 else [mine]
    _check(infos, error, path)
    holders = [r for r, i in enumerate(infos) if i["has"]]
    shared = Shared(
        ckpt, group, path, holders, [i["model_rank"] for i in infos], msize,
        [i["serves"] for i in infos], blocks, infos[holders[0]]["fingerprint"],
    )  # fmt: skip
    if shared.everyone:
        return shared
    root = cache_root(weights_cache)
    shared.cache = WeightsCache(root) if root is not None else None
    variant = f"-rank{mrank}" if shared.split else ""
    desc = None
    if ckpt is None and shared.cache is not None:
        desc = shared.cache.description(shared.fingerprint, variant)
    wanted = all_gather_object(ckpt is None and desc is None, group)
    if any(wanted):
        desc = _descriptions(shared, wanted) or desc
    if ckpt is None:
        shared.ckpt = _receiver_checkpoint(shared, desc, variant)
    return shared


def _check(infos: list[dict], error: BaseException | None, path: str) -> None:
    """The start-up verdict, alike on every rank: a rank's error, nobody with the
    model, or copies that differ."""
    failed = [(r, i["error"]) for r, i in enumerate(infos) if i["error"]]
    if failed:
        if error is not None:
            raise error
        raise PeerError(f"rank {failed[0][0]}: {failed[0][1]}")
    if not any(i["has"] for i in infos):
        hosts: dict[str, list[int]] = {}
        for r, i in enumerate(infos):
            hosts.setdefault(i["host"], []).append(r)
        where = ", ".join(
            f"{h} (rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))})" for h, rs in hosts.items()
        )
        if _REPO_ID.match(path):
            raise CheckpointError(
                f"{path}: not a local path on any host, and fetching it from the Hugging Face "
                f"hub failed on every rank ({infos[0]['hub']}; {where})"
            )
        raise CheckpointError(
            f"{path}: no such file or directory on any host ({where}); put the model on one "
            "of them: the others receive their slices from it"
        )
    seen = [(r, i) for r, i in enumerate(infos) if i["fingerprint"]]
    differ = [(r, i) for r, i in seen if i["fingerprint"] != seen[0][1]["fingerprint"]]
    if differ:
        (a, first), (b, other) = seen[0], differ[0]
        raise CheckpointError(
            f"{path} differs between ranks: rank {a} on {first['host']} has "
            f"{first['fingerprint']}, rank {b} on {other['host']} has {other['fingerprint']} "
            "(size, header and samples compared); make the copies the same, or remove one: "
            "a rank without the file receives its slices"
        )


def _descriptions(shared: Shared, wanted: list[bool]) -> dict[str, Any] | None:
    """This rank's description of the checkpoint, from the first rank that can read it
    (a pre-split folder: of this rank's own folder). Collective."""
    group, me = shared.group, shared.group.rank()
    keys = {r: shared.model_ranks[r] if shared.split else -1 for r, w in enumerate(wanted) if w}
    roots = sorted({shared.servers(r)[0] for r in keys if shared.servers(r)})
    mine = None
    for root in roots:
        data = b""
        if me == root:
            try:
                opened: dict[int, Checkpoint] = {}
                out = {}
                for r, key in keys.items():
                    if shared.servers(r) and shared.servers(r)[0] == root and str(key) not in out:
                        out[str(key)] = describe(shared.source_for(r, opened))
                data = encode(out)
            except Exception as e:  # the others are waiting for these bytes
                data = encode({"error": f"rank {me}: {first_line(e)}"})
        got = decode(all_gather_bytes(data, group)[root])
        if "error" in got:
            raise CheckpointError(got["error"])
        if me in keys and str(keys[me]) in got:
            mine = got[str(keys[me])]
    return mine


def _receiver_checkpoint(shared: Shared, desc: dict[str, Any] | None, variant: str) -> Checkpoint:
    """A receiver's checkpoint from `desc`, its small files in the cache (a temporary
    folder without one, or where the cache cannot be written); the description is kept
    for the next start."""
    if desc is None:
        folders = shared.model_ranks[shared.group.rank()]
        raise CheckpointError(
            f"{shared.path}: no rank can send this rank the model (rank {folders}'s folder "
            "is on no host)"
        )
    if shared.cache is not None:
        try:
            shared.cache.save_description(shared.fingerprint, variant, desc)
            return from_description(desc, shared.cache.source(shared.fingerprint) / desc["name"])
        except OSError:
            pass  # e.g. a full disk: no cache this time (the weights' write says so)
    folder = Path(tempfile.mkdtemp(prefix="llama_tp-received-"))
    atexit.register(shutil.rmtree, folder, True)
    return from_description(desc, folder / desc["name"])
