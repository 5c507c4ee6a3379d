"""The ranks agree: at start-up on what they run, during generation on the tokens.

Ranks that loaded different weights, tokenizers or configs, or run different
llama_tp/mlx versions, would exchange activations that do not belong together
and silently produce garbage. `check_agreement` gathers a few facts from every
rank (one small `all_gather_object`) and raises the same `AgreementError` on
every rank when they differ, naming the ranks and what differs:

    ranks disagree on the model weights: ranks 0, 2 have 3f2a9c1b7e40, rank 1 has
    9b0d44e1c2aa (rank 0: /models/a, rank 1: /models/b)

The mesh (`--tp`, `--pp`, the layers of each stage and the tensor groups' `--split`)
is compared twice: the flags by `check_mesh_flags` before the mesh's groups are made
(making them is collective, so ranks with different flags must stop first), and the
mesh each rank built in `check_agreement` (with the weights `--split memory` resolved
to, or a pre-split folder's):

    ranks disagree on the mesh (--pp: rank 0 has 2, rank 1 has 1)

The weights' fingerprint is cheap: the size of every weight file, its first
64 KiB (the header: tensor names, shapes, offsets) and 64 KiB at eight fixed
offsets, hashed; a checkpoint that carries its own fingerprint
(`metadata["llama_tp"]["fingerprint"]`, e.g. per-rank pre-split folders whose
files differ by design) uses that instead.

During generation `TokenCheck` compares a running hash of the prompt and the
generated tokens every `CHECK_EVERY` tokens (used by `generate.stream_generate`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints.fingerprint import digest, tokenizer_fingerprint, weights_fingerprint
from ..cluster.distributed import all_gather_object, first_line, world
from ..parallel.shares import weights_text

CHECK_EVERY = 16  # tokens between the ranks' comparisons of what they generated

# What is compared, in the order mismatches are reported, with the words for it.
FACTS = {
    "versions": "the llama_tp / mlx / mlx-lm versions",
    "world": "the number of ranks",
    "config": "the model config",
    "mesh": "the mesh",
    "plan": "the partition plan",
    "weights": "the model weights",
    "tokenizer": "the tokenizer",
}


class AgreementError(RuntimeError):
    """The ranks do not run the same model, tokenizer or versions."""


def local_facts(
    model: nn.Module, ckpt: Any, tokenizer: Any, group: mx.distributed.Group
) -> dict[str, Any]:
    """What this rank runs: the values compared across ranks (all small)."""
    import mlx_lm

    from ..cluster.diagnostics import llama_tp_version

    config = model.args.to_dict()
    mesh = getattr(ckpt, "mesh", None) or getattr(model, "mesh", None)
    placement = getattr(ckpt, "placement", None)
    weights = placement.plan.weights if placement is not None else None
    return {
        "versions": (
            f"llama_tp {llama_tp_version()}, mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}"
        ),
        "world": group.size(),
        "config": config,
        "mesh": mesh_facts(mesh, group, weights),
        "plan": digest([repr(getattr(ckpt, "placement", None)).encode()]),
        "weights": weights_fingerprint(ckpt),
        "tokenizer": tokenizer_fingerprint(ckpt, tokenizer),
        "path": str(ckpt.path),
    }


def mesh_facts(
    mesh: Any, group: mx.distributed.Group, weights: tuple[float, ...] | None = None
) -> dict[str, Any]:
    """The mesh this rank built (`parallel.mesh.Mesh`, None: all ranks tensor-parallel):
    --tp, --pp, the layers of each stage (as --pp-split), --dp, and the tensor groups'
    --split (`weights`, as resolved: None is balanced)."""
    facts = {"--tp": group.size(), "--pp": 1, "--pp-split": None, "--dp": 1}
    if mesh is not None:
        split = ",".join(str(len(r)) for r in mesh.layers) if mesh.pp > 1 else None
        facts = {"--tp": mesh.tp, "--pp": mesh.pp, "--pp-split": split, "--dp": mesh.dp}
    return facts | {"--split": weights_text(weights)}


def check_mesh_flags(
    tp: int | None,
    pp: int | None,
    pp_split: str | None,
    group: mx.distributed.Group,
    dp: int | None = None,
    split: Any = None,
) -> None:
    """Raise `AgreementError` on every rank unless all ranks were given the same mesh:
    --tp and --pp as resolved against the world (`--tp 2` and no flag are the same on
    2 ranks), --pp-split and --split (as given). Collective (one small
    all_gather_object): every rank calls it before any mesh is made. A mesh that cannot
    run is left to `make_mesh` to refuse."""
    if group.size() == 1:
        return
    from ..parallel.mesh import MeshError, mesh_shape

    given = split if split is None or isinstance(split, str) else ":".join(f"{w:g}" for w in split)
    try:
        T, P = mesh_shape(group.size(), tp, pp, dp)
        stages = (pp_split or "balanced") if P > 1 else None
        mine = {"--tp": T, "--pp": P, "--pp-split": stages, "--dp": dp or 1}
    except MeshError:  # compared as given; the same flags fail alike on every rank
        mine = {"--tp": tp, "--pp": pp, "--pp-split": pp_split, "--dp": dp}
    mine["--split"] = given or "balanced"
    flags = all_gather_object(mine, group)
    if any(f != flags[0] for f in flags):
        raise AgreementError(f"ranks disagree on {FACTS['mesh']} ({_config_difference(flags)})")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} has"
    return f"ranks {', '.join(map(str, ranks))} have"


def _config_difference(configs: list[dict]) -> str:
    """The first config field that differs, and each rank's value of it."""
    keys = list(configs[0]) + [k for c in configs[1:] for k in c if k not in configs[0]]
    for k in keys:
        values = [c.get(k) for c in configs]
        if any(v != values[0] for v in values):
            return f"{k}: {describe([json.dumps(v) for v in values])}"
    return "?"


