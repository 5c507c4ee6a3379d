"""`GenericModel`: an mlx-lm model (or one pipeline stage of it) as the engine runs models.

    model(tokens (B, L), cache=..., every_position=False) -> logits (B, L or 1, V)
    model.make_cache()   # one cache per layer this rank runs
    model.args           # GenericArgs: vocab_size, dim, n_layers, the config

On one stage (one process, or tensor-parallel ranks through the model's `shard()`) it is
mlx-lm's model itself. Split into pipeline stages (`stages.py`) it returns the last
stage's logits on every rank: the last position's when decoding with a cache, every
position's for scoring (no cache) or `every_position` (speculative verification). With
mlx-lm's own `pipeline()` (`pipelined_by_mlx_lm`) the model's forward does the hand-offs
and every rank computes the head itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..models.caches import cache_kind
from .stages import FLOATS


@dataclass
class GenericArgs:
    """What the engine reads of a model's config (`ModelArgs`' names), for mlx-lm's classes."""

    model_type: str
    dim: int
    n_layers: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    config: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        return asdict(self)


# mlx-lm classes whose attention adds the mask to grouped scores (B, KV heads, repeats,
# L, S) when query heads share KV heads: a batch's (B, 1, L, S) mask does not broadcast
# there (mlx-lm 0.32's gemma2 and phi3small fail in their own batch generation too), so
# such a model decodes one sequence at a time.
GROUPED_SCORES = ("gemma2", "phi3small")


