"""The doctor's mesh check (`python -m llama_tp.doctor --tp T --pp P --dp D`).

Builds the mesh as the loader does (`parallel.mesh.make_mesh`), reports each rank's
host, replica, stage and tensor rank, warns when a tensor group spans hosts (its
all-reduces would cross the network: the placement rule wants a multiple of T ranks
per host), and times the mesh's two kinds of link: an 8 KB all-reduce inside a tensor
group and an 8 KB hand-off between stages 0 and 1 (half a round trip). These are the
`t` of docs/parallelism.md's "Which mesh to pick".
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..cluster.diagnostics import Check, run_check, text_table, time_all_reduce
from ..cluster.distributed import all_gather_object
from ..parallel.mesh import make_mesh


def check_mesh(
    group: mx.distributed.Group,
    report: dict,
    tp: int | None,
    pp: int | None,
    dp: int | None,
    quick: bool,
) -> Check:
    """Build the mesh, gather each rank's place in it (into `report["mesh"]`) and time its
    two kinds of link; warn when a tensor group spans hosts."""
    made, err = run_check("mesh", lambda: make_mesh(group, tp, pp, dp), group)
    if err:
        return Check("mesh", "FAILED", err)
    m = made

    def measure() -> list:
        reduce = time_all_reduce(m.tp_group, 8 << 10, quick) if m.tp_group else None
        hop = _stage_hop(m, quick)
        return all_gather_object([m.replica, m.stage, m.tp_rank, reduce, hop], group)

    places, err = run_check("mesh", measure, group)
    if err:
        return Check("mesh", "FAILED", err)
    hosts = {h["rank"]: h["host"] for h in report["hosts"]}
    hosts = [hosts.get(r, "?") for r in range(len(places))]
    report["mesh"] = {
        "tp": m.tp,
        "pp": m.pp,
        "dp": m.dp,
        "ranks": [
            {"rank": r, "host": hosts[r], "replica": d, "stage": s, "tensor_rank": t}
            for r, (d, s, t, _, _) in enumerate(places)
        ],
        "tensor_all_reduce_us": max((x[3]["median_us"] for x in places if x[3]), default=None),
        "stage_hop_us": max((x[4] for x in places if x[4] is not None), default=None),
    }
    shape = f"--tp {m.tp} x --pp {m.pp}" + (f" x --dp {m.dp}" if m.dp > 1 else "")
    spanning = spanning_groups([(d, s) for d, s, *_ in places], hosts)
    if spanning:
        d, s, spans = spanning[0]
        where = f"replica {d} " if m.dp > 1 else ""
        return Check(
            "mesh",
            "warn",
            f"{shape}: the tensor group of {where}stage {s} spans hosts {', '.join(spans)}: "
            "its all-reduces cross the network (run a multiple of --tp ranks per host)",
        )
    return Check("mesh", "ok", f"{shape}: every tensor group on one host")


def spanning_groups(
    places: list[tuple[int, int]], hosts: list[str]
) -> list[tuple[int, int, list[str]]]:
    """(replica, stage, its hosts) of each tensor group on more than one host, from each
    rank's (replica, stage) and host."""
    groups: dict[tuple[int, int], set[str]] = {}
    for (d, s), host in zip(places, hosts, strict=True):
        groups.setdefault((d, s), set()).add(host)
    return [(d, s, sorted(h)) for (d, s), h in sorted(groups.items()) if len(h) > 1]


def _stage_hop(m, quick: bool) -> float | None:
    """Half the median round trip of 8 KB between stages 0 and 1 (on stage 0; None else)."""
    if m.pp == 1 or m.stage > 1:
        return None
    x = mx.zeros((2048,), mx.float32)
    times = []
    for _ in range(5 if quick else 50):
        tic = time.perf_counter()
        if m.stage == 0:
            mx.eval(mx.distributed.send(x, 1, group=m.pp_group))
            mx.eval(mx.distributed.recv_like(x, 1, group=m.pp_group))
        else:
            y = mx.distributed.recv_like(x, 0, group=m.pp_group)
            mx.eval(mx.distributed.send(y, 0, group=m.pp_group))
        times.append(time.perf_counter() - tic)
    return sorted(times)[len(times) // 2] / 2 * 1e6 if m.stage == 0 else None


def mesh_lines(m: dict | None) -> list[str]:
    """The doctor report's mesh section (nothing without a mesh)."""
    if not m:
        return []
    lines = ["", f"mesh --tp {m['tp']} x --pp {m['pp']} x --dp {m['dp']}:"]
    rows = [("rank", "host", "replica", "stage", "tensor rank")]
    rows += [
        (str(r["rank"]), r["host"], str(r["replica"]), str(r["stage"]), str(r["tensor_rank"]))
        for r in m["ranks"]
    ]
    lines += text_table(rows)
    if m["tensor_all_reduce_us"] is not None:
        lines.append(f"8 KB all-reduce in a tensor group: {m['tensor_all_reduce_us']:.0f} us")
    if m["stage_hop_us"] is not None:
        lines.append(f"8 KB hand-off between stages: {m['stage_hop_us']:.0f} us")
    return lines
