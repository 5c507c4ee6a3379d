"""`convert --shards N` of a model on mlx-lm's classes: one folder per rank, by stage.

    DIR/stages.json              what was split: the mesh (tp, pp), each stage's layers,
                                 the source's weight fingerprint
    DIR/rank-0/config.json ...   the model's config and tokenizer files
    DIR/rank-0/model.safetensors exactly what rank 0 holds (its stage's layers, the
                                 embedding or head where its stage holds them, its tensor
                                 part), by the model's names, as mlx-lm writes folders

Each folder is made as the loader makes that rank's part (`loader.split_rank` with
stand-in groups, then `reads.read_*`), so loading `DIR` on the same mesh reads, in each
rank's own folder, exactly what the rank would have read from the whole checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..checkpoints.base import CheckpointError
from ..checkpoints.fingerprint import digest, file_fingerprint
from .loader import Opened, split_rank
from .plan import StandInGroup
from .reads import held, read_direct, read_sanitized

MANIFEST = "stages.json"
FORMAT = "llama_tp-stages"


def is_stage_split(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / MANIFEST}: cannot read ({e})") from None
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST}: not a llama_tp stage split")
    return data


def rank_folder(path: Path, tp: int, pp: int, rank: int) -> tuple[Path, str, str, dict]:
    """(rank `rank`'s folder, the recorded --pp-split, the source fingerprint, the whole
    checkpoint's tensor shapes) of the split at `path`; CheckpointError (one line) when it
    was split for another mesh."""
    m = manifest(path)
    if (m["tp"], m["pp"]) != (tp, pp):
        raise CheckpointError(
            f"{path} is split for --tp {m['tp']} x --pp {m['pp']} ({m['tp'] * m['pp']} ranks), "
            f"but --tp {tp} x --pp {pp} is running: run it with --tp {m['tp']} --pp {m['pp']}"
        )
    return path / f"rank-{rank}", m["pp_split"], m["fingerprint"], m["tensors"]


def convert_stages(
    src: Path, out: Path, pp: int, pp_split: str | None = None, progress: bool = True
) -> dict[str, Any]:
    """Write the folders of `pp` pipeline stages (one rank each) of the mlx-lm model at `src`
    into `out`. (By stage only: a tensor part's stored shapes would hide the quantization
    mlx-lm infers from them.)"""
    tp = 1
    first = Opened(src)
    fingerprint = digest([b for f in first.files for b in file_fingerprint(f)])
    counts = None
    for rank in range(tp * pp):
        stage, t = divmod(rank, tp)
        opened = first if rank == 0 else Opened(src)
        placed = split_rank(
            opened, tp, pp, stage, StandInGroup(tp, t), StandInGroup(pp, stage), pp_split,
            pp_is_world=tp == 1,
        )  # fmt: skip
        counts = counts or ",".join(str(len(r)) for r in placed.stages)
        want = held(placed.model)
        sanitize = getattr(placed.model, "sanitize", None) or (lambda w: w)
        if opened.direct:
            items = read_direct(
                opened.stored, want, placed.splits, sanitize, lambda n: None, opened.shapes
            )
        else:
            items = read_sanitized(
                opened.stored, want, placed.splits, opened.structure, placed.layers, sanitize,
                lambda n: None, opened.shapes,
            )  # fmt: skip
        folder = out / f"rank-{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():  # the config and tokenizer files, as they are
            if f.is_file() and not f.name.endswith(".safetensors") and "safetensors" not in f.name:
                shutil.copy(f, folder / f.name)
        mx.save_safetensors(str(folder / "model.safetensors"), dict(items), {"format": "mlx"})
        if progress:
            print(f"wrote {folder} ({len(items)} tensors)", flush=True)
    record = {
        "format": FORMAT, "tp": tp, "pp": pp, "pp_split": counts, "fingerprint": fingerprint,
        # every tensor of the source: what mlx-lm's sanitize and quantization rule see
        "tensors": {k: [list(shape), dtype] for k, (shape, dtype) in first.shapes.items()},
    }  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
    return record
