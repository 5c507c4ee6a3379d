"""GGUF loading and conversion: bytes read and peak memory per rank.

    .venv/bin/python bench/gguf_memory.py   # its section of docs/benchmarks.md, "Loading"

Writes synthetic GGUF files of the 0.5B shape used by `bench/load_memory.py` (hidden
2048, 8 layers, 16 query / 8 KV heads, FFN 5632, vocabulary 32000) with random valid
blocks: all Q4_0, and a Q4_K_M-like mix (Q4_K, with Q6_K attn_v, ffn_down and output).
Loads each on 1, 2 and 4 ranks (`mlx.launch`), recording per rank the bytes read (the
loader's count), MLX's peak memory and the file's share. Then converts a ~1.3 GB
Q8_0 file (24 layers) with `llama_tp.convert` in a child process and records its
peak resident set and MLX peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from llama_tp.benchmarks.sections import PAGE, replace_section

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

SHAPE = dict(dim=2048, hidden=5632, vocab=32000, heads=16, kv_heads=8)


def write_synthetic(path: Path, types: dict[str, int], layers: int) -> Path:
    """A random-weight GGUF of SHAPE with `types` (generic names, see gguf_writer)."""
    from gguf_writer import F32, llama_vocabulary, random_blocks, write_gguf

    if path.is_file():
        return path
    d, h, v = SHAPE["dim"], SHAPE["hidden"], SHAPE["vocab"]
    kv = d // SHAPE["heads"] * SHAPE["kv_heads"]
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": d,
        "llama.block_count": layers,
        "llama.feed_forward_length": h,
        "llama.attention.head_count": SHAPE["heads"],
        "llama.attention.head_count_kv": SHAPE["kv_heads"],
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 2048,
        **llama_vocabulary(v),  # convert writes a tokenizer
    }
    shapes = {"token_embd.weight": (v, d), "output_norm.weight": (d,), "output.weight": (v, d)}
    per_layer = {
        "attn_norm.weight": (d,),
        "ffn_norm.weight": (d,),
        "attn_q.weight": (d, d),
        "attn_k.weight": (kv, d),
        "attn_v.weight": (kv, d),
        "attn_output.weight": (d, d),
        "ffn_gate.weight": (h, d),
        "ffn_up.weight": (h, d),
        "ffn_down.weight": (d, h),
    }
    for i in range(layers):
        shapes.update({f"blk.{i}.{k}": s for k, s in per_layer.items()})
    tensors = {}
    for i, (name, shape) in enumerate(shapes.items()):
        kind = types.get(name.split(".", 2)[-1] if name.startswith("blk.") else name)
        gshape = tuple(reversed(shape))
        if kind is None:
            tensors[name] = (F32, gshape, np.ones(shape, np.float32).tobytes())
        else:
            r, c = shape
            rng = np.random.default_rng(i)
            blocks = lambda k=kind, r=r, c=c, g=rng: random_blocks(k, r, c, g)  # noqa: E731
            tensors[name] = (kind, gshape, blocks)
    write_gguf(path, meta, tensors)
    return path


def run_load(n: int, path: Path, port: int) -> list[dict]:
    from load_memory import run

    return run(n, path, port)


def convert_peak(path: Path, out: Path) -> dict:
    """Convert `path` in a child process: seconds, peak RSS, MLX peak."""
    code = (
        "import json, sys, mlx.core as mx\n"
        "from llama_tp.checkpoints.convert import convert\n"
        "from llama_tp.cluster.memory import max_rss\n"
        f"convert({str(path)!r}, {str(out)!r}, progress=False)\n"
        "print(json.dumps({'max_rss': max_rss(), 'mlx_peak': mx.get_peak_memory()}))\n"
    )
    tic = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    res = json.loads(r.stdout.splitlines()[-1])
    res["seconds"] = time.perf_counter() - tic
    return res


def main() -> int:
    from gguf_writer import Q4_0, Q4_K, Q6_K, Q8_0

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=str(Path.home() / ".cache/llama_tp/gguf_memory"))
    p.add_argument("--out", default=str(PAGE), help="the page whose section to rewrite")
    p.add_argument("--ranks", default="1,2,4")
    args = p.parse_args()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    proj = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    q4_0 = {f"{t}.weight": Q4_0 for t in proj} | {"token_embd.weight": Q4_0, "output.weight": Q4_0}
    kmix = {f"{t}.weight": Q4_K for t in proj} | {"token_embd.weight": Q4_K}
    kmix |= {"attn_v.weight": Q6_K, "ffn_down.weight": Q6_K, "output.weight": Q6_K}
    files = {
        "Q4_0": write_synthetic(base / "0.5b-q4_0.gguf", q4_0, 8),
        "Q4_K_M-like": write_synthetic(base / "0.5b-q4_k_m.gguf", kmix, 8),
    }
    rows, port = [], 47500
    cached = base / "load_rows.json"  # the loads take minutes: kept between runs
    if cached.is_file():
        rows = [tuple(r) for r in json.loads(cached.read_text())]
    for label, path in files.items() if not rows else []:
        size = path.stat().st_size
        for n in map(int, args.ranks.split(",")):
            for rank, s in enumerate(run_load(n, path, port)):
                rows.append((label, size, n, rank, s))
                print(
                    f"{label} n={n} rank {rank}: read {s['bytes_read'] / 1e6:.1f} MB, "
                    f"MLX peak {s['peak_memory'] / 1e6:.1f} MB, file/N {size / n / 1e6:.1f} MB",
                    file=sys.stderr,
                )
            port += 20
        cached.write_text(json.dumps(rows))
    q8 = {f"{t}.weight": Q8_0 for t in proj} | {"token_embd.weight": Q8_0, "output.weight": Q8_0}
    big = write_synthetic(base / "1.3b-q8_0.gguf", q8, 24)
    conv = convert_peak(big, base / "converted")
    conv["size"] = big.stat().st_size
    print(f"convert: {conv}", file=sys.stderr)
    write_section(Path(args.out), rows, conv)
    return 0


def write_section(out: Path, rows: list, conv: dict) -> None:
    def mb(x: float) -> str:
        return f"{x / 1e6:.1f}"

    lines = [
        "### GGUF files",
        "",
        "Regenerate with `.venv/bin/python bench/gguf_memory.py` (about 10 minutes here).",
        "",
        "Synthetic GGUF files of the 0.5B shape above (random valid blocks; norms F32): "
        "*Q4_0* (every matrix Q4_0) and *Q4_K_M-like* (Q4_K, with Q6_K `attn_v`, "
        "`ffn_down` and output). Every rank reads only its slices; MLX holds Q4_0/Q4_K as "
        "4-bit group 32 (5 bits per value with the float16 scale and bias, vs 4.5 in the "
        "file) and Q6_K requantized to 8-bit (9 vs 6.56), so memory exceeds the file's share "
        "by about 11% for Q4_0 and more where Q6_K tensors are. On 4 ranks the K-quant file's "
        "feed-forward splits in whole 256-value blocks, 22 of them: 6/6/5/5, hence the "
        "uneven reads; the Q4_0 file splits in 32-value blocks (176: 44 each).",
        "",
        "| file | file MB | ranks | rank | read MB | file / N MB | read / (file / N) "
        "| MLX peak MB | peak / (file / N) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, size, n, rank, s in rows:
        share = size / n
        lines.append(
            f"| {label} | {mb(size)} | {n} | {rank} | {mb(s['bytes_read'])} | {mb(share)} | "
            f"{s['bytes_read'] / share:.3f} | {mb(s['peak_memory'])} | "
            f"{s['peak_memory'] / share:.3f} |"
        )
    lines += [
        "",
        f"Streaming conversion: `python -m llama_tp.convert --model 1.3b-q8_0.gguf --out DIR` "
        f"of a {mb(conv['size'])} MB Q8_0 file (24 layers of the shape above) took "
        f"{conv['seconds']:.0f} s with a peak resident set of {mb(conv['max_rss'])} MB "
        f"(MLX peak {mb(conv['mlx_peak'])} MB): the largest tensor (the embedding, "
        f"{mb(32000 * 2048 * 9 / 8)} MB as MLX 8-bit) plus the interpreter and libraries, "
        f"{conv['max_rss'] / conv['size']:.2f} of the file.",
        "",
    ]
    print(f"wrote {replace_section('gguf-memory', chr(10).join(lines), out)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
