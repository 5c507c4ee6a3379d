"""Every mlx-lm architecture of tests/generic_models.py through llama_tp, in one process
or one launch, one JSON line per architecture on rank 0's stdout.

    python tests/mp_generic.py write ROOT TOKENIZER_DIR [I/K]
        writes each architecture's folder under ROOT (every K-th from the I-th) and prints
        mlx-lm's greedy tokens and llama_tp's on one process: {"name", "mlx_lm", "tokens",
        "error"}
    python -m llama_tp.launch -n N -- python tests/mp_generic.py run ROOT FLAG N NAMES ...
        FLAG N NAMES (comma-separated) repeated: loads each folder split that way (--pp N,
        --tp N, --mesh N: --tp 2 --pp N/2) and generates the first half of the tokens;
        prints {"name", "flag", "tokens", "error", "errors" (each rank's), "ranks": [(bytes
        read, layers run, bytes held) per rank], "how", "by_mlx_lm"}

Generation is the engine's (`stream_generate`, greedy, no end of sequence), so the tokens
are what `python -m llama_tp.generate` prints.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
from generic_models import (  # noqa: E402
    NEW_TOKENS,
    PROMPT,
    mlx_lm_greedy,
    own_keys,
    runnable,
    write_model,
)

from llama_tp.checkpoints.tokenizer import load_tokenizer  # noqa: E402
from llama_tp.cluster.distributed import all_gather_object, first_line, world  # noqa: E402
from llama_tp.engine.generation import stream_generate  # noqa: E402
from llama_tp.loading.loader import load_model  # noqa: E402

_TOKENIZERS: dict[bytes, object] = {}  # every folder has the same tokenizer's files


def _tokenizer(ckpt):
    key = b"".join(f.read_bytes() for f in sorted(Path(ckpt.path).glob("tokenizer*")))
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_tokenizer(ckpt)
    return _TOKENIZERS[key]


def ours(path: Path, group, n: int = NEW_TOKENS, **mesh) -> tuple[list[int], dict]:
    model, ckpt = load_model(path, group, **mesh)
    tokenizer = _tokenizer(ckpt)
    tokens = [
        r.token
        for r in stream_generate(
            model, tokenizer, PROMPT, max_tokens=n, eos_token_ids=set(), group=group
        )
    ]
    layers = getattr(model, "stage_layers", None)
    if layers is None and hasattr(model, "first_layer"):  # a native pipeline stage
        layers = range(model.first_layer, model.first_layer + len(model.layers))
    if layers is None:
        layers = range(len(model.layers))
    mine = (
        ckpt.load_stats["bytes_read"],
        [layers.start, layers.stop],
        ckpt.load_stats["bytes_held"],
    )
    how = getattr(model, "split_by", None)
    if how is None and mesh.get("tp") and group.size() > 1 and ckpt.route is None:
        how = "the native plan"
    return tokens, {
        "ranks": all_gather_object(mine, group),
        "how": how,
        "by_mlx_lm": getattr(model, "pipelined_by_mlx_lm", False),
    }


def _failed(row: dict, e: Exception) -> None:
    row["error"] = first_line(e) or type(e).__name__
    row["trace"] = traceback.format_exc(limit=-3)


def write(root: Path, tokenizer: Path, part: str) -> None:
    i, k = map(int, part.split("/"))
    group = world()
    for name in (runnable() + own_keys())[i::k]:
        row: dict = {"name": name}
        try:
            path = write_model(name, root / name, tokenizer)
            row["mlx_lm"] = mlx_lm_greedy(path)
            row["tokens"], _ = ours(path, group)
        except Exception as e:
            _failed(row, e)
        print(json.dumps(row), flush=True)


def run(root: Path, specs: list[str]) -> None:
    group = world()
    for j in range(0, len(specs), 3):
        flag, n, names = specs[j], int(specs[j + 1]), specs[j + 2].split(",")
        mesh = {"tp": 2, "pp": n // 2} if flag == "--mesh" else {flag.lstrip("-"): n}
        # the first half of the tokens: a prefill past the window of 8 and 3 cached steps
        # across the cut tell enough (each token is a round of collectives per rank; the
        # one-process run compares all of them with mlx-lm's)
        count = NEW_TOKENS // 2
        for name in names:
            row: dict = {"name": name, "flag": flag}
            try:
                row["tokens"], extra = ours(root / name, group, count, **mesh)
                row |= extra
            except Exception as e:
                _failed(row, e)
            # every rank's own line (gathered: the ranks' prints would interleave)
            row["errors"] = all_gather_object(row.get("error"), group)
            if group.rank() == 0:
                print(json.dumps(row), flush=True)
            mx.clear_cache()


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "write":
        write(root, Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "0/1")
    else:
        run(root, sys.argv[3:])


if __name__ == "__main__":
    main()
