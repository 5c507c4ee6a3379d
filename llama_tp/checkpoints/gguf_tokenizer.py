"""Build an mlx-lm tokenizer from the ``tokenizer.ggml.*`` metadata of a GGUF file.

The goal is to tokenize exactly like llama.cpp does for the same file, using only
``tokenizers`` + ``transformers`` (no ``gguf`` package, no files on disk).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)
from tokenizers import AddedToken, Regex, Token, Tokenizer, decoders, normalizers
from tokenizers import pre_tokenizers as pre
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from .chat_template import wrap_tokenizer

# Token types as stored in `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Regexes checked against llama.cpp src/llama-vocab.cpp and transformers'
# convert_slow_tokenizer.py (Qwen2Converter); llama.cpp spells `(?i:...)` out as
# `'[sS]|...` only because std::regex lacks inline flags.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
# o200k (llama.cpp's `gpt-4o`, gpt-oss's): words by case runs, contractions attached
GPT4O_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> pre.PreTokenizer:
    # ByteLevel's built-in regex is the GPT-2 one llama.cpp uses for `gpt-2`.
    return pre.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre.PreTokenizer:
    # llama.cpp splits on `\p{N}` first (one digit per piece), then the GPT-2 regex.
    return pre.Sequence([pre.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str) -> Callable[[], pre.PreTokenizer]:
    def build() -> pre.PreTokenizer:
        split = pre.Split(Regex(pattern), behavior="isolated", invert=False)
        return pre.Sequence([split, pre.ByteLevel(add_prefix_space=False, use_regex=False)])

    return build


class _Pre(NamedTuple):
    build: Callable[[], pre.PreTokenizer]
    ignore_merges: bool = False  # llama.cpp: a word already in the vocab is one token
    add_bos: bool = False  # llama.cpp's default when `add_bos_token` is absent


_LLAMA3 = _Pre(_split_then_bytes(LLAMA3_PATTERN), ignore_merges=True, add_bos=True)
_QWEN2 = _Pre(_split_then_bytes(QWEN2_PATTERN))

# `tokenizer.ggml.pre` name -> pre-tokenizer, grouped the way llama.cpp groups them.
PRE_TOKENIZERS: dict[str, _Pre] = {
    **dict.fromkeys(["default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais"], _Pre(_gpt2)),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
        _Pre(_smollm),
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2"],
        _LLAMA3,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _LLAMA3._replace(ignore_merges=False, add_bos=False)),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"], _QWEN2),
    "gpt-4o": _Pre(_split_then_bytes(GPT4O_PATTERN)),
}


def _plain(value: Any) -> Any:
    """mx.array / numpy values -> Python scalars and lists; other values unchanged."""
    return value.tolist() if hasattr(value, "tolist") else value


def _gpt2_tokenizer(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, bool]:
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    spec = PRE_TOKENIZERS.get(pre_name)
    if spec is None:
        warnings.warn(
            f"unknown GGUF pre-tokenizer {pre_name!r}; falling back to 'gpt2'", stacklevel=3
        )
        spec = PRE_TOKENIZERS["gpt2"]
    # Merges are stored as "left right"; byte-level pieces never contain a raw space.
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab, merges, ignore_merges=spec.ignore_merges, fuse_unk=False))
    tok.pre_tokenizer = spec.build()
    tok.decoder = decoders.ByteLevel()
    return tok, spec.add_bos


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list:
    """Merges whose ranks follow the scores of the merged piece.

    llama.cpp's SPM tokenizer repeatedly joins the adjacent pair whose concatenation is
    the highest-scoring vocab piece; a BPE ranked by those scores does the same. GGUF
    llama vocabularies carry no merges, so derive them (as transformers' GGUF
    conversion does), but with a set lookup instead of a list scan.
    """
    mergeable = {NORMAL, USER_DEFINED}
    pieces = {t for t, ty in zip(tokens, types, strict=True) if ty in mergeable}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] not in mergeable:
            continue  # sentencepiece never merges into control/byte/unknown pieces
        for k in range(1, len(piece)):
            if piece[:k] in pieces and piece[k:] in pieces:
                ranked.append((-scores[i], i, k))
    ranked.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]


def _llama_tokenizer(
    meta: dict[str, Any], tokens: list[str], types: list[int], add_space_prefix: bool
) -> Tokenizer:
    if "tokenizer.ggml.scores" not in meta:
        raise ValueError("GGUF llama tokenizer needs tokenizer.ggml.scores")
    scores = _plain(meta["tokenizer.ggml.scores"])
    unk_id = _plain(meta.get("tokenizer.ggml.unknown_token_id"))
    unk = tokens[unk_id] if unk_id is not None else None
    vocab = {t: i for i, t in enumerate(tokens)}
    model = BPE(
        vocab,
        _spm_merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,  # `<0xNN>` pieces for characters outside the vocab
    )
    tok = Tokenizer(model)
    # Same layout as transformers' LlamaConverter (legacy mode): llama.cpp prefixes a
    # space to every text fragment that follows a special token, and so does Prepend,
    # because the normalizer runs on each piece left after added tokens are cut out.
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _gemma4_tokenizer(meta: dict[str, Any], tokens: list[str]) -> Tokenizer:
    """llama.cpp's `gemma4` model: a BPE with merges over raw UTF-8 (no byte-level
    encoding), spaces written as U+2581 and no space prefix, the text split only into
    lines and runs of newlines, `<0xNN>` tokens for pieces outside the vocab."""
    merges = []
    for m in meta["tokenizer.ggml.merges"]:
        cut = m.find(" ", 1)  # as llama.cpp splits them
        merges.append((m[:cut], m[cut + 1 :]))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab, merges, byte_fallback=True, fuse_unk=False))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre.Split(Regex(r"\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


class _Gemma4Lines:
    """llama.cpp's `gemma4` pre-tokenizer, run by `tokenizers` as a custom one: cut the
    text into lines and runs of newlines; a run of newlines the vocab holds whole is that
    one token (llama.cpp's rule; the merges need not build it), any other piece goes
    through the BPE model. Set after transformers has copied the backend: a custom
    pre-tokenizer cannot be serialized."""

    def __init__(self, backend: Tokenizer):
        self.model = backend.model
        vocab = backend.get_vocab(with_added_tokens=False)
        self.runs = {t: i for t, i in vocab.items() if t and not t.strip("\n")}

    def _tokens(self, piece) -> list[Token]:
        text = str(piece)
        if text in self.runs:
            return [Token(self.runs[text], text, (0, len(text)))]
        return self.model.tokenize(text)

    def pre_tokenize(self, pretok) -> None:
        pretok.split(lambda _, s: s.split(Regex(r"\n+"), "isolated"))
        pretok.tokenize(self._tokens)


def tokenizer_from_gguf(metadata: dict, name: str = "gguf") -> TokenizerWrapper:
    """Build a tokenizer from the `tokenizer.ggml.*` metadata of a GGUF file, as returned by
    `mlx.core.load(path, return_metadata=True)[1]`."""
    meta = {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}
    model = meta.get("tokenizer.ggml.model")
    tokens = list(meta.get("tokenizer.ggml.tokens", []))
    types = _plain(meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))

    if model == "gpt2":
        backend, add_bos_default = _gpt2_tokenizer(meta, tokens)
        detokenizer: Callable = BPEStreamingDetokenizer
    elif model == "llama":
        add_space_prefix = bool(_plain(meta.get("tokenizer.ggml.add_space_prefix", True)))
        backend, add_bos_default = _llama_tokenizer(meta, tokens, types, add_space_prefix), True
        # Drop the leading space while streaming exactly when the decoder strips it.
        detokenizer = partial(SPMStreamingDetokenizer, trim_space=add_space_prefix)
    elif model == "gemma4":
        backend, add_bos_default = _gemma4_tokenizer(meta, tokens), True
        detokenizer = partial(SPMStreamingDetokenizer, trim_space=False)
        # llama.cpp adds BOS for gemma4 even when the file says not to.
        meta["tokenizer.ggml.add_bos_token"] = True
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama, gemma4)"
        )

    # Match these as whole tokens before pre-tokenization, like llama.cpp's
    # tokenizer_st_partition; only control tokens count as "special" for decoding.
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        idx = _plain(meta.get(f"tokenizer.ggml.{key}_token_id"))
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        # transformers builds the BOS/EOS post-processor from these two flags.
        add_bos_token=bool(_plain(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))),
        add_eos_token=bool(_plain(meta.get("tokenizer.ggml.add_eos_token", False))),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,  # decode must give back the exact text
    )
    # Set after construction: for vocabularies over 100k tokens transformers would
    # otherwise look `name` up on the Hugging Face Hub (its Mistral regex check).
    hf.name_or_path = name
    if model == "gemma4":
        hf.backend_tokenizer.pre_tokenizer = pre.PreTokenizer.custom(
            _Gemma4Lines(hf.backend_tokenizer)
        )

    eos_ids = [
        _plain(meta[f"tokenizer.ggml.{k}_token_id"])
        for k in ("eos", "eot", "eom")
        if f"tokenizer.ggml.{k}_token_id" in meta
    ]
    return wrap_tokenizer(hf, detokenizer, eos_ids)
