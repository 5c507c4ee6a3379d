"""What every flagship GGUF writer (flagship_gguf*.py) writes alike: the
tokenizer fields, a tensor as float32 or in a ggml type, the file's end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def gguf_vocabulary(w, vocab: dict) -> None:
    """The tokenizer fields of `gguf_writer.llama_vocabulary`'s or `gemma4_vocabulary`'s
    `vocab`."""
    w.add_string("tokenizer.ggml.model", vocab["tokenizer.ggml.model"])
    for key in ("tokens", "scores", "token_type", "merges"):
        if f"tokenizer.ggml.{key}" in vocab:
            w.add_array(f"tokenizer.ggml.{key}", vocab[f"tokenizer.ggml.{key}"])
    for key in ("bos", "eos", "unknown", "padding"):
        if f"tokenizer.ggml.{key}_token_id" in vocab:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab[f"tokenizer.ggml.{key}_token_id"])
    for key in ("add_space_prefix", "add_bos_token"):
        if f"tokenizer.ggml.{key}" in vocab:
            w.add_bool(f"tokenizer.ggml.{key}", vocab[f"tokenizer.ggml.{key}"])
    if "tokenizer.chat_template" in vocab:
        w.add_string("tokenizer.chat_template", vocab["tokenizer.chat_template"])


def gguf_tensor(w, name: str, a, quantized: int | None, stored: bool) -> None:
    """Tensor `a` as float32, or in ggml type `quantized` (`stored` False: its values
    dequantized back to float32)."""
    import gguf
    import numpy as np

    if not quantized:
        w.add_tensor(name, a)
        return
    qtype = gguf.GGMLQuantizationType(quantized)
    q = gguf.quants.quantize(a, qtype)
    if stored:
        w.add_tensor(name, q, raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.dequantize(q, qtype).astype(np.float32))


def gguf_folder(
    w,
    src: Path,
    names: list[tuple[str, str]],
    quantized: int | None,
    stored: bool,
    kept_float: tuple[str, ...] = (),
    adjust: Callable[[str, Any], Any] | None = None,
) -> None:
    """Every tensor of mlx-lm's float32 folder `src` as llama.cpp's converter writes it:
    `adjust(folder name, array)` the array as the converter stores it, renamed by `names`
    ((pattern, replacement) pairs applied in turn); with `quantized` (a ggml type), in
    that type each matrix whose rows take its blocks, but those whose llama.cpp names
    contain one of `kept_float` (the converter keeps them float)."""
    import re

    import gguf
    import mlx.core as mx
    import numpy as np

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(quantized)][0] if quantized else 0
    for name, v in sorted(mx.load(str(src / "model.safetensors")).items()):
        a = np.array(v.astype(mx.float32))
        if adjust is not None:
            a = adjust(name, a)
        for pattern, repl in names:
            name = re.sub(pattern, repl, name)
        a = np.ascontiguousarray(a)
        fits = bool(quantized) and a.ndim >= 2 and a.shape[-1] % block == 0
        fits = fits and not any(k in name for k in kept_float)
        gguf_tensor(w, name, a, quantized if fits else None, stored)


def gguf_finish(w, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# the families with a float32 GGUF copy too (as llama.cpp's converter writes it)
