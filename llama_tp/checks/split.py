"""The doctor's split advice (`python -m llama_tp.doctor [--model M]`): each rank's
memory, and the `--split` weights for unequal machines.

Every rank reports its total and available memory (`cluster/memory.py`); the doctor
suggests the weights that balance the time per step (each tensor rank's share in
proportion to its speed: 1 / its time for the 1024x1024 matrix product the BLAS check
runs) and the ones that fit memory (in proportion to what is available: what
`--split memory` would take). With `--model` it places the model's weights as the
loader would (balanced, and under both suggestions; `parallel/placement.py`, nothing
read) and says whether they fit each rank's available memory, or that they cannot
fit at all, with the numbers. Weights only: the KV cache and activations come on top.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..cluster.diagnostics import Check, run_check, text_table
from ..cluster.distributed import all_gather_object
from ..cluster.memory import memory_figures
from ..parallel.mesh import layout, mesh_shape
from ..parallel.plan_text import human_bytes
from ..parallel.shares import Weights, per_tensor_rank, suggested, weights_text


def check_split(
    group: mx.distributed.Group,
    report: dict,
    model: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
) -> Check:
    """Gather every rank's memory (into `report["hosts"]`), suggest --split weights for the
    mesh `tp` x `pp` (x `dp`; default: all ranks tensor-parallel) and, with `model`, check
    that its weights fit (into `report["split"]`)."""
    figures, err = run_check(
        "split", lambda: all_gather_object(memory_figures(group.rank()), group), group
    )
    if err:
        return Check("split", "FAILED", f"cannot read the ranks' memory: {err}")
    for info, (total, available) in zip(report["hosts"], figures, strict=False):
        info["memory"] = {"total": total, "available": available}
    n = group.size()
    T, P = mesh_shape(n, tp, pp, dp)
    blocks = layout(["one host"] * n, T, n // T, False)  # stages (of each replica) in rank order
    owner = {r: t for ranks in blocks for t, r in enumerate(ranks)}
    available = [a for _, a in figures]
    seconds = [h.get("blas", {}).get("seconds") for h in report["hosts"]]
    advice: dict[str, Any] = {"tp": T, "pp": P}
    if all(seconds):
        advice["speed"] = suggested(per_tensor_rank([1 / s for s in seconds], owner, T))
    advice["memory"] = suggested(per_tensor_rank(available, owner, T))
    report["split"] = advice
    words = []
    if T > 1 and "speed" in advice:
        words.append(f"for speed {_flag(advice['speed'])}")
    if T > 1:
        words.append(f"for memory {_flag(advice['memory'])}")
    if model is None:
        detail = "; ".join(words) or "one tensor rank: nothing to split"
        return Check("split", "ok", detail + (" (--model M: do its weights fit?)" * (T > 1)))
    fit, err = run_check("split", lambda: _fit(model, T, P, available, advice, group), group)
    if err:
        return Check("split", "FAILED", f"cannot place {model}: {err}")
    status, text = fit
    return Check("split", status, "; ".join([p for p in (_path(model), text, *words) if p]))


def _flag(weights: Weights | None) -> str:
    return "balanced (no --split)" if weights is None else f"--split {weights_text(weights)}"


def _fit(
    model: str,
    tp: int,
    pp: int,
    available: list[int],
    advice: dict[str, Any],
    group: mx.distributed.Group | None = None,
) -> tuple[str, str]:
    """(status, text): do the model's weights fit each rank's available memory, balanced
    or under the suggested weights (each rank's bytes into `advice["holds"]`)? The model
    need be on one rank only (`model_sources.open_shared`; collective)."""
    from ..checkpoints.slices import model_shape
    from ..cluster.distributed import all_gather_object, world
    from ..loading.model_sources import open_shared
    from ..parallel.placement import place

    group = group or world()
    n = len(available)
    holds: dict[str, list[int]] = {}
    shape = None
    # mlx-lm's classes (even tensor splits only): the same branch on every rank, even where
    # the folder is missing (that rank then fails the check, and every rank says so)
    if any(all_gather_object(_generic_here(model), group)):
        from pathlib import Path

        from ..generic.plan import rank_holds

        per_replica = rank_holds(Path(model), tp, pp)
        holds["balanced"] = [per_replica[r % len(per_replica)] for r in range(n)]
    else:
        shape = model_shape(open_shared(model, group).ckpt)
    for name in ("balanced", "speed", "memory") if shape is not None else ():
        weights = None if name == "balanced" else advice.get(name)
        if name != "balanced" and weights is None:
            continue
        placement = place(shape, tp, pp, split=weights)
        per_replica = [r.nbytes for r in placement.ranks]  # --dp: each replica alike
        holds[weights_text(weights)] = [per_replica[r % len(per_replica)] for r in range(n)]
    advice["holds"] = holds
    balanced = holds["balanced"]
    need, have = sum(balanced), sum(available)
    if min(sum(b) for b in holds.values()) > have:
        each = ", ".join(f"rank {r} {human_bytes(a)}" for r, a in enumerate(available))
        return "FAILED", (
            f"{model} cannot fit: its weights take {human_bytes(need)} over {len(available)} "
            f"rank(s) (with what each repeats), {human_bytes(have)} are available ({each})"
        )
    for text, nbytes in holds.items():
        if all(b <= a for b, a in zip(nbytes, available, strict=True)):
            fullest = max(range(len(nbytes)), key=lambda r: nbytes[r] / available[r])
            how = "balanced" if text == "balanced" else f"with --split {text}"
            where = f"rank {fullest} holds {human_bytes(nbytes[fullest])} of "
            where += f"{human_bytes(available[fullest])} available"
            return ("ok" if text == "balanced" else "warn"), f"weights fit {how} ({where})"
    worst = max(range(len(balanced)), key=lambda r: balanced[r] - available[r])
    return "warn", (
        f"weights fit no suggested split: balanced, rank {worst} would hold "
        f"{human_bytes(balanced[worst])} of {human_bytes(available[worst])} available"
    )


def _path(model: str) -> str | None:
    """Which path runs `model` and why ('native: ...', 'mlx-lm classes: ...'); None for a
    file or a folder this rank lacks."""
    from ..generic.loader import checkpoint_route

    try:
        route = checkpoint_route(model)
    except Exception:  # noqa: BLE001 - placing it said what is wrong
        return None
    return f"{route.path} ({route.reason})" if route is not None else None


def _generic_here(model: str) -> bool:
    """Does mlx-lm's classes run `model` (a folder on this rank)?"""
    from ..generic.loader import checkpoint_route

    try:
        route = checkpoint_route(model)
    except Exception:  # noqa: BLE001 - the native path then says what is wrong
        return False
    return route is not None and route.generic


def split_lines(report: dict) -> list[str]:
    """The report's memory section: each rank's total and available memory, its matrix
    product time and, with --model, what it would hold under each split."""
    hosts = report.get("hosts") or []
    if not hosts or "memory" not in hosts[0]:
        return []
    holds = (report.get("split") or {}).get("holds", {})
    head = ["rank", "total", "available", "matmul"] + [
        "holds " + ("balanced" if k == "balanced" else f"--split {k}") for k in holds
    ]
    rows = [head]
    for i, h in enumerate(hosts):
        matmul = f"{h['blas']['seconds']:.3f} s" if "blas" in h else "-"
        mem = h["memory"]
        row = [str(h["rank"]), human_bytes(mem["total"]), human_bytes(mem["available"]), matmul]
        rows.append(row + [human_bytes(b[i]) for b in holds.values()])
    return [
        "",
        "memory (weights only: the KV cache and activations come on top):",
        *text_table(rows),
    ]
