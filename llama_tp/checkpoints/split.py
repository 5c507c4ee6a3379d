"""Pre-split checkpoints: one folder per rank holding exactly that rank's slices.

    DIR/manifest.json        what was split, for how many ranks (and which mesh), folder sizes
    DIR/rank-0/shard.json    model config, shard count, this folder's rank, quantization
    DIR/rank-0/model.safetensors   rank 0's slices (by the model's names, sharded shapes)
    DIR/rank-0/tokenizer.json ...  the tokenizer, so that a folder works on its own

`python -m llama_tp.convert --shards N` writes it; under `mlx.launch -n N`,
`load(DIR)` makes each rank open only `DIR/rank-<its rank>`, so a folder can be
copied alone to the host that runs that rank.

`--shards N --tp T --pp P` splits for a tp x pp mesh instead (`loading/mesh_split.py`):
folder r then holds what world rank r of that mesh loads, its stage's layers (under
their global names, `layers.12....`) sliced for its tensor rank, with the embedding
on stage 0 and the norm and head on the last stage. Its `shard.json` and the manifest
record the mesh: `"mesh": {"tp", "pp", "stages", "split", "pp_split"}` (and the
folder's own "stage", "tp_rank", "layers"). "stages" are the world ranks of each
stage as `parallel.mesh.layout` places them in rank order (the placement on one
host); `check_mesh` refuses a folder made for another mesh, split or placement.

`--shards N --split 3:1` cuts every tensor group by those weights: `shard.json` and the
manifest record them (`"split": [3.0, 1.0]`; null: balanced), loading takes them, and
`check_split` refuses a folder run with another `--split` (or `--split memory`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..model_args import ModelArgs
from ..parallel.mesh import parse_split
from ..parallel.placement import Placement
from ..parallel.shares import MEMORY, SplitSpec, Weights, same_split, weights_text
from ..parallel.shares import parse_split as parse_weights
from .base import Checkpoint, CheckpointError
from .safetensors import SafetensorsFile

MANIFEST = "manifest.json"
SHARD_CONFIG = "shard.json"
FORMAT = "llama_tp-split"
_RANK_DIR = re.compile(r"^rank-(\d+)$")


def is_split(path: Path) -> bool:
    """A pre-split root (manifest or rank-N folders) or one rank's folder."""
    if not path.is_dir() or (path / "config.json").is_file():
        return False
    if (path / MANIFEST).is_file() or (path / SHARD_CONFIG).is_file():
        return True
    return any(_RANK_DIR.match(d.name) for d in path.iterdir() if d.is_dir())


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a llama_tp split description")
    return data


def _wrong_count(
    path: Path, shards: int, size: int, mesh: dict[str, Any] | None
) -> CheckpointError:
    made, launch = "", f"launch {shards} ranks"
    if mesh:
        made = f" (--tp {mesh.get('tp')} x --pp {mesh.get('pp')})"
        launch += f" with --tp {mesh.get('tp')} --pp {mesh.get('pp')}"
    return CheckpointError(
        f"{path} is split for {shards} rank{'s' * (shards != 1)}{made} but {size} "
        f"rank{'s' * (size != 1)} {'are' if size != 1 else 'is'} running: {launch}, "
        f"or convert again with --shards {size}"
    )


def rank_dir(path: Path, rank: int, size: int) -> Path:
    """The folder that rank `rank` of `size` reads: `path/rank-<rank>` (or `path` itself)."""
    if (path / SHARD_CONFIG).is_file():
        return path
    if (path / MANIFEST).is_file():
        manifest = _json(path / MANIFEST)
        if manifest.get("shards") != size:
            raise _wrong_count(path, manifest.get("shards"), size, manifest.get("mesh"))
    folder = path / f"rank-{rank}"
    if not folder.is_dir():
        present = sorted(d.name for d in path.iterdir() if _RANK_DIR.match(d.name))
        raise CheckpointError(
            f"{folder}: missing: rank {rank} of {size} reads this folder "
            f"(found here: {', '.join(present) or 'no rank folders'}); copy it from the "
            f"converted checkpoint, e.g. rsync -a SRC/rank-{rank} HOST:{path}/"
        )
    return folder


