"""`parallelize(model, plan, group)`: apply a plan of parallel styles to a model.

A plan maps module paths to styles; a path's dot-separated parts may use shell
wildcards, one part each (`"layers.*.attention.wq"`, `"layers.*.feed_forward.w[13]"`;
`""` is the module itself):

    from llama_tp.parallel.parallelize import parallelize
    from llama_tp.parallel.styles import ColwiseParallel, RowwiseParallel

    parallelize(model, {
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }, group)

The whole plan is checked against the model before any module changes: a path that
matches no module, a module matched twice, or a style that cannot apply to the layer
it matches raises one `PlanError` naming the path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import mlx.core as mx
import mlx.nn as nn

from ..cluster.distributed import world
from .module_swap import module_at, replace_at
from .sequence import SequenceContext
from .styles import PlanError, Split, Style

Plan = Mapping[str, Style]


@dataclass
class Parallelized:
    """What `parallelize` did: each matched module's path -> (style, split)."""

    n: int
    rank: int
    styles: dict[str, Style] = field(default_factory=dict)
    splits: dict[str, Split | None] = field(default_factory=dict)
    sequence: SequenceContext | None = None

    def tensor_slice(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(axis, start, stop) of parameter `name` (stored `shape`) this rank reads; None: whole."""
        path = name.rpartition(".")[0]
        split = self.splits.get(path)
        return None if split is None else split.tensor_slice(shape, self.rank)


def _natural(path: str) -> list[tuple[int, int | str]]:
    """Sort key: "layers.2" before "layers.10"."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in path.split(".")] if path else []


def _matches(pattern: str, path: str) -> bool:
    if pattern == "" or path == "":
        return pattern == path
    p, q = pattern.split("."), path.split(".")
    return len(p) == len(q) and all(fnmatchcase(b, a) for a, b in zip(p, q, strict=True))


def resolve(model: nn.Module, plan: Plan) -> dict[str, tuple[str, Style]]:
    """Module path -> (plan path, style) for every module the plan names."""
    modules = sorted((path for path, _ in model.named_modules()), key=_natural)
    out: dict[str, tuple[str, Style]] = {}
    for pattern, style in plan.items():
        if not isinstance(style, Style):
            raise PlanError(f"{pattern!r}: {style!r} is not a parallel style")
        hits = [path for path in modules if _matches(pattern, path)]
        if not hits:
            examples = ", ".join(repr(p) for p in modules[1:4])
            raise PlanError(
                f"plan path {pattern!r} matches no module of {type(model).__name__} "
                f"(its paths look like {examples}, ...)"
            )
        for path in hits:
            if path in out:
                raise PlanError(f"{path}: matched by both {out[path][0]!r} and {pattern!r}")
            out[path] = (pattern, style)
    return out


def plan_splits(model: nn.Module, plan: Plan, n: int) -> dict[str, tuple[str, Style, Split | None]]:
    """Validate `plan` against `model` for `n` ranks without changing anything:
    module path -> (plan path, style, what each rank keeps)."""
    return {
        path: (pattern, style, style.split(module_at(model, path), path, n))
        for path, (pattern, style) in resolve(model, plan).items()
    }


def parallelize(
    model: nn.Module,
    plan: Plan,
    group: mx.distributed.Group | None = None,
    sequence: SequenceContext | None = None,
) -> Parallelized:
    """Apply `plan` to `model` in place over `group` (default: the world).

    Deeper modules go first, so a style on a module (e.g. `PrepareModuleInput` on
    `attention`) sees its already sharded children. `sequence`: the sequence-parallel
    context the model's styles share (default: a new one; parts of one model sharded
    one by one pass the same). Returns what was done, which the loader uses to read
    each rank's slices.
    """
    group = group or world()
    n, rank = group.size(), group.rank()
    checked = plan_splits(model, plan, n)
    done = Parallelized(n, rank, sequence=sequence or SequenceContext(group))
    for path in sorted(checked, key=lambda p: -len(p.split(".")) if p else 0):
        _, style, split = checked[path]
        module = module_at(model, path)
        new = style.apply(module, group, done.sequence, split)
        if new is not module:
            if not path:
                raise PlanError(f"{type(style).__name__} cannot replace the root module")
            replace_at(model, path, new)
        done.styles[path], done.splits[path] = style, split
    return done


def _collapse(path: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def format_plan_table(model: nn.Module, plan: Plan, n: int, labels: list[str] | None = None) -> str:
    """The plan as a table: path -> style -> each rank's slice (layer indices shown as *).
    `labels`: the ranks' column headers (default "rank 0" .. "rank n-1")."""
    rows: dict[tuple[str, str], list[str]] = {}
    for path, (_, style, split) in plan_splits(model, plan, n).items():
        slices = [style.describe(r, n) if split is None else split.describe(r) for r in range(n)]
        # dense and expert layers, layers of other head sizes (Gemma 4): a row each
        key = (_collapse(path), style.label(), *slices)
        if key in rows:
            continue
        rows[key] = [_collapse(path), style.label(), *slices]
    labels = labels or [f"rank {r}" for r in range(n)]
    table = [["path", "style", *labels], *rows.values()]
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table
    )
