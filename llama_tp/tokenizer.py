"""One tokenizer interface for every checkpoint format.

All formats end up as mlx-lm's `TokenizerWrapper` (encode/decode, chat
template, EOS ids, and a streaming `detokenizer`): Hugging Face directories
(`tokenizer.json` or sentencepiece `tokenizer.model`) through mlx-lm's own
loader, GGUF files through `gguf_tokenizer`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_hf_tokenizer

from .checkpoints import Checkpoint, CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(ckpt: Checkpoint) -> TokenizerWrapper:
    """The tokenizer that belongs to checkpoint `ckpt`."""
    if ckpt.format == "gguf":
        from .gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(ckpt.metadata, name=ckpt.path.name)
    path = Path(ckpt.path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"{path}: no tokenizer (expected tokenizer.json or tokenizer.model)")
    # transformers warns about things that do not concern the user here.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    eos = ckpt.metadata.get("eos_token_id")
    return load_hf_tokenizer(path, eos_token_ids=[eos] if isinstance(eos, int) else eos)


def encode_prompt(
    tokenizer: TokenizerWrapper,
    prompt: str,
    system: str | None = None,
    use_chat_template: bool = True,
) -> list[int]:
    """Token ids of `prompt`, wrapped in the chat template when the tokenizer has one."""
    if use_chat_template and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    text = f"{system}\n{prompt}" if system else prompt
    return list(tokenizer.encode(text))