def read(folder: Path, rank: int, size: int) -> Checkpoint:
    """The checkpoint of one rank's folder; its shard count and rank must match."""
    config = _json(folder / SHARD_CONFIG)
    if config.get("shards") != size:
        raise _wrong_count(folder, config.get("shards"), size, config.get("mesh"))
    if config.get("rank") != rank:
        raise CheckpointError(
            f"{folder} holds rank {config.get('rank')}'s slices but this is rank {rank}"
        )
    try:
        args = ModelArgs.from_dict(config["args"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{folder / SHARD_CONFIG}: bad model config ({e})") from None
    files = [folder / name for name in config.get("files", [])]
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise CheckpointError(f"{folder}: missing weight files {', '.join(missing) or '(none)'}")
    weights, sources = {}, {}
    for f in files:
        header = SafetensorsFile(f)  # a truncated file fails here, with the numbers
        try:
            weights.update(mx.load(str(f)))
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
        sources.update({name: (header, name) for name in header.tensors})
    return Checkpoint(folder, "split", args, weights, config, files, sources)


def _root(path: Path) -> Path:
    """The converted folder that `path` (a rank's folder, or the folder itself) belongs to."""
    return path.parent if _RANK_DIR.match(path.name) else path


def _stages_text(stages: list[list[int]]) -> str:
    return " | ".join(",".join(map(str, ranks)) for ranks in stages)


def check_mesh(
    ckpt: Checkpoint,
    tp: int,
    pp: int,
    pp_split: str | None = None,
    stages: list[list[int]] | None = None,
) -> list[range] | None:
    """Each stage's layers of a folder split for the running mesh `tp` x `pp` (None
    when `pp` is 1, plain tensor parallelism). Raises CheckpointError, one line naming
    what the folder was made for, what is running and how to fix it, when the folder
    was split for another mesh, into other stages than `--pp-split` (None: the
    folder's own split is used, balanced or not) or for other ranks in each stage
    than the running mesh's `stages` (world ranks, in tensor-rank order)."""
    root, config = _root(ckpt.path), ckpt.metadata
    mesh = config.get("mesh")
    try:
        T, P = (int(mesh["tp"]), int(mesh["pp"])) if mesh else (int(config["shards"]), 1)
        counts = [int(c) for c in mesh["split"]] if mesh else [ckpt.args.n_layers]
        made_stages = [[int(r) for r in ranks] for ranks in mesh["stages"]] if mesh else None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt.path / SHARD_CONFIG}: bad mesh record ({e!r})") from None
    if (T, P) != (tp, pp):
        fix = "without --pp" if P == 1 else f"with --tp {T} --pp {P}"
        again = f"--shards {T * P}" + (f" --tp {tp} --pp {pp}" if pp > 1 else "")
        raise CheckpointError(
            f"{root} is split for --tp {T} x --pp {P} but --tp {tp} x --pp {pp} is running: "
            f"run it {fix}, or convert again with {again}"
        )
    if P == 1:
        return None
    made = ",".join(map(str, counts))
    if len(counts) != P or sum(counts) != ckpt.args.n_layers or min(counts) < 1:
        raise CheckpointError(
            f"{ckpt.path / SHARD_CONFIG}: bad mesh record (stages of {made} layers, "
            f"{P} stages of a {ckpt.args.n_layers}-layer model)"
        )
    layers = parse_split(made, ckpt.args.n_layers, P)
    if pp_split is not None and not _same_stages(pp_split, mesh.get("pp_split"), layers, P):
        raise CheckpointError(
            f"{root} is split into stages of {made} layers but --pp-split {pp_split} is "
            f"given: run it without --pp-split (or with --pp-split {made}), or convert "
            f"again with --shards {T * P} --tp {T} --pp {P} --pp-split {pp_split}"
        )
    if stages is not None and [list(r) for r in stages] != made_stages:
        raise CheckpointError(
            f"{root} is split for the stages {_stages_text(made_stages)} (world ranks in "
            f"rank order) but this mesh places them on {_stages_text(stages)} (ranks "
            "grouped by host): launch with LLAMA_TP_MESH_ORDER=rank, or list each host's "
            "ranks together in the hostfile"
        )
    return layers


def check_split(ckpt: Checkpoint, split: SplitSpec, weights: Weights | None) -> Weights | None:
    """The weights a pre-split folder was cut with (its "split" record; None: balanced).
    `split` is the running --split as given (None: take the folder's), `weights` it
    resolved; CheckpointError, one line, when they differ from the folder's (and for
    `--split memory`: the folders fix each rank's share)."""
    made = ckpt.metadata.get("split")
    made = tuple(float(w) for w in made) if made else None
    if split is None or (split != MEMORY and same_split(made, weights)):
        return made
    ours = "evenly" if made is None else weights_text(made)
    shards = f"--shards {ckpt.metadata.get('shards')}"
    if split == MEMORY:
        asked, again = "--split memory", f"{shards} --split W:W (doctor suggests the weights)"
    else:
        asked = again = f"--split {weights_text(weights)}"
        again = f"{shards} {asked}" if weights else shards
    keep = "" if made is None else f" (or with --split {ours})"
    raise CheckpointError(
        f"{_root(ckpt.path)} is split {ours} but {asked} is given: run it without "
        f"--split{keep}, or convert again with {again}"
    )


def _same_stages(pp_split: str, recorded: str | None, layers: list[range], pp: int) -> bool:
    """Whether `--pp-split` (layer counts, or weights like 3:1) names the stages a folder
    was made with (`layers`; weights: the same weights as its recorded --pp-split)."""
    if ":" not in pp_split:
        return parse_split(pp_split, sum(len(r) for r in layers), pp) == layers
    mine = parse_weights(pp_split, pp, "--pp-split")
    return bool(recorded and ":" in recorded) and same_split(
        mine, parse_weights(recorded, pp, "--pp-split")
    )


def split_vocab_parallel(ckpt: Checkpoint, vocab_parallel: bool, n: int) -> bool:
    """Whether a pre-split folder's embedding and head are vocabulary-parallel (over its
    `n`-rank tensor group); refuses a vocabulary-parallel folder with `vocab_parallel` off."""
    split = ckpt.metadata
    if split["vocab_parallel"] and not vocab_parallel and n > 1:
        raise CheckpointError(
            f"{ckpt.path} was split with a vocabulary-parallel embedding and head; "
            "convert with --no-vocab-parallel to keep them whole on every rank"
        )
    return bool(split["vocab_parallel"])


@dataclass
class Folder:
    """One rank's folder to write: its tensors (made on demand, one folder at a time),
    extra `shard.json` fields and extra fields of its manifest entry."""

    rank: int
    tensors: Callable[[], dict[str, mx.array]]
    shard: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


def placement_folders(
    placement: Placement, get: Callable[[str, tuple[int, int, int] | None], mx.array]
) -> list[Folder]:
    """The folders of plain tensor parallelism: each rank's placement's slices of every
    tensor. `get(name, slice)` returns a tensor or its (axis, start, stop) slice."""

    def tensors(r) -> dict[str, mx.array]:
        return {name: get(name, s) for name, s in r.slices.items()}

    return [Folder(r.rank, lambda r=r: tensors(r)) for r in placement.ranks]


def write(
    out: Path,
    args: ModelArgs,
    folders: list[Folder],
    vocab_parallel: bool,
    config: dict[str, Any],
    write_weights: Callable[[dict[str, mx.array], Path], tuple[int, list[str]]],
    save_tokenizer: Callable[[Path], None],
    mesh: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write one folder per entry of `folders` and the manifest; returns the manifest.

    `config` is stored in every `shard.json` (quantization, token ids, fingerprint);
    `write_weights` writes a dict of tensors into a folder and returns (bytes, file
    names); `mesh` (tp x pp splits) goes into the manifest and every `shard.json`.
    """
    ranks = []
    for f in folders:
        folder = out / f"rank-{f.rank}"
        folder.mkdir(parents=True, exist_ok=True)
        nbytes, files = write_weights(f.tensors(), folder)
        shard = {
            "format": FORMAT,
            "version": 1,
            "shards": len(folders),
            "rank": f.rank,
            "vocab_parallel": vocab_parallel,
            "args": args.to_dict(),
            "files": files,
            **({"mesh": {**mesh, **f.shard}} if mesh else {}),
            **config,
        }
        (folder / SHARD_CONFIG).write_text(json.dumps(shard, indent=2) + "\n")
        save_tokenizer(folder)
        ranks.append({"folder": folder.name, **f.summary, "bytes": nbytes, "files": files})
    manifest = {
        "format": FORMAT,
        "version": 1,
        "shards": len(folders),
        **({"mesh": mesh} if mesh else {}),
        "vocab_parallel": vocab_parallel,
        "split": config.get("split"),  # --split weights of each tensor rank (None: balanced)
        "fingerprint": (config.get("llama_tp") or {}).get("fingerprint"),
        "ranks": ranks,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
