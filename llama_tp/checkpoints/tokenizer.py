"""One tokenizer interface for every checkpoint format.

All formats end up as mlx-lm's `TokenizerWrapper` (encode/decode, chat
template, EOS ids, and a streaming `detokenizer`): Hugging Face directories
(`tokenizer.json` or sentencepiece `tokenizer.model`) through mlx-lm's own
loader, GGUF files through `gguf_tokenizer`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_hf_tokenizer

from ..cluster.distributed import first_line
from .base import Checkpoint, CheckpointError
from .chat_template import renderer_for, wrap_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(ckpt: Checkpoint) -> TokenizerWrapper:
    """The tokenizer that belongs to checkpoint `ckpt`."""
    if ckpt.format == "gguf":
        from .gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(ckpt.metadata, name=ckpt.path.name)
    if ckpt.format == "meta":
        return meta_tokenizer(Path(ckpt.path) / "tokenizer.model")
    path = Path(ckpt.path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"{path}: no tokenizer (expected tokenizer.json or tokenizer.model)")
    # transformers warns about things that do not concern the user here.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    eos = ckpt.metadata.get("eos_token_id")
    return load_hf_tokenizer(path, eos_token_ids=[eos] if isinstance(eos, int) else eos)


# A tiktoken BPE file (Llama 3): one "base64-token rank" pair per line.
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+\r?\n")


def meta_tokenizer(path: Path) -> TokenizerWrapper:
    """The sentencepiece `tokenizer.model` of an original Meta checkpoint.

    Encodes as Meta's reference tokenizer does: BOS, then the sentencepiece
    pieces (no EOS); its detokenizer streams as mlx-lm's does for the same
    tokenizer in Hugging Face form.
    """
    import sentencepiece as spm
    from mlx_lm import tokenizer_utils
    from tokenizers import normalizers
    from transformers import LlamaTokenizerFast

    if not path.is_file():
        raise CheckpointError(f"{path}: missing (an original Llama checkpoint's tokenizer)")
    with open(path, "rb") as f:
        head = f.read(256)
    if _TIKTOKEN_LINE.match(head):
        raise CheckpointError(
            f"{path}: a tiktoken (Llama 3) tokenizer, which is not supported; "
            "use the Hugging Face release of the model (with tokenizer.json) instead"
        )
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: not a sentencepiece model ({first_line(e)})") from None
    special = {
        name: sp.id_to_piece(i)
        for name, i in (
            ("bos_token", sp.bos_id()),
            ("eos_token", sp.eos_id()),
            ("unk_token", sp.unk_id()),
        )
        if i >= 0
    }
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # transformers builds its fast tokenizer from the .model file (Llama's Metaspace rules).
    tokenizer = LlamaTokenizerFast.from_pretrained(
        str(path.parent), add_bos_token=True, add_eos_token=False, legacy=False, **special
    )
    if _dummy_prefix(sp):
        # As sentencepiece: one "▁" before the text, whatever it starts with, and every
        # space a "▁" (transformers' Metaspace adds none before a leading space).
        backend = tokenizer.backend_tokenizer
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        backend.pre_tokenizer = None
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder")
    # mlx-lm's own test for a sentencepiece-style decoder (private, hence the fallback).
    is_spm = getattr(tokenizer_utils, "_is_spm_decoder", lambda d: False)
    detokenizer = tokenizer_utils.NaiveStreamingDetokenizer
    if is_spm(decoder):
        detokenizer = tokenizer_utils.SPMStreamingDetokenizer
    eos = [sp.eos_id()] if sp.eos_id() >= 0 else None
    return wrap_tokenizer(tokenizer, detokenizer, eos)


def _dummy_prefix(sp) -> bool:
    """Whether the sentencepiece model puts "▁" before the text (add_dummy_prefix)."""
    ids = sp.encode("a")
    return bool(ids) and sp.id_to_piece(ids[0]).startswith("▁")


def encode_prompt(
    tokenizer: TokenizerWrapper,
    prompt: str,
    system: str | None = None,
    use_chat_template: bool = True,
) -> list[int]:
    """Token ids of the user message `prompt` (after `system`), through the tokenizer's
    chat template, or the fallback of one without (`chat_template.PromptRenderer`)."""
    return renderer_for(tokenizer, use_chat_template).prompt(prompt, system)
