"""Tiny random-weight models that speak a real release's chat language.

Each `FAMILIES` entry is one release's chat template (a file in
tests/data/chat_templates/, copied byte for byte; README.md there names each
file's source) and its special and added tokens with their `special` flags as
released (tests/data/chat_templates/tokens.json, with where each flag comes from).
`write_family_model(name, path)` writes a model folder around them:

    config.json, model.safetensors   a tiny Llama (model_type "llama": the weights are
                                     random, only the tokenizer and template matter)
    tokenizer.json                   a byte-level BPE trained here on a small corpus,
                                     plus the family's tokens as added tokens
    tokenizer_config.json            chat_template, added_tokens_decoder, bos/eos
    generation_config.json           the release's end-of-turn ids (eos first)

which mlx-lm (`mlx_lm.utils.load`, `mlx_lm.tokenizer_utils.load`), llama_tp's loader,
`python -m llama_tp.serve` and `create_app` read. The folder's config says "llama";
what a release calls itself is `FAMILIES[name].model_type` (llama_tp's registry
name, e.g. "deepseek_v3"), for the tests to pass where a model type is asked for
(`tool_format(tokenizer, model_type=...)`).

    from chat_families import FAMILIES, write_family_model
    path = write_family_model("deepseek_v3_1", tmp_path / "ds")
    FAMILIES["deepseek_v3_1"].model_type  # "deepseek_v3"
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from fixtures import CORPUS, hf_config, random_weights

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"
# Enough text for a few hundred merges of the pieces chat and tool calls are made of.
BPE_CORPUS = [
    *CORPUS,
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "The weather in Paris is 22 degrees and sunny. Let me think about the user's question.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # 3\n",
    "system user assistant tool function parameter reasoning answer\n\n",
]
BPE_VOCAB = 640  # 256 bytes + ~380 merges (the family's tokens come on top)


@dataclass(frozen=True)
class ChatFamily:
    """One release's chat language. `tokens`: content -> `special` as released, in the
    order the vocabulary adds them; `eos_extra`: the further end-of-turn tokens its
    generation_config.json lists; `tools`: whether its template renders tool calls and
    results; `mapped`: why a stand-in real template is used (None: the release's own)."""

    name: str
    release: str
    model_type: str
    template: Path
    tokens: dict[str, bool]
    bos: str | None
    eos: str
    eos_extra: tuple[str, ...] = ()
    tools: bool = True
    mapped: str | None = None

    @property
    def chat_template(self) -> str:
        """The template's text."""
        return self.template.read_text(encoding="utf-8")

    @property
    def eos_tokens(self) -> tuple[str, ...]:
        """Every token that ends a reply: eos first."""
        return (self.eos, *self.eos_extra)


def _load_families() -> dict[str, ChatFamily]:
    table = json.loads((TEMPLATES / "tokens.json").read_text(encoding="utf-8"))["families"]
    return {
        name: ChatFamily(
            name=name,
            release=row["release"],
            model_type=row["model_type"],
            template=TEMPLATES / row["template"],
            tokens=dict(row["tokens"]),
            bos=row["bos"],
            eos=row["eos"],
            eos_extra=tuple(row["eos_extra"]),
            tools=row["tools"],
            mapped=row.get("mapped"),
        )
        for name, row in table.items()
    }


FAMILIES: dict[str, ChatFamily] = _load_families()


@functools.cache
def base_tokenizer_json() -> str:
    """A byte-level BPE trained once per session (tokenizer.json text, no added tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(BPE_CORPUS * 4, trainer)
    return tok.to_str()


def family_tokenizer(family: ChatFamily):
    """The trained base with `family`'s tokens added as released (special or not)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(base_tokenizer_json())
    for content, special in family.tokens.items():
        token = AddedToken(content, special=special, normalized=False)
        # add_special_tokens marks it special; add_tokens leaves it a plain added token
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    return tok


def _tokenizer_config(family: ChatFamily, ids: dict[str, int]) -> dict:
    decoder = {
        str(ids[content]): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in family.tokens.items()
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": family.bos,
        "eos_token": family.eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": family.chat_template,
    }
    if family.bos is None:  # the release has none: {{ bos_token }} renders nothing
        del config["bos_token"]
    return config


def write_family_model(
    name: str, path: str | os.PathLike, *, seed: int = 0, **config_kwargs
) -> Path:
    """A complete tiny model folder for family `name` at `path` (see the module
    docstring); `config_kwargs` go to `fixtures.hf_config` (dim, n_layers, ...), whose
    vocabulary is set to the tokenizer's size. Returns the path."""
    family = FAMILIES[name]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = family_tokenizer(family)
    ids = {content: tok.token_to_id(content) for content in family.tokens}
    eos = [ids[t] for t in family.eos_tokens]
    bos = ids[family.bos] if family.bos else None
    config = hf_config(vocab_size=tok.get_vocab_size(with_added_tokens=True), **config_kwargs)
    config |= {"bos_token_id": bos, "eos_token_id": eos if len(eos) > 1 else eos[0]}
    mx.save_safetensors(
        str(path / "model.safetensors"), random_weights(config, seed), metadata={"format": "mlx"}
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = _tokenizer_config(family, ids)
    (path / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False), encoding="utf-8"
    )
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path
