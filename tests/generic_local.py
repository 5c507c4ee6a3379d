"""Every pipeline stage of a model on mlx-lm's classes, in one process: the stage cuts of
`llama_tp.generic` checked without launching ranks.

    tokens, reads = local_pipeline(path, pp=3)   # greedy tokens; per stage (read, held)

Each rank's stage is loaded as that rank loads it (`generic.loader.load_generic` with a
stand-in pipeline group: mlx-lm's own `pipeline()` where the model has one, else the
generic stage wrapper; its own layers' tensors read and nothing else). The hand-offs go
through a list instead of MLX's send and recv (mlx-lm's `pipeline()` forwards call
`mx.distributed.send/recv/all_gather`: replaced while a stage runs), the stages
agree on their dtypes and arities as `GenericModel.agree_dtypes` does (its phases,
called in turn), and the last stage's logits pick each token. What this leaves to the
launches of tests/test_generic.py is the transport itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx

from llama_tp.checkpoints.safetensors import READ
from llama_tp.generic.loader import load_generic
from llama_tp.generic.plan import StandInGroup
from llama_tp.generic.stages import StageLink


class LocalLink(StageLink):
    """A stage's hand-offs through `box` (shared by the stages of one model)."""

    box: list

    def receive(self, x: mx.array) -> mx.array:
        if self.probe is not None:
            return super().receive(x)
        h = self.box.pop(0)
        if tuple(h.shape) != tuple(x.shape):
            raise ValueError(f"stage {self.stage} takes {x.shape}, was handed {h.shape}")
        return h

    def send(self, out: Any) -> Any:
        if self.probe is not None:
            return super().send(out)
        h = out[0] if isinstance(out, tuple) else out
        mx.eval(h)
        self.box.append(h)
        return out


@contextmanager
def local_transport(box: list) -> Iterator[None]:
    """mlx-lm's `pipeline()` hand-offs through `box`, run in stage order (the first
    stage's rank, the highest, runs first; rank 0 runs the last layers and the head)."""
    d = mx.distributed
    saved = d.send, d.recv, d.recv_like, d.all_gather

    def send(x: mx.array, dst: int, *args: Any, **kwargs: Any) -> mx.array:
        mx.eval(x)
        box.append(x)
        return x

    def recv_like(x: mx.array, src: int, *args: Any, **kwargs: Any) -> mx.array:
        h = box.pop(0)
        if tuple(h.shape) != tuple(x.shape):
            raise ValueError(f"a stage takes {x.shape}, was handed {h.shape}")
        return h

    def recv(shape: Any, dtype: mx.Dtype, src: int, *args: Any, **kwargs: Any) -> mx.array:
        return recv_like(mx.zeros(shape, dtype), src)

    d.send, d.recv, d.recv_like = send, recv, recv_like
    d.all_gather = lambda x, *args, **kwargs: x  # only rank 0's (the last stage's) is kept
    try:
        yield
    finally:
        d.send, d.recv, d.recv_like, d.all_gather = saved


def load_stages(path: Path, pp: int) -> tuple[list, list[tuple[int, int]]]:
    """The `pp` ranks' models of the model at `path` in stage order, linked to each other;
    per stage the bytes it read and the bytes it holds."""
    ranks, box = [], []
    for rank in range(pp):
        group = StandInGroup(pp, rank)
        mesh = SimpleNamespace(tp=1, pp=pp, stage=rank, tp_group=None, pp_group=group)
        READ.reset()
        model, ckpt = load_generic(path, group, mesh)  # the pipeline is the world
        if model.link is not None:
            model.link.__class__ = LocalLink
            model.link.box = box
        ranks.append((model, (READ.bytes, ckpt.held_bytes)))
    ranks.sort(key=lambda r: r[0].stage_layers.start)
    stages = [m for m, _ in ranks]
    linked = [m for m in stages if m.link is not None]
    arity = max((a for a in (m.probe_arity() for m in linked) if a), default=1)
    for m in linked:
        m.link.arity = arity
    traces = [m.trace_stage() for m in linked]
    for m in linked:
        m.settle(traces, path.name)
    return stages, [r for _, r in ranks]


def local_pipeline(
    path: Path, pp: int, prompt: list[int], n: int
) -> tuple[list[int], list[tuple[int, int]], list[range], bool]:
    """Greedy tokens of `prompt` (n of them) through `pp` stages of the model at `path`,
    fed as mlx-lm's `generate_step` feeds them (the prompt but its last token, then one
    token at a time); per stage (bytes read, bytes held) and its layers; whether mlx-lm's
    own `pipeline()` cut the stages."""
    stages, reads = load_stages(path, pp)
    caches = [m.make_cache() for m in stages]
    box: list = []

    def step(tokens: list[int]) -> mx.array:
        x = mx.array([tokens])
        for m, c in zip(stages, caches, strict=True):
            if m.link is None:  # mlx-lm's pipeline(): the model's forward hands on
                with local_transport(box):
                    logits = m(x, cache=c)
            else:
                logits = m.stage_logits(x, c)
        return logits[0, -1]

    out: list[int] = []
    if len(prompt) > 1:
        mx.eval(step(prompt[:-1]))
    token = prompt[-1]
    for _ in range(n):
        token = int(mx.argmax(step([token])).item())
        out.append(token)
    return out, reads, [m.stage_layers for m in stages], stages[0].pipelined_by_mlx_lm
