"""Every mlx-lm architecture of tests/generic_models.py through llama_tp, in one process
or one launch, one JSON line per architecture on rank 0's stdout.

    python tests/mp_generic.py write ROOT TOKENIZER_DIR
        writes each architecture's folder under ROOT and prints mlx-lm's greedy tokens
        and llama_tp's on one process: {"name", "mlx_lm", "tokens", "error"}
    python -m llama_tp.launch -n N -- python tests/mp_generic.py run ROOT --pp N [NAME...]
    python -m llama_tp.launch -n N -- python tests/mp_generic.py run ROOT --tp N [NAME...]
    python -m llama_tp.launch -n 4 -- python tests/mp_generic.py run ROOT --mesh 4 NAME...
        loads each folder split that way (--mesh N: --tp 2 --pp N/2; by tensor: the
        first half of the tokens) and
        prints {"name", "tokens", "error", "ranks": [(bytes read, layers run, bytes held)
        per rank], "how", "by_mlx_lm"}

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
from generic_models import NEW_TOKENS, PROMPT, mlx_lm_greedy, runnable, write_model  # noqa: E402

from llama_tp.checkpoints.tokenizer import load_tokenizer  # noqa: E402
from llama_tp.cluster.distributed import all_gather_object, first_line, world  # noqa: E402
from llama_tp.engine.generation import stream_generate  # noqa: E402
from llama_tp.engine.loader import load_model  # noqa: E402


def ours(path: Path, group, n: int = NEW_TOKENS, **mesh) -> tuple[list[int], dict]:
    model, ckpt = load_model(path, group, **mesh)
    tokenizer = load_tokenizer(ckpt)
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


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    group = world()
    if mode == "write":
        tokenizer = Path(sys.argv[3])
        for name in runnable():
            row = {"name": name}
            try:
                path = write_model(name, root / name, tokenizer)
                row["mlx_lm"] = mlx_lm_greedy(path)
                row["tokens"], _ = ours(path, group)
            except Exception as e:
                row["error"] = first_line(e) or type(e).__name__
                row["trace"] = traceback.format_exc(limit=-3)
            print(json.dumps(row), flush=True)
        return
    flag, n = sys.argv[3], int(sys.argv[4])
    mesh = {"tp": 2, "pp": n // 2} if flag == "--mesh" else {flag.lstrip("-"): n}
    names = sys.argv[5:] or [p.name for p in sorted(root.iterdir()) if p.is_dir()]
    # by tensor: every layer all-reduces twice per token; the first tokens tell enough
    count = NEW_TOKENS // 2 if flag in ("--tp", "--mesh") else NEW_TOKENS
    for name in names:
        row = {"name": name}
        try:
            row["tokens"], extra = ours(root / name, group, count, **mesh)
            row |= extra
        except Exception as e:
            row["error"] = first_line(e) or type(e).__name__
            row["trace"] = traceback.format_exc(limit=-3)
        if group.rank() == 0:
            print(json.dumps(row), flush=True)
        elif "error" in row:  # every rank's own trace, for the test's failure message
            print(f"rank {group.rank()}: {name}: {row.get('trace')}", file=sys.stderr, flush=True)
        mx.clear_cache()


if __name__ == "__main__":
    main()
