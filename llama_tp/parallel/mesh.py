"""The tp x pp (x dp) mesh: which rank runs which pipeline stage, and its groups.

    world ranks -> P stages of T ranks each (T * P == world size)
    tensor group: the T ranks of one stage (tensor-parallel with the usual plan)
    pipeline group: the P ranks with the same tensor rank, one per stage, in stage order

Placement rule: ranks are ordered by host (hosts in the order of their lowest rank,
then by rank within a host) and cut into consecutive blocks of T, block s being
stage s. So when every host runs a multiple of T ranks, a tensor group never spans
two hosts: the all-reduces stay inside a machine, and only the hidden states of the
stage boundaries cross the network. `LLAMA_TP_MESH_ORDER=rank` ignores the hosts
(plain rank order: stage s = ranks s*T .. s*T + T - 1).

With `--dp D` (the server's data-parallel replicas) the world is D replicas of
T * P ranks, cut the same way: the ranks in host order, replica d the d-th block of
T * P, its stages consecutive blocks of T inside it. Each replica is a whole model
with its own groups; only the server's per-step exchange spans the world.

Groups come from `Group.split` where the backend has it (MPI), kept until the process
ends (freed after the world, MPI aborts the rank). MLX 0.32's ring backend
does not ("[ring] Group split not supported"); there each subgroup is a ring of its
own, made the way the world's ring is made (a hostfile in MLX_HOSTFILE, the rank in
MLX_RANK, `mx.distributed.init`), on ports the ranks pick and exchange over the
world. MLX caches one group per backend, so the cache is emptied between the
rings (`clear_backends`, in libmlx's public C++ API but not bound to Python) and a
fresh world ring is made last, for the later `mx.distributed.init()` calls.
A stage of one rank needs no tensor group (None); with T == 1 the pipeline
group is the world itself and nothing new is made.

Also here, pure Python: the stage split of the layers (balanced by parameter
bytes, or given as `--pp-split 10,12`) and the checks with one-line errors.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..cluster.distributed import all_gather_object


class MeshError(ValueError):
    """A mesh or stage split that cannot run: a usage error."""


def mesh_shape(
    world_size: int,
    tp: int | None,
    pp: int | None,
    dp: int | None = None,
    shards: bool = False,
) -> tuple[int, int]:
    """(T, P) from the flags: P defaults to 1, T to world_size // (P * D); T * P * D must be
    the world (D = --dp replicas, default 1). `shards`: the world is `convert --shards N`
    (a pre-split for N ranks), not running."""
    for flag, v in (("--tp", tp), ("--pp", pp), ("--dp", dp)):
        if v is not None and v < 1:
            raise MeshError(f"{flag} must be at least 1, got {v}")
    p, d = pp or 1, dp or 1
    plural = "s" * (world_size > 1)
    if tp is None:
        if world_size % (p * d):
            flags = " x ".join([f"--pp {p}"] * (d == 1 or p > 1) + [f"--dp {d}"] * (d > 1))
            world = f"--shards {world_size}" if shards else f"the {world_size} running rank{plural}"
            raise MeshError(f"{flags} does not divide {world}")
        return world_size // (p * d), p
    if tp * p * d != world_size:
        n = tp * p * d
        flags = f"--tp {tp} x --pp {p}" + (f" x --dp {d}" if d > 1 else "")
        world = (
            f"--shards is {world_size}"
            if shards
            else f"{world_size} {'are' if world_size > 1 else 'is'} running"
        )
        raise MeshError(f"{flags} = {n} rank{'s' * (n > 1)}, but {world}")
    return tp, p


def layout(hosts: list[str], tp: int, pp: int, by_host: bool = True) -> list[list[int]]:
    """The world ranks of each stage, in tensor-rank order: (P, T).

    `hosts[r]` names rank r's machine; see the module's placement rule.
    """
    order = list(range(len(hosts)))
    if by_host:
        first = {h: hosts.index(h) for h in hosts}
        order.sort(key=lambda r: (first[hosts[r]], r))
    return [order[s * tp : (s + 1) * tp] for s in range(pp)]


def balanced_split(
    layer_bytes: list[int],
    first_extra: int,
    last_extra: int,
    pp: int,
    weights: tuple[float, ...] | None = None,
    tied: frozenset[int] = frozenset(),
) -> list[range]:
    """Contiguous layer ranges for `pp` stages (each >= 1 layer) minimizing the largest
    stage's bytes; the first stage also holds `first_extra` bytes (the embedding), the
    last `last_extra` (norm and head). Among splits with the same largest stage, the
    one with the smallest sum of squared stage bytes (the most even). With `weights`
    (`--pp-split 3:1`) each stage's bytes count divided by its weight, so that stage s
    gets about weights[s] / sum(weights) of them. `tied`: the layer boundaries no stage
    may start at (inside a KV-shared layer's span from its source). O(P * n^2)."""
    n = len(layer_bytes)
    if pp > n - len(tied):
        more = f" ({len(tied)} of its boundaries keep layers together)" if tied else ""
        raise MeshError(f"--pp {pp} stages, but the model has only {n} layers{more}")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)
    scale = [sum(weights) / w for w in weights] if weights else [1] * pp

    def cost(s: int, a: int, b: int) -> float:
        extra = (first_extra if s == 0 else 0) + (last_extra if s == pp - 1 else 0)
        return (prefix[b] - prefix[a] + extra) * scale[s]

    # best[s][i]: (largest stage, sum of squares) of stages 0..s holding layers [0, i)
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(pp)]
    cut = [[0] * (n + 1) for _ in range(pp)]
    for i in range(1, n + 1):
        best[0][i] = (cost(0, 0, i), cost(0, 0, i) ** 2)
    for s in range(1, pp):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                if j in tied:
                    continue
                c = cost(s, j, i)
                candidate = (max(best[s - 1][j][0], c), best[s - 1][j][1] + c * c)
                if candidate < best[s][i]:
                    best[s][i], cut[s][i] = candidate, j
    bounds, i = [n], n
    for s in range(pp - 1, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(pp)]


