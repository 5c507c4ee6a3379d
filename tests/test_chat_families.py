"""The chat-family fixture kit (tests/chat_families.py): every family's folder loads
with mlx-lm's tokenizer loader, its markers are single tokens with the release's
`special` flags, and its real template renders a tool conversation and the release's
generation prompt."""

from __future__ import annotations

import json
import re

import pytest
from chat_families import FAMILIES, TEMPLATES, write_family_model
from mlx_lm.tokenizer_utils import load as load_tokenizer

from llama_tp.checkpoints.chat_template import ChatTemplateError, PromptRenderer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# As llama_tp's server hands a conversation to a template (server/tools.py `message`):
# a call's arguments decoded, an empty text beside the calls. Mistral wants 9-char ids.
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Lisbon?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call0Abc9",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Lisbon"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call0Abc9", "name": "get_weather", "content": "22 C, sunny"},
]
# DeepSeek-R1's template (and V3-0324 mapped to it) writes a call only when the
# message's content is None: beside an empty text it drops the call.
DROPS_CALLS_BESIDE_TEXT = {"deepseek_r1_distill_llama", "deepseek_v3_0324"}
# Mistral-Nemo's template (Mixtral's stand-in) writes the system message into the last
# user turn only: a conversation ending in a tool result has none.
SYSTEM_IN_LAST_USER_TURN = {"mixtral"}
# Kimi-K2-Thinking's template queues call ids with list.append, which transformers'
# immutable sandbox refuses.
SANDBOX_REFUSES_CALLS = {"kimi_k2_thinking"}

# (family, template kwargs, the generation prompt's tail as the template text writes it)
GENERATION_PROMPTS = [
    ("deepseek_v3_1", {"thinking": True}, "<｜Assistant｜><think>"),
    ("deepseek_v3_1", {"thinking": False}, "<｜Assistant｜><think></think>"),
    ("deepseek_v3_2", {"thinking": True}, "<｜Assistant｜><think>"),
    ("qwen3", {"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ("qwen3", {}, "<|im_start|>assistant\n"),
    ("qwen3_5", {}, "<|im_start|>assistant\n<think>\n"),
    ("qwen3_5", {"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    ("minimax_m2", {}, "]~b]ai\n<think>\n"),
    ("glm4_6", {"enable_thinking": False}, "<|assistant|>\n<think></think>"),
    ("glm4_7", {}, "<|assistant|><think>"),
    ("glm4_7", {"enable_thinking": False}, "<|assistant|></think>"),
    ("step3_5", {}, "<|im_start|>assistant\n<think>\n"),
    ("nemotron_3_nano", {"enable_thinking": False}, "<|im_start|>assistant\n<think></think>"),
    ("kimi_k3", {}, "<|open|>think<|sep|>"),
    ("kimi_k2_thinking", {}, "<|im_assistant|>assistant<|im_middle|>"),
    ("gpt_oss", {"reasoning_effort": "high"}, "<|start|>assistant"),
    ("gemma4", {"enable_thinking": False}, "<|turn>model\n<|channel>thought\n<channel|>"),
    ("ministral_3_reasoning", {}, "[INST]hi[/INST]"),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: write_family_model(name, root / name) for name in FAMILIES}


@pytest.fixture(scope="module")
def tokenizers(folders):
    return {name: load_tokenizer(path) for name, path in folders.items()}


def test_every_template_and_table_is_real_data():
    """Each family's template file exists, and the README names every file's source."""
    readme = (TEMPLATES / "README.md").read_text(encoding="utf-8")
    for family in FAMILIES.values():
        assert family.template.is_file(), family.template
        assert family.template.name in readme, family.template.name
        assert family.eos in family.tokens and all(t in family.tokens for t in family.eos_extra)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_markers_are_single_tokens_with_the_release_flags(name, folders, tokenizers):
    family, tok = FAMILIES[name], tokenizers[name]
    config = json.loads((folders[name] / "config.json").read_text())
    assert config["vocab_size"] == len(tok._tokenizer)
    decoder = tok._tokenizer.added_tokens_decoder
    for content, special in family.tokens.items():
        ids = tok.encode(content, add_special_tokens=False)
        assert len(ids) == 1, (content, ids)
        assert tok.decode(ids) == content
        assert decoder[ids[0]].special is special, content
        # mlx-lm's streaming detokenizer shows every marker, special or not
        detok = tok.detokenizer
        detok.reset()
        detok.add_token(ids[0])
        detok.finalize()
        assert detok.last_segment == content, content
    # the end-of-turn ids llama_tp's loader hands mlx-lm's (config.json's eos_token_id)
    eos = [tok.convert_tokens_to_ids(t) for t in family.eos_tokens]
    assert config["eos_token_id"] == (eos if len(eos) > 1 else eos[0])
    assert tok.eos_token_id == eos[0]
    gen = json.loads((folders[name] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == eos


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_template_renders_a_tool_conversation(name, tokenizers):
    family, renderer = FAMILIES[name], PromptRenderer(tokenizers[name])
    if not family.tools:  # Gemma 3: no tools, and user/assistant turns only
        with pytest.raises(ChatTemplateError, match="alternate"):
            renderer.apply(CONVERSATION, tokenize=False, tools=TOOLS)
        text = renderer.apply(CONVERSATION[:2], tokenize=False)
        assert "You are terse." in text and "Weather in Lisbon?" in text
        return
    if name in SANDBOX_REFUSES_CALLS:
        with pytest.raises(ChatTemplateError, match="unsafe"):
            renderer.apply(CONVERSATION, tokenize=False, tools=TOOLS)
        return
    text = renderer.apply(CONVERSATION, tokenize=False, tools=TOOLS)
    assert "Weather in Lisbon?" in text and "22 C, sunny" in text
    assert ("You are terse." in text) is (name not in SYSTEM_IN_LAST_USER_TURN)
    called = text.count("Lisbon") > 1  # the question, then the call's argument
    assert called is (name not in DROPS_CALLS_BESIDE_TEXT), text
    ids = renderer.apply(CONVERSATION, tools=TOOLS)
    assert ids == tokenizers[name].encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name, kwargs, tail", GENERATION_PROMPTS)
def test_generation_prompt_is_the_releases(name, kwargs, tail, tokenizers):
    """The tail the template text writes (each of its markers and words is in the
    template), after a user turn "hi", with the release's switches
    (`chat_template_kwargs`)."""
    family = FAMILIES[name]
    markers = "|".join(re.escape(t) for t in sorted(family.tokens, key=len, reverse=True))
    pieces = [p.strip() for p in re.split(f"({markers})", tail)]
    assert all(p in family.chat_template for p in pieces if p and p != "hi"), pieces
    text = tokenizers[name].apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert text.endswith(tail), text[-80:]


def test_the_folder_loads_as_a_model(folders):
    """mlx-lm's and llama_tp's loaders read a family's folder whole."""
    from mlx_lm.utils import load as mlx_load

    from llama_tp import load

    path = folders["deepseek_v3_1"]
    model, tok = mlx_load(path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], thinking=True)
    model, tokenizer = load(path)[:2]
    prompt = PromptRenderer(tokenizer).encode([{"role": "user", "content": "hi"}])
    assert prompt[-1] == tokenizer.convert_tokens_to_ids("<think>")
