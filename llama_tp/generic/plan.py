"""`python -m llama_tp.plan` for a model on mlx-lm's classes: each rank's layers and bytes.

Every rank's part is made as the loader makes it (`loader.split_rank`: the model built
lazily, split by its `shard()` or the style table, cut into its stage), with stand-ins
for the groups (only their size and rank are asked), and its bytes counted from the
files' headers. Nothing is read, nothing is launched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..parallel.plan_text import human_bytes
from .loader import Opened, split_rank
from .reads import held


@dataclass(frozen=True)
class StandInGroup:
    """What a split asks of a group when nothing is sent: its size and this rank's place."""

    n: int
    r: int

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


def rank_bytes(opened: Opened, names: dict) -> int:
    """The stored bytes of the parameters `names` (name -> the held array), each counted as
    the part of its stored tensor it keeps."""
    total = 0
    for name, like in names.items():
        entry = opened.stored.get(name)
        if entry is None:
            total += like.nbytes
            continue
        info = entry[1]
        total += info.nbytes * like.size // max(1, math.prod(info.shape))
    return total


def rank_parts(
    path: Path,
    tp: int,
    pp: int,
    pp_split: str | None = None,
    stage_weights: tuple[float, ...] | None = None,
) -> tuple[Opened, list[tuple]]:
    """Every rank's part (rank order: stage by stage, tensor ranks within): (stage, tensor
    rank, loader.Placed, what it holds besides layers, its bytes)."""
    first = Opened(path)
    rows = []
    for stage in range(pp):
        for t in range(tp):
            opened = first if (stage, t) == (0, 0) else Opened(path)
            placed = split_rank(
                opened, tp, pp, stage, StandInGroup(tp, t), StandInGroup(pp, stage),
                pp_split, stage_weights, pp_is_world=tp == 1,
            )  # fmt: skip
            names = held(placed.model)
            rows.append((stage, t, placed, _extras(opened, names), rank_bytes(opened, names)))
    return first, rows


def rank_holds(path: Path, tp: int, pp: int) -> list[int]:
    """The bytes each rank of a tp x pp mesh holds (the doctor's `--model` check)."""
    return [row[4] for row in rank_parts(path, tp, pp)[1]]


def plan_lines(
    path: Path,
    tp: int,
    pp: int,
    pp_split: str | None = None,
    stage_weights: tuple[float, ...] | None = None,
) -> list[str]:
    """The plan of the mlx-lm model at `path` on a tp x pp mesh: the path it runs on and why,
    how it splits, then one line per rank (its stage, layers, what else it holds, bytes)."""
    first, rows = rank_parts(path, tp, pp, pp_split, stage_weights)
    lines = [f"{path.name}: {first.route.path}: {first.route.reason}"]
    placed = rows[0][2]
    tensor = f"by tensor over {tp} ranks by {placed.how}" if tp > 1 else ""
    if pp > 1:
        by = "mlx-lm's pipeline()" if placed.by_mlx_lm else "llama_tp's stage wrapper"
        lines.append(f"{pp} pipeline stages by {by}" + (f", each split {tensor}" if tensor else ""))
    elif tensor:
        lines.append(f"split {tensor}")
    for rank, (stage, _, p, extra, nbytes) in enumerate(rows):
        # mlx-lm's pipeline() gives pipeline rank 0 the last layers
        label = pp - 1 - stage if p.by_mlx_lm else stage
        what = f"layers {p.layers.start}-{p.layers.stop - 1}" + (f" + {extra}" if extra else "")
        lines.append(f"rank {rank}: stage {label}: {what}: {human_bytes(nbytes)}")
    return lines


def _extras(opened: Opened, names: dict) -> str:
    s = opened.structure
    parts = []
    if s.embedding and any(k.startswith(s.embedding + ".") for k in names):
        parts.append("embedding")
    if s.head and any(k.startswith(s.head + ".") for k in names):
        parts.append("head")
    return ", ".join(parts)