def parse_split(text: str, n_layers: int, pp: int) -> list[range]:
    """`--pp-split 10,12` -> [range(0, 10), range(10, 22)], checked against the model.
    (Weights, `--pp-split 3:1`, are `placement.stage_layers`'.)"""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise MeshError(
            f"--pp-split must be layer counts like 10,12 or weights like 3:1, got {text!r}"
        ) from None
    if len(counts) != pp:
        raise MeshError(f"--pp-split {text} has {len(counts)} stages, but --pp is {pp}")
    if min(counts) < 1:
        raise MeshError(f"--pp-split {text}: every stage needs at least one layer")
    if sum(counts) != n_layers:
        raise MeshError(
            f"--pp-split {text} sums to {sum(counts)} layers, but the model has {n_layers}"
        )
    starts = [sum(counts[:s]) for s in range(pp)]
    return [range(a, a + c) for a, c in zip(starts, counts, strict=True)]


@dataclass
class Mesh:
    """This rank's place in the mesh and its groups (the world when P == 1)."""

    tp: int
    pp: int
    stage: int  # this rank's pipeline stage
    tp_rank: int  # its rank in the stage's tensor group
    stages: list[list[int]]  # world ranks of each stage (of its replica), in tensor-rank order
    tp_group: mx.distributed.Group | None  # None when T == 1
    pp_group: mx.distributed.Group | None  # None when P == 1
    layers: list[range] = field(default_factory=list)  # each stage's layers, once known
    dp: int = 1  # data-parallel replicas (the server's --dp)
    replica: int = 0  # this rank's replica
    replicas: list[list[int]] = field(default_factory=list)  # world ranks of each replica
    replica_group: mx.distributed.Group | None = None  # its replica's T * P ranks (D > 1)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def tensor_ranks(self) -> dict[int, int]:
        """Every world rank's tensor rank (in its stage's tensor group)."""
        blocks = self.replicas or [[r for ranks in self.stages for r in ranks]]
        return {r: i % self.tp for ranks in blocks for i, r in enumerate(ranks)}

    def describe(self) -> str:
        """One line per stage: its ranks and layers."""
        lines = []
        for s, ranks in enumerate(self.stages):
            lay = self.layers[s] if self.layers else None
            where = f"layers {lay.start}-{lay.stop - 1}" if lay else "layers ?"
            extra = " + embedding" if s == 0 else ""
            extra += " + norm, head" if s == self.pp - 1 else ""
            who = f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
            lines.append(f"stage {s}: {who}: {where}{extra}")
        return "\n".join(lines)


