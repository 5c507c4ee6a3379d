"""Pre-split checkpoints: one folder per rank holding exactly that rank's slices.

    DIR/manifest.json        what was split, for how many ranks, and each folder's size
    DIR/rank-0/shard.json    model config, shard count, this folder's rank, quantization
    DIR/rank-0/model.safetensors   rank 0's slices (by the model's names, sharded shapes)
    DIR/rank-0/tokenizer.json ...  the tokenizer, so that a folder works on its own

`python -m llama_tp.convert --shards N` writes it; under `mlx.launch -n N`,
`load(DIR)` makes each rank open only `DIR/rank-<its rank>`, so a folder can be
copied alone to the host that runs that rank.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..model import ModelArgs
from ..parallel.partition import Plan, tensor_slice
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


def _wrong_count(path: Path, shards: int, size: int) -> CheckpointError:
    return CheckpointError(
        f"{path} is split for {shards} rank{'s' * (shards != 1)} but {size} "
        f"rank{'s' * (size != 1)} {'are' if size != 1 else 'is'} running: launch {shards} "
        f"ranks, or convert again with --shards {size}"
    )


def rank_dir(path: Path, rank: int, size: int) -> Path:
    """The folder that rank `rank` of `size` reads: `path/rank-<rank>` (or `path` itself)."""
    if (path / SHARD_CONFIG).is_file():
        return path
    if (path / MANIFEST).is_file():
        shards = _json(path / MANIFEST).get("shards")
        if shards != size:
            raise _wrong_count(path, shards, size)
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
        raise _wrong_count(folder, config.get("shards"), size)
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


def write(
    out: Path,
    args: ModelArgs,
    get: Callable[[str, tuple[int, int, int] | None], mx.array],
    shapes: dict[str, tuple[int, ...]],
    plan: Plan,
    vocab: list[range] | None,
    config: dict[str, Any],
    write_weights: Callable[[dict[str, mx.array], Path], tuple[int, list[str]]],
    save_tokenizer: Callable[[Path], None],
) -> dict[str, Any]:
    """Write one folder per rank of `plan` and the manifest; returns the manifest.

    `get(name, slice)` returns a tensor or its (axis, start, stop) slice;
    `shapes` are the full stored shapes; `vocab` the vocabulary rows of each rank
    (None: embedding and head whole on every rank). `config` is stored in every
    `shard.json` (quantization, token ids, fingerprint); `write_weights` writes a
    dict of tensors into a folder and returns (bytes, file names).
    """
    ranks = []
    for part in plan.parts:
        folder = out / f"rank-{part.rank}"
        folder.mkdir(parents=True, exist_ok=True)
        rows = None if vocab is None else vocab[part.rank]
        tensors = {
            name: get(name, tensor_slice(plan, part, name, shape, rows) if plan.n > 1 else None)
            for name, shape in shapes.items()
        }
        nbytes, files = write_weights(tensors, folder)
        shard = {
            "format": FORMAT,
            "version": 1,
            "shards": plan.n,
            "rank": part.rank,
            "vocab_parallel": vocab is not None,
            "args": args.to_dict(),
            "files": files,
            **config,
        }
        (folder / SHARD_CONFIG).write_text(json.dumps(shard, indent=2) + "\n")
        save_tokenizer(folder)
        ranks.append({"folder": folder.name, "bytes": nbytes, "files": files})
    manifest = {
        "format": FORMAT,
        "version": 1,
        "shards": plan.n,
        "vocab_parallel": vocab is not None,
        "fingerprint": (config.get("llama_tp") or {}).get("fingerprint"),
        "ranks": ranks,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