def describe(values: list[Any]) -> str:
    """'ranks 0, 2 have A, rank 1 has B' for each rank's value (grouped, in rank order)."""
    groups: dict[str, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(str(v), []).append(rank)
    return ", ".join(f"{_ranks(ranks)} {v}" for v, ranks in groups.items())


def disagreement(facts: list[dict[str, Any]]) -> str | None:
    """The message for the first fact the ranks disagree on, or None if they all agree."""
    for key, words in FACTS.items():
        values = [f.get(key) for f in facts]
        if all(v == values[0] for v in values):
            continue
        if key in ("config", "mesh"):
            return f"ranks disagree on {words} ({_config_difference(values)})"
        message = f"ranks disagree on {words}: {describe(values)}"
        if key in ("weights", "tokenizer", "plan"):
            paths = [f.get("path") for f in facts]
            if any(p != paths[0] for p in paths):
                message += " (" + ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths)) + ")"
            else:
                message += f" ({paths[0]})"
        return message
    return None


def check_agreement(
    model: nn.Module, ckpt: Any, tokenizer: Any, group: mx.distributed.Group | None = None
) -> None:
    """Raise `AgreementError` on every rank unless all ranks run the same model and versions.

    Collective: every rank must call it at the same point (after loading).
    One `all_gather_object` of a few hundred bytes per rank.
    """
    group = group or world()
    if group.size() == 1:
        return
    try:
        mine: dict[str, Any] = local_facts(model, ckpt, tokenizer, group)
        error = None
    except Exception as e:  # e.g. a weight file that cannot be read: tell the others
        mine, error = {"error": first_line(e)}, e
    facts = all_gather_object(mine, group)
    if error is not None:
        raise error
    failed = [(r, f["error"]) for r, f in enumerate(facts) if "error" in f]
    if failed:
        rank, text = failed[0]
        raise AgreementError(f"rank {rank} could not run the start-up checks: {text}")
    message = disagreement(facts)
    if message is not None:
        raise AgreementError(message)


class TokenDivergenceError(RuntimeError):
    """The ranks generated different tokens (or started from different prompts)."""


class TokenCheck:
    """Cheap proof that every rank generates the same tokens.

    Each rank keeps a running hash of the prompt and of the tokens so far, and
    after the first token, every `every` tokens and at the last one, the ranks
    all-gather it (4 int32 per rank, one tiny collective). Diverged ranks raise
    `TokenDivergenceError` on every rank. The test hook LLAMA_TP_FAULT=diverge:rankR
    makes rank R see each token from the 20th on as another one (tests only).
    """

    MOD = (1 << 61) - 1  # a Mersenne prime: the hash stays below 2**61

    def __init__(self, prompt: list[int], group: mx.distributed.Group, eos: set[int]):
        self.group = group
        self.every = CHECK_EVERY
        self.prompt_hash = self._extend(0, prompt)
        self.hash = 0
        self.diverge_at = 0
        fault = os.environ.get("LLAMA_TP_FAULT", "")
        if fault == f"diverge:rank{group.rank()}":
            self.diverge_at, self.eos = 20, eos

    @classmethod
    def _extend(cls, h: int, tokens: list[int]) -> int:
        for t in tokens:
            h = (h * 1_000_003 + t + 1) % cls.MOD
        return h

    def fault(self, n: int, token: int) -> int:
        if self.diverge_at and n >= self.diverge_at and token not in self.eos:
            token += 1
            while token in self.eos:  # diverge, but end where the other ranks end
                token += 1
        return token

    def add(self, n: int, token: int, final: bool) -> None:
        self.hash = (self.hash * 1_000_003 + token + 1) % self.MOD
        if self.group.size() > 1 and (n == 1 or n % self.every == 0 or final):
            self.compare(n)

    def compare(self, n: int) -> None:
        mine = [h >> s & 0x7FFFFFFF for h in (self.prompt_hash, self.hash) for s in (0, 31)]
        rows = mx.distributed.all_gather(
            mx.array(mine, dtype=mx.int32), group=self.group, stream=mx.cpu
        ).tolist()
        ranks = [tuple(rows[4 * r : 4 * r + 4]) for r in range(self.group.size())]
        prompts = [r[:2] for r in ranks]
        if any(p != prompts[0] for p in prompts):
            raise TokenDivergenceError(
                f"ranks started from different prompt tokens: {_odd_ones(prompts)}"
            )
        if any(r != ranks[0] for r in ranks):
            when = f"at token {n}" if n == 1 else f"by token {n} (compared every {self.every})"
            raise TokenDivergenceError(
                f"ranks produced different tokens {when}: {_odd_ones(ranks)}"
            )


def _odd_ones(values: list) -> str:
    """'rank 1 differs from rank 0', 'ranks 1, 3 differ from rank 0' (rank 0 is the reference)."""
    odd = [r for r, v in enumerate(values) if v != values[0]]
    if len(odd) == 1:
        return f"rank {odd[0]} differs from rank 0"
    return f"ranks {', '.join(map(str, odd))} differ from rank 0"
