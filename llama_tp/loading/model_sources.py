"""Who has the model: agreed at start-up, so that one copy is enough.

    shared = open_shared(path, group, (rank, size), blocks, weights_cache)   # collective
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
others. The weights follow (`loading/weight_transfer.py`).
"""

from __future__ import annotations

import atexit
import shutil
import socket
import tempfile
import time
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
from ..checkpoints.split import SHARD_CONFIG, is_split, rank_dir
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


def _fingerprint(
    ckpt: Checkpoint | None, path: str, seen: list[int] | None, blocks: bool, size: int
) -> str | None:
    """The source's fingerprint as this rank sees it (None: it sees no copy)."""
    if ckpt is not None:
        ckpt.fingerprint = weights_fingerprint(ckpt)  # once: the agreement reuses it
        return source_fingerprint(ckpt)
    if seen:  # other ranks' folders of a pre-split folder only: it can still send them
        return source_fingerprint(open_checkpoint(Path(path), seen[0], size, blocks))
    return None


def _gather(value: Any, error: BaseException | None, group: mx.distributed.Group) -> list:
    """Every rank's `value`, after which all raise if any rank failed (`error`: this one's)."""
    out = all_gather_object((None if error is None else first_line(error), value), group)
    raise_first([e for e, _ in out], error)
    return [v for _, v in out]


def raise_first(errors: list[str | None], mine: BaseException | None) -> None:
    """Every rank raises when any failed: a failed rank its own error, the others the first."""
    if mine is not None:
        raise mine
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise PeerError(f"rank {failed[0][0]}: {failed[0][1]}")


def open_shared(
    path: str | Path,
    group: mx.distributed.Group,
    model: tuple[int, int] | None = None,
    blocks: bool = False,
    weights_cache: Any = None,
) -> Shared:
    """Every rank's checkpoint of `path` (collective over `group`; see the module
    docstring), opened as rank `model[0]` of `model[1]` ranks holding one copy of the
    model (default: as ranks of `group`; a pre-split folder opens that rank's folder).
    `weights_cache`: `--weights-cache` (None: the default folder; False or 'none': no
    cache). Raises alike on every rank. When every rank has the file this is one small
    all-gather: fingerprints are compared (by the start-up agreement) after loading,
    as before."""
    path, tic = str(path), time.perf_counter()
    mrank, msize = model or (group.rank(), group.size())
    ckpt = seen = error = why = None
    try:
        local, seen, why = _present(path, mrank)
        if local is not None:
            ckpt = open_checkpoint(local, mrank, msize, blocks)
    except Exception as e:  # every rank learns of it below
        error = e
    mine = {"host": socket.gethostname(), "has": ckpt is not None, "serves": seen,
            "model_rank": mrank, "hub": why}  # fmt: skip
    infos = _gather(mine, error, group)
    _nobody(infos, path)
    holders = [r for r, i in enumerate(infos) if i["has"]]
    shared = Shared(
        ckpt, group, path, holders, [i["model_rank"] for i in infos], msize,
        [i["serves"] for i in infos], blocks,
    )  # fmt: skip
    if shared.everyone:
        return shared
    fingerprint = None
    try:
        fingerprint = _fingerprint(ckpt, path, seen, blocks, msize)
    except Exception as e:
        error = e
    prints = _gather(fingerprint, error, group)
    _differ(prints, infos, path)
    shared.fingerprint = next(p for p in prints if p)
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
    shared.stats["start_seconds"] = time.perf_counter() - tic  # who has it, descriptions
    return shared


def _nobody(infos: list[dict], path: str) -> None:
    """One line naming the path and every host, alike on every rank, when no rank has it."""
    if any(i["has"] for i in infos):
        return
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


def _differ(prints: list[str | None], infos: list[dict], path: str) -> None:
    """One line naming two ranks whose copies differ, alike on every rank."""
    seen = [(r, p) for r, p in enumerate(prints) if p]
    differ = [(r, p) for r, p in seen if p != seen[0][1]]
    if differ:
        (a, first), (b, other) = seen[0], differ[0]
        raise CheckpointError(
            f"{path} differs between ranks: rank {a} on {infos[a]['host']} has {first}, "
            f"rank {b} on {infos[b]['host']} has {other} (size, header and samples "
            "compared); make the copies the same, or remove one: a rank without the file "
            "receives its slices"
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
    if desc is None:  # a pre-split folder whose rank folder no host has: name it
        rank_dir(Path(shared.path), shared.model_ranks[shared.group.rank()], shared.model_size)
        raise CheckpointError(f"{shared.path}: no rank could send this rank the model")
    if shared.cache is not None:
        try:
            shared.cache.save_description(shared.fingerprint, variant, desc)
            return from_description(desc, shared.cache.source(shared.fingerprint) / desc["name"])
        except OSError:
            pass  # e.g. a full disk: no cache this time (the weights' write says so)
    folder = Path(tempfile.mkdtemp(prefix="llama_tp-received-"))
    atexit.register(shutil.rmtree, folder, True)
    return from_description(desc, folder / desc["name"])
