"""Embeddings: each input's final hidden states pooled into one vector, a chunk at a time
between decode steps.

The server's embedding request reaches every rank as an `Embed` in rank 0's decision
(its inputs' token ids and the checkpoint's pooling); the `Embedder` of each rank's
engine works through the same requests in the same order, so the model's collectives
meet. A request's inputs are grouped into units by length (`units`): several short
inputs side by side, right-padded to the longest, as long as the unit has at most
`budget` positions; an input longer than that alone, fed `budget` positions at a time
over a cache of its own. Right padding changes nothing before it: attention and
recurrent states are causal, so a position never sees the padding after it, and every
row's vector is the one it has alone (to float rounding).

`step()` runs one chunk (at most `budget` positions, the prompt chunk's size) of the
next request, the requests taking turns: the rows being decoded get a token between
any two chunks, and a request with many long inputs neither stalls them nor the
embedding requests queued after it. Each chunk's hidden states (`model.hidden`: the
final-normed state the head reads, whole on every rank) are pooled as they come:

    mean   the sum over the input's positions, divided by its length at the end
    cls    the first position's
    last   the last position's

A unit's cache is made for it and dropped when it is done: nothing is kept, and the
batch's caches are never touched. The vectors come back as float32 values, not yet
normalized (the server's routes normalize, and cut Matryoshka sizes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cluster.distributed import first_line
from . import caches
from .batch_messages import Embed, Embedded

MAX_ROWS = 64  # inputs side by side in one unit


def hidden_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot give its hidden states to pool (a model kind without
    `hidden`, or one whose own check says why: mlx-lm's classes), or None."""
    if not callable(getattr(model, "hidden", None)):
        return f"the {type(model).__name__} model gives no hidden states"
    return getattr(model, "hidden_refusal", None)


def units(lengths: list[int], budget: int, max_rows: int = MAX_ROWS) -> list[list[int]]:
    """The inputs (indices) grouped for the forward: by length, shortest first, each
    group holding at most `budget` positions once padded to its longest (and at most
    `max_rows` inputs); an input longer than `budget` alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    for i in order:
        last = out[-1] if out else None
        # sorted ascending: input i is the longest of the group it would join
        if last and len(last) < max_rows and (len(last) + 1) * lengths[i] <= budget:
            last.append(i)
        else:
            out.append([i])
    return out


@dataclass
class _Unit:
    """Inputs run side by side (B rows, right-padded to L) and their pooled sums so far."""

    rows: list[int]  # indices of the request's inputs
    tokens: list[list[int]]  # (B, L), right-padded
    lengths: list[int]
    fed: int = 0  # positions run so far
    cache: list[Any] | None = None
    acc: mx.array | None = None  # (B, D) float32

    @property
    def size(self) -> int:
        return len(self.tokens[0])


@dataclass
class _Job:
    embed: Embed
    todo: deque[_Unit]
    vectors: list[list[float] | None] = field(default_factory=list)


class Embedder:
    """The embedding requests one engine works through (see the module's docstring)."""

    def __init__(self, model: nn.Module, budget: int = 512):
        self.model, self.budget = model, budget
        self.jobs: deque[_Job] = deque()
        self.embedded_tokens = 0  # positions run through the model (tests, logs)

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, embed: Embed) -> None:
        lengths = [len(t) for t in embed.inputs]
        todo = deque()
        for rows in units(lengths, self.budget):
            width = max(lengths[i] for i in rows)
            # the padding's id is any valid one: no position before it sees it
            padded = [embed.inputs[i] + [0] * (width - lengths[i]) for i in rows]
            todo.append(_Unit(rows, padded, [lengths[i] for i in rows]))
        self.jobs.append(_Job(embed, todo, [None] * len(lengths)))

    def cancel(self, uids: set[int]) -> list[Embedded]:
        """Drop the requests `uids`: their "cancelled" ends."""
        gone = [j for j in self.jobs if j.embed.uid in uids]
        for j in gone:
            self.jobs.remove(j)
        return [Embedded(j.embed.uid, None, 0, "cancelled") for j in gone]

    def step(self) -> list[Embedded]:
        """One chunk of the next request (the requests take turns); the requests that
        are done, with their vectors."""
        if not self.jobs:
            return []
        job = self.jobs.popleft()
        unit = job.todo[0]
        try:
            self._chunk(unit, job.embed.pooling)
        except ValueError as e:  # the same on every rank (a model that cannot give them)
            return [Embedded(job.embed.uid, None, 0, "error", first_line(e))]
        if unit.fed == unit.size:
            job.todo.popleft()
            acc = unit.acc
            if job.embed.pooling == "mean":
                acc = acc / mx.array(unit.lengths, mx.float32)[:, None]
            for i, v in zip(unit.rows, acc.tolist(), strict=True):
                job.vectors[i] = v
        if job.todo:
            self.jobs.append(job)  # its next chunk after the other requests' next
            return []
        tokens = sum(len(t) for t in job.embed.inputs)
        return [Embedded(job.embed.uid, job.vectors, tokens)]

    def _chunk(self, unit: _Unit, pooling: str) -> None:
        """The unit's next positions through the model, pooled into `unit.acc`."""
        B, a = len(unit.rows), unit.fed
        n = min(unit.size - a, max(1, self.budget // B))
        if unit.cache is None:
            unit.cache = caches.new(self.model)
        x = mx.array([t[a : a + n] for t in unit.tokens], dtype=mx.int32)
        h = self.model.hidden(x, cache=unit.cache).astype(mx.float32)  # (B, n, D)
        lengths = mx.array(unit.lengths, mx.int32)
        if unit.acc is None:
            unit.acc = mx.zeros((B, h.shape[-1]), mx.float32)
        if pooling == "mean":
            valid = (mx.arange(a, a + n)[None, :] < lengths[:, None]).astype(mx.float32)
            unit.acc = unit.acc + (h * valid[..., None]).sum(axis=1)
        elif pooling == "cls":
            if a == 0:
                unit.acc = h[:, 0]
        else:  # last: the rows whose last position is in this chunk
            at = mx.clip(lengths - 1 - a, 0, n - 1)
            picked = mx.take_along_axis(h, at[:, None, None], axis=1)[:, 0]
            here = (lengths - 1 >= a) & (lengths - 1 < a + n)
            unit.acc = mx.where(here[:, None], picked, unit.acc)
        unit.fed = a + n
        self.embedded_tokens += B * n
        if unit.fed < unit.size:
            mx.eval(unit.acc, *caches.arrays(unit.cache))
        else:
            mx.eval(unit.acc)
            unit.cache = None  # nothing kept
