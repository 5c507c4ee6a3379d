"""How close GGUF files compute to a float64 reference over their exact weights.

    python bench/gguf_fidelity.py FILE.gguf [FILE.gguf ...] [--json out.json]
    LLAMA_TP_KERNELS=mlx python bench/gguf_fidelity.py ...   # MLX's path (converted)
    python bench/gguf_fidelity.py --llama-cpp FILE.gguf   # + llama.cpp's greedy answer

For each file: the chat-templated prompt "What is the capital of France?" through the
model as llama_tp loads it (prefill and three cached steps), the largest top-5
log-probability gap in nats against tests/reference64.py (float64 over gguf-py's
dequantization of the same bytes), the greedy answer (32 tokens), the load's peak
memory against the file size, and which path computed it. One JSON line per file.
With --llama-cpp, also llama.cpp's greedy answer (llama-cpp-python, 1 thread) to the
same prompt tokens.
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


def llama_cpp_answer(path: str, ids: list[int], max_tokens: int = 32) -> str:
    """llama.cpp's greedy continuation of the prompt tokens `ids`, decoded."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(path, n_threads=1, n_ctx=512, logits_all=True, verbose=False)
    llm.eval(ids)
    out: list[int] = []
    for _ in range(max_tokens):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if t == llm.token_eos():
            break
        out.append(t)
        llm.eval([t])
    return llm.detokenize(out).decode("utf-8", errors="replace")


def measure(path: str, llama_cpp: bool = False) -> dict:
    import reference64
    from mp_check_logits import logits_of

    from llama_tp import kernels
    from llama_tp.checkpoints.tokenizer import encode_prompt, load_tokenizer
    from llama_tp.engine.generation import stream_generate
    from llama_tp.loading.loader import load_model

    model, ckpt = load_model(path)
    tokenizer = load_tokenizer(ckpt)
    ids = encode_prompt(tokenizer, PROMPT)
    got = logits_of(model, mx.array([ids], mx.int32))
    ref = reference64.logits(path, ids)
    answer = "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=32))
    res = {
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
    if llama_cpp:
        res["llama_cpp_answer"] = llama_cpp_answer(path, ids)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--json", help="also write the list of results here")
    p.add_argument("--llama-cpp", action="store_true", help="also llama.cpp's greedy answer")
    args = p.parse_args()
    rows = []
    for f in args.files:
        rows.append(measure(f, args.llama_cpp))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