class GenericModel(nn.Module):
    """mlx-lm's `inner` model as this rank runs it (see the module docstring)."""

    @property
    def batch_refusal(self) -> str | None:
        """Why this model cannot decode several sequences as one batch, or None."""
        c = self.args.config
        heads = c.get("num_attention_heads", 0)
        if self.args.model_type in GROUPED_SCORES and heads != c.get("num_key_value_heads", heads):
            return f"mlx-lm's {self.args.model_type} attention cannot take a batch's mask"
        return None

    def __init__(self, inner: nn.Module, args: GenericArgs, structure: Any, layers: range):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "structure", structure)  # generic.structure.Structure
        n_layers = structure.n_layers
        object.__setattr__(self, "stage_layers", layers)  # global indices this rank runs
        object.__setattr__(self, "n_total", n_layers)
        object.__setattr__(self, "link", None)  # StageLink when split by stages here
        object.__setattr__(self, "mesh", None)  # the tp x pp mesh, when there is one
        object.__setattr__(self, "pipelined_by_mlx_lm", False)
        object.__setattr__(self, "logits_dtype", None)
        # the cache entries this rank keeps, and how the model's list is made of them
        object.__setattr__(self, "_owned", [])
        object.__setattr__(self, "_where", {})
        object.__setattr__(self, "_aliases", [])

    # -- caches -------------------------------------------------------------

    def _inner_caches(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.inner)

    def make_cache(self) -> list[Any]:
        """The caches this rank keeps (mlx-lm's `make_cache` of the model): on a stage, those
        its own layers use and those no layer uses (an n-gram embedding's), in the model's
        order (`_map_caches`)."""
        full = self._inner_caches()
        if self.pipelined_by_mlx_lm:
            # its forward pairs the stage's layers with the caches; kimi_vl's `layers` (and
            # so mlx-lm's default caches) counts every layer up to the stage's last
            return full[-len(self.stage_layers) :]
        if self.link is None:
            return full
        return [full[j] for j in self._owned]

    def _full_cache(self, cache: list[Any] | None) -> list[Any] | None:
        """The model's own list for this rank's `cache`: a skipped layer's entry is a kept
        cache of the same kind (the masks the model makes from it then have the right
        offsets) or a spare that nothing updates."""
        if cache is None or self.link is None:
            return cache
        where = self._where
        return [
            cache[where[j]] if j in where else (cache[a] if isinstance(a, int) else a)
            for j, a in enumerate(self._aliases)
        ]

    def _map_caches(self, run: Any) -> None:
        """Learn which cache entry each layer takes, by running `run()` (a traced forward)
        with distinct cache objects and noting what each layer receives; then keep the
        entries of this stage's layers and the ones no layer takes."""
        from ..parallel.module_swap import module_at
        from .stages import swap_class

        full = self._inner_caches()
        index = {id(c): j for j, c in enumerate(full)}
        took: dict[int, int] = {}
        layers = module_at(self.inner, self.structure.layers)
        saved = [type(layer) for layer in layers]

        def recorder(i: int, base: Any) -> Any:
            def call(me, *args, **kwargs):
                for v in (*args, *kwargs.values()):
                    if id(v) in index:
                        took[i] = index[id(v)]
                return base(me, *args, **kwargs)

            return call

        for i, layer in enumerate(layers):
            swap_class(layer, "Recording", recorder(i, type(layer).__call__))
        try:
            run(full)
        finally:
            for layer, cls in zip(layers, saved, strict=True):
                object.__setattr__(layer, "__class__", cls)
        taken = set(took.values())
        owned = sorted(
            {took[i] for i in self.stage_layers if i in took} | set(range(len(full))) - taken
        )
        where = {j: k for k, j in enumerate(owned)}
        kinds = [cache_kind(full[j]) for j in owned]
        aliases: list[Any] = []
        for j, c in enumerate(full):
            k = cache_kind(c)
            aliases.append(j if j in where else (kinds.index(k) if k in kinds else c))
        object.__setattr__(self, "_owned", owned)
        object.__setattr__(self, "_where", where)
        object.__setattr__(self, "_aliases", aliases)

    @property
    def layers(self) -> list[nn.Module]:
        """The layers this rank runs."""
        from ..parallel.module_swap import module_at

        every = module_at(self.inner, self.structure.layers)
        return [every[i] for i in self.stage_layers]

    # -- forward ------------------------------------------------------------

    def __call__(
        self,
        tokens: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
        every_position: bool = False,
    ) -> mx.array:
        logits = self.stage_logits(tokens, cache, input_embeddings, every_position)
        if self.link is None:
            return logits
        return mx.distributed.all_sum(logits, group=self.link.group)

    def stage_logits(
        self,
        tokens: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
        every_position: bool = False,
    ) -> mx.array:
        """This rank's part of the logits (B, L or 1, V): the model's own on one stage, the
        last stage's on it, zeros on the others (the stages' sum is the model's logits)."""
        extra = {} if input_embeddings is None else {"input_embeddings": input_embeddings}
        out = self.inner(tokens, cache=self._full_cache(cache), **extra)
        link = self.link
        if link is None:
            return out
        B, L = tokens.shape
        n = L if every_position or cache is None else 1
        if link.stage == link.pp - 1:
            return out[:, -n:, :]
        return mx.zeros((B, n, self.args.vocab_size), self.logits_dtype)

    @property
    def hidden_refusal(self) -> str | None:
        """Why this model cannot give its hidden states (`hidden`), or None."""
        s = self.structure
        if s.head is None and s.embedding is None:
            return (
                f"mlx-lm's {self.args.model_type} has no output head or token embedding "
                "module whose input is the final hidden state"
            )
        return None

    def hidden(self, tokens: mx.array, cache: list[Any] | None = None) -> mx.array:
        """tokens (B, L) -> the final-normed hidden state (B, L, dim) in float32, on every
        rank: what mlx-lm's forward hands its output head (read at the head's input, so
        whatever the model does before it is mlx-lm's own; the head itself is never
        evaluated). Split into stages, the last stage's, shared by one all-sum over the
        pipeline group (the others add zeros). ValueError when the forward reaches no head."""
        seen: list[mx.array] = []
        with _reading_head_input(self.inner, self.structure, seen):
            self.inner(tokens, cache=self._full_cache(cache))
        if not seen:
            raise ValueError(
                f"mlx-lm's {self.args.model_type}: its forward reached no output head, so its "
                "hidden states cannot be read"
            )
        h = seen[-1].astype(mx.float32)
        link = self.link
        if link is None:
            return h
        if link.stage != link.pp - 1:
            h = mx.zeros(h.shape, mx.float32)
        return mx.distributed.all_sum(h, group=link.group)

    def describe_stages(self, group: mx.distributed.Group) -> list[str]:
        """One line per stage from what each rank holds: its ranks, layers and weight bytes
        (collective: one all_gather_object over `group`, every rank calls it)."""
        from mlx.utils import tree_flatten

        from ..cluster.distributed import all_gather_object
        from ..parallel.plan_text import human_bytes

        mesh = self.mesh
        stage = self.link.stage if self.link is not None else mesh.pp - 1 - mesh.stage
        nbytes = sum(v.nbytes for _, v in tree_flatten(self.parameters()) if hasattr(v, "nbytes"))
        layers = self.stage_layers
        ranks = all_gather_object((stage, layers.start, layers.stop, nbytes), group)
        by = "mlx-lm's pipeline()" if self.pipelined_by_mlx_lm else "llama_tp's stage wrapper"
        lines = [f"stages by {by}"]
        for s in range(mesh.pp):
            members = [(r, x) for r, x in enumerate(ranks) if x[0] == s]
            _, a, b, _ = members[0][1]
            who = ", ".join(f"rank {r} {human_bytes(x[3])}" for r, x in members)
            lines.append(f"stage {s}: layers {a}-{b - 1} ({who})")
        return lines

    def vocab_shard(self) -> None:
        """Every rank holds the whole vocabulary's logits."""
        return None

    # -- the stages' dtypes ---------------------------------------------------

    def agree_dtypes(self, name: str = "this model") -> None:
        """Learn how the stages fit together, tracing each stage's forward on one token
        (nothing evaluated, nothing sent; two small all-gathers over the pipeline group):
        how many values a layer returns, which cache each layer takes (`_map_caches`), the
        dtype of the hidden state each stage receives and of the logits. Raises ValueError
        on every rank when the forward cannot run as stages (it reaches into layers another
        stage holds, or hands on a hidden state of another shape than the next takes)."""
        from ..cluster.distributed import all_gather_object

        arities = all_gather_object(self.probe_arity(), self.link.group)
        self.link.arity = max((a for a in arities if a), default=1)
        self.settle(all_gather_object(self.trace_stage(), self.link.group), name)

    def probe_arity(self) -> int | None:
        """How many values this stage's first real layer returns (None: none ran). Stage 0
        runs a real layer before any skipped one, so its probe sees it even if a skipped
        layer (returning one value) then breaks the forward."""
        link = self.link
        link.probe, link.seen = mx.float32, {}
        try:
            self.inner(mx.zeros((1, 1), mx.int32))
        except Exception:  # noqa: BLE001 - traced again once the stages agree on the arity
            pass
        finally:
            link.probe = None
        return link.seen.get("arity")

    def trace_stage(self) -> tuple[dict, dict] | str:
        """This stage traced (`_trace`), or why its forward does not run alone."""
        from ..cluster.distributed import first_line

        try:
            return self._trace()
        except Exception as e:
            return f"{type(e).__name__}: {first_line(e)}"
        finally:
            self.link.probe = None

    def settle(self, stages: list, name: str = "this model") -> None:
        """Fit this stage to every stage's `trace_stage` (in stage order): the dtype it
        receives, the logits' dtype; ValueError when a stage failed or two do not fit."""
        link = self.link
        failed = next((s for s, m in enumerate(stages) if isinstance(m, str)), None)
        if failed is not None:
            raise ValueError(
                f"{name} cannot be split into pipeline stages: its forward does not run on "
                f"stage {failed} alone ({stages[failed]})"
            )
        dtype = stages[0][0]["float32"]  # stage 0 receives nothing: any entry is its own
        for s in range(1, link.pp):
            before, here = stages[s - 1][1]["out"], stages[s][1]["in"]
            if before != here:
                raise ValueError(
                    f"{name} cannot be split into pipeline stages: stage {s - 1} hands on a "
                    f"hidden state of shape {list(before)}, stage {s} takes {list(here)}"
                )
            if s == link.stage:
                link.in_dtype = getattr(mx, dtype)
            dtype = stages[s][0][dtype]
        object.__setattr__(self, "logits_dtype", getattr(mx, dtype))

    def _trace(self) -> tuple[dict, dict]:
        """This stage traced: its cache map, and per float dtype received the dtype it hands
        on (the logits' on the last stage), with the shapes it takes and hands on."""
        link = self.link
        link.probe, link.seen = mx.float32, {}
        self._map_caches(lambda cache: self.inner(mx.zeros((1, 1), mx.int32), cache=cache))
        table, shapes = {}, {}
        for name in FLOATS:
            link.probe, link.seen = getattr(mx, name), {}
            out = self.inner(mx.zeros((1, 1), mx.int32))
            handed = link.seen.get("out")  # (shape, dtype) sent on; None on the last stage
            table[name] = _name(handed[1] if handed else out.dtype)
            shapes = {"in": link.seen.get("in_shape"), "out": handed[0] if handed else None}
        return table, shapes


@contextmanager
def _reading_head_input(inner: nn.Module, structure: Any, seen: list) -> Iterator[None]:
    """While inside, the output head (its `__call__`) and the token embedding used as one
    (`as_linear`, a tied head) note the hidden state they receive in `seen`: their
    classes swapped for subclasses that do, and swapped back after."""
    from ..parallel.module_swap import module_at

    swapped = []
    for path, method in ((structure.head, "__call__"), (structure.embedding, "as_linear")):
        if path is None:
            continue
        module = module_at(inner, path)
        base = type(module)
        original = getattr(base, method, None)
        if original is None:
            continue

        def read(me, x, *args, _original=original, **kwargs):
            seen.append(x)
            return _original(me, x, *args, **kwargs)

        reading = type(f"Read{base.__name__}", (base,), {method: read})
        object.__setattr__(module, "__class__", reading)
        swapped.append((module, base))
    try:
        yield
    finally:
        for module, base in swapped:
            object.__setattr__(module, "__class__", base)


def _name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]
