"""Per-rank expert load: how many token routes each rank's experts took.

The router runs on every rank, so every rank counts the same routes of its layers
(`models.moe.record_expert_load`: tokens per expert and layer). Split by expert, rank
r computes the routes to its experts only, and the busiest rank sets the pace of every
MoE layer; split by tensor, every rank computes every route at its share of the width,
so the load is even by construction. `--verbose` and `bench` print it:

    Expert load (split by expert): rank 0 1,204 routes (54.1%), rank 1 1,020 (45.9%);
    busiest rank 1.08x the mean
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cluster.distributed import all_gather_object
from ..models.moe import expert_load, record_expert_load
from ..parallel.partition import split_units


@dataclass(frozen=True)
class ExpertLoad:
    """Routes per rank (summed over its MoE layers) as the experts were split, and as they
    would be split by expert (whole experts, balanced: what decides that split's pace)."""

    split: str
    routes: list[int]
    by_expert: list[int]

    @staticmethod
    def busiest(routes: list[int]) -> float:
        """The busiest rank's routes over the mean (1.0: even)."""
        mean = sum(routes) / len(routes)
        return max(routes) / mean if mean else 1.0

    def summary(self) -> str:
        total = sum(self.by_expert) or 1
        ranks = ", ".join(
            f"rank {r} {n:,} routes ({100 * n / total:.1f}%)" if r == 0 else
            f"rank {r} {n:,} ({100 * n / total:.1f}%)"
            for r, n in enumerate(self.by_expert)
        )  # fmt: skip
        head = (
            "split by expert"
            if self.split == "expert"
            else ("split by tensor: every rank takes every route; split by expert it would be")
        )
        return f"({head}): {ranks}; busiest rank {self.busiest(self.by_expert):.2f}x the mean"

    def to_dict(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "routes": self.routes,
            "routes_by_expert": self.by_expert,
            "busiest_over_mean_by_expert": self.busiest(self.by_expert),
        }


def start(model: nn.Module) -> None:
    """Count routes from now on (every rank: it adds a few small ops to each MoE layer)."""
    record_expert_load(model, True)


def routes(counts: list[list[int]], experts: range) -> int:
    """Routes to `experts` in `counts` (tokens per expert, per MoE layer)."""
    return sum(sum(layer[e] for e in experts) for layer in counts)


def gather(model: nn.Module, placement: Any, group: mx.distributed.Group) -> ExpertLoad | None:
    """Every rank's routes since `start` (collective: one all_gather_object over `group`,
    the world); None for a dense model. A pipeline stage's ranks count their own layers;
    the tensor ranks of one stage see the same routes."""
    if placement is None or placement.plan.experts is None:
        return None
    counts = expert_load(model)
    mesh = getattr(model, "mesh", None)
    tp_rank = mesh.tp_rank if mesh is not None else group.rank()
    whole = split_units(placement.plan.experts.n_experts, [1] * placement.tp)
    mine = (
        routes(counts, placement.plan.parts[tp_rank].experts),
        routes(counts, whole[tp_rank]),
    )
    per_rank = all_gather_object((tp_rank, mine), group)
    if mesh is None:
        per_rank = per_rank[: placement.tp]
    held, by_expert = [0] * placement.tp, [0] * placement.tp
    for t, (a, b) in per_rank:  # summed over the stages
        held[t] += a
        by_expert[t] += b
    return ExpertLoad(placement.plan.experts.split, held, by_expert)
