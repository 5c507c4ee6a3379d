"""How close GGUF files compute to a float64 reference over their exact weights.

    python bench/gguf_fidelity.py FILE.gguf [FILE.gguf ...] [--json out.json]
    LLAMA_TP_KERNELS=mlx python bench/gguf_fidelity.py ...   # MLX's path (converted)

For each file: the chat-templated prompt "What is the capital of France?" through the
model as llama_tp loads it (prefill and three cached steps), the largest top-5
log-probability gap in nats against tests/reference64.py (float64 over gguf-py's
dequantization of the same bytes), the greedy answer (32 tokens), the load's peak
memory against the file size, and which path computed it. One JSON line per file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = "What is the capital of France?"


def measure(path: str) -> dict:
    import reference64
    from mp_check_logits import logits_of

    from llama_tp import kernels
    from llama_tp.checkpoints.tokenizer import encode_prompt, load_tokenizer
    from llama_tp.engine.generation import stream_generate
    from llama_tp.engine.loader import load_model

    model, ckpt = load_model(path)
    tokenizer = load_tokenizer(ckpt)
    ids = encode_prompt(tokenizer, PROMPT)
    got = logits_of(model, mx.array([ids], mx.int32))
    ref = reference64.logits(path, ids)
    answer = "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=32))
    return {
        "file": Path(path).name,
        "path": kernels.status().describe()
        if ckpt.blocks
        else "MLX's quantized_matmul (converted)",
        "top5_gap_nats": reference64.top5_gap(got, ref),
        "greedy_same_as_reference": bool((got.argmax(-1) == ref.argmax(-1)).all()),
        "answer": answer,
        "paris": "Paris" in answer,
        "peak_memory": ckpt.load_stats["peak_memory"],
        "file_size": Path(path).stat().st_size,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--json", help="also write the list of results here")
    args = p.parse_args()
    rows = []
    for f in args.files:
        rows.append(measure(f))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