def make_mesh(
    world: mx.distributed.Group, tp: int | None = None, pp: int | None = None, dp: int | None = None
) -> Mesh:
    """The mesh of `world` (collective: every rank calls it with the same flags).

    Raises MeshError (on every rank alike, before any communication) when the
    flags do not fit the world. With `dp` > 1 the world is cut into D replicas of
    T * P ranks (placed like stages: consecutive blocks in host order), each with its
    own tensor and pipeline groups and a replica group.
    """
    T, P = mesh_shape(world.size(), tp, pp, dp)
    D, rank = dp or 1, world.rank()
    if D == 1 and P == 1:
        return Mesh(T, 1, 0, rank, [list(range(T))], world if T > 1 else None, None)
    if D == 1 and T == 1:  # pure pipeline: stage s is rank s, the world is the pipeline group
        return Mesh(1, P, rank, 0, [[r] for r in range(P)], None, world)
    by_host = os.environ.get("LLAMA_TP_MESH_ORDER", "host") != "rank"
    hosts = all_gather_object(socket.gethostname(), world)
    blocks = layout(hosts, T, P * D, by_host)  # (D * P, T): replica d is blocks dP .. dP + P - 1
    block = next(b for b, ranks in enumerate(blocks) if rank in ranks)
    replica, stage = divmod(block, P)
    stages = blocks[replica * P : (replica + 1) * P]
    tp_rank = stages[stage].index(rank)
    replicas = [[r for s in blocks[d * P : (d + 1) * P] for r in s] for d in range(D)]
    # The groups to make, each with its split color and key: the replica's (D > 1; its
    # rank = stage * T + tensor rank), and its stage's and its pipe when T, P > 1 (when one
    # of them is 1, the other group is the replica's own).
    members, colors = [], []
    if D > 1:
        members.append(replicas[replica])
        colors.append((replica, stage * T + tp_rank))
    if T > 1 and P > 1:
        members += [stages[stage], [stages[s][tp_rank] for s in range(P)]]
        colors += [(D + block, tp_rank), (D + D * P + replica * T + tp_rank, stage)]
    made = _subgroups(world, members, colors)
    group = made.pop(0) if D > 1 else world
    tp_group = (made[0] if P > 1 else group) if T > 1 else None
    pp_group = (made[1] if T > 1 else group) if P > 1 else None
    replica_group = group if D > 1 else None
    return Mesh(
        T, P, stage, tp_rank, stages, tp_group, pp_group, [], D, replica, replicas, replica_group
    )


def _subgroups(
    world: mx.distributed.Group, members: list[list[int]], colors: list[tuple[int, int]]
) -> list[mx.distributed.Group]:
    """One group per entry of `members` (world ranks, in their new order): `Group.split`
    by (color, key) where the backend has it, rings of their own on the ring backend."""
    try:
        groups = [world.split(color, key) for color, key in colors]
    except RuntimeError as e:
        if "split not supported" not in str(e):
            raise
        return _ring_subgroups(world, members)
    for g in groups:  # never freed: see `_outlive_the_world`
        _outlive_the_world(g)
    return groups


def _outlive_the_world(group: mx.distributed.Group) -> None:
    """Keep a split group until the process ends. MLX's MPI world group calls
    MPI_Finalize when it is freed, and a split group MPI_Comm_free: at exit Python frees
    them in no set order, and a split group freed after the world aborts the rank
    ("MPI_Comm_free() ... called after MPI_FINALIZE", exit code 1, after a tp x pp
    run's output). A group never freed is freed by MPI_Finalize itself."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _clear_backends() -> None:
    """mlx::core::distributed::clear_backends(): forget the cached groups (live ones stay)."""
    lib_dir = Path(mx.__file__).parent / "lib"
    lib = next((p for p in lib_dir.glob("libmlx.*")), None)
    if lib is None:
        raise RuntimeError(f"cannot make ring subgroups: no libmlx in {lib_dir}")
    fn = ctypes.CDLL(str(lib))._ZN3mlx4core11distributed14clear_backendsEv
    fn.restype = None
    fn()


def _bound_socket(ip: str) -> socket.socket:
    s = socket.socket()
    s.bind((ip, 0))
    return s


def _ring_subgroups(
    world: mx.distributed.Group, memberships: list[list[int]]
) -> list[mx.distributed.Group]:
    """One new ring per entry of `memberships` (the world ranks of this rank's subgroup,
    in their new rank order), then a fresh world ring left in MLX's cache."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if not hostfile:
        raise RuntimeError("cannot make ring subgroups without MLX_HOSTFILE")
    nodes = json.loads(Path(hostfile).read_text())
    rank = world.rank()
    ip = nodes[rank][0].rsplit(":", 1)[0]
    # Every rank holds its candidate ports bound until all ranks have gathered them, so
    # ranks sharing a host never pick the same port (one bind(0) after another could).
    probes = [_bound_socket(ip) for _ in range(len(memberships) + 1)]
    try:
        ports = all_gather_object([s.getsockname()[1] for s in probes], world)
    finally:
        for s in probes:
            s.close()
    ips = [n[0].rsplit(":", 1)[0] for n in nodes]
    rings = [*memberships, list(range(world.size()))]
    saved = {k: os.environ.get(k) for k in ("MLX_HOSTFILE", "MLX_RANK")}
    groups = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, members in enumerate(rings):
                if len(members) == 1:  # a ring of one cannot connect: MLX's group of one
                    os.environ.pop("MLX_HOSTFILE", None)
                    os.environ.pop("MLX_RANK", None)
                    _clear_backends()
                    groups.append(mx.distributed.init(backend="ring"))
                    continue
                path = Path(tmp) / f"ring{i}.json"
                path.write_text(json.dumps([[f"{ips[m]}:{ports[m][i]}"] for m in members]))
                os.environ["MLX_HOSTFILE"], os.environ["MLX_RANK"] = (
                    str(path),
                    str(members.index(rank)),
                )
                _clear_backends()
                groups.append(mx.distributed.init(strict=True, backend="ring"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return groups[:-1]
