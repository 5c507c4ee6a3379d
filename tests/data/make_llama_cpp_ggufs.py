"""Write the llama.cpp-quantized GGUF files under tests/data/ (committed; run once).

    python tests/data/make_llama_cpp_ggufs.py --quantize path/to/llama-quantize

A random-weight 1-layer Llama in F32 (dim 512, 4 query / 2 KV heads of 128, FFN 512,
vocabulary 384: every split on 2 ranks falls on a 256-value K-quant block) is written by
the tests' own GGUF writer, then requantized by llama.cpp's `llama-quantize` to its
Q4_K_M, Q5_K_M and Q2_K mixes: the files a user downloads are made the same way, so
the test runs llama.cpp's own block encoder, not ours. Likewise a 1-layer Qwen3-MoE
(`qwen3moe`: dim 256, 4 query / 2 KV heads of 64, 4 experts of 256 columns, 2 per
token) to Q4_K_M: `llamacpp-qwen3moe-Q4_K_M.gguf`. `llama-quantize` comes with
llama.cpp; one way to build it without a clone (the sdist vendors llama.cpp):

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DLLAMA_CURL=OFF
    cmake --build build --target llama-quantize -j   # build/bin/llama-quantize
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: the GGUF writer

from fixtures import moe_config, write_hf_model  # noqa: E402
from gguf_writer import gguf_from_hf, llama_vocabulary, tiny_llama_gguf  # noqa: E402

SHAPE = dict(dim=512, hidden=512, vocab=384, heads=4, kv_heads=2, layers=1)
MIXES = ("Q4_K_M", "Q5_K_M", "Q2_K")
MOE = dict(
    model_type="qwen3_moe", dim=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64,
    hidden_dim=256, vocab_size=384, **moe_config("qwen3_moe", 4, 2, 256),
)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantize", required=True, help="path to llama.cpp's llama-quantize")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = tiny_llama_gguf(
            Path(tmp) / "f32.gguf", seed=7, metadata=llama_vocabulary(SHAPE["vocab"]), **SHAPE
        )
        for mix in MIXES:
            out = HERE / f"llamacpp-{mix}.gguf"
            subprocess.run([args.quantize, str(source), str(out), mix], check=True)
            print(f"{out.name}: {out.stat().st_size} bytes")
        hf = write_hf_model(Path(tmp) / "moe", tokenizer=False, seed=7, **MOE)
        source = gguf_from_hf(hf, Path(tmp) / "moe-f32.gguf")
        out = HERE / "llamacpp-qwen3moe-Q4_K_M.gguf"
        subprocess.run([args.quantize, str(source), str(out), "Q4_K_M"], check=True)
        print(f"{out.name}: {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
