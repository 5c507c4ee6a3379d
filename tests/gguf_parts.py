"""What every flagship GGUF writer (flagship_gguf*.py) writes alike: the
tokenizer fields, a tensor as float32 or in a ggml type, the file's end."""

from __future__ import annotations

from pathlib import Path


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


def gguf_finish(w, out: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# the families with a float32 GGUF copy too (as llama.cpp's converter writes it)
