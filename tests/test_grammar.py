"""Constrained decoding and the logits processors in one process: `Chat(...).send(...,
schema=...)` on the built-in model, and each rank's slice of a mask or a bias equal to
the whole vocabulary's (engine/grammar.py, engine/logits_processors.py)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

pytest.importorskip("llguidance")

from llama_tp.engine.grammar import GrammarError, GrammarMask, json_schema_grammar  # noqa: E402
from llama_tp.engine.logits_processors import processors_for  # noqa: E402
from llama_tp.engine.settings import SamplingParams  # noqa: E402
from llama_tp.parallel.vocab_shards import VocabShard  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"enum": [1, 2, 3]}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def builtin():
    from llama_tp import load

    return load()


def test_chat_follows_a_schema_and_rejects_one_that_cannot_compile(builtin):
    from llama_tp import Chat

    model, tokenizer = builtin
    chat = Chat(model, tokenizer, max_tokens=48)
    obj = json.loads(chat.send("Name a big city as JSON.", schema=SCHEMA))
    assert set(obj) == {"city", "rank"} and obj["rank"] in (1, 2, 3) and len(obj["city"]) <= 20
    plain = Chat(model, tokenizer, max_tokens=48).send("Name a big city as JSON.")
    assert plain != json.dumps(obj)  # the schema changed the reply
    with pytest.raises(GrammarError, match="foo"):
        chat.send("again", schema={"type": "foo"})


def _halves(size: int) -> list[VocabShard]:
    half = size // 2
    return [VocabShard(0, half, size), VocabShard(half, size, size)]


def test_each_shard_masks_and_biases_its_own_columns(builtin):
    model, tokenizer = builtin
    size = model.args.vocab_size
    eos = frozenset(tokenizer.eos_token_ids)
    logits = mx.random.normal((1, size), key=mx.random.key(0))
    prompt = tokenizer.encode("Hi")  # then a reply the grammar allows so far
    history = mx.array(prompt + tokenizer.encode('{"city": "Pa'), mx.int32)
    whole = VocabShard.whole(size)
    grammar = json_schema_grammar(SCHEMA)
    params = SamplingParams(
        logit_bias=((5, 7.0), (size - 3, -4.0)), presence_penalty=0.5, repetition_penalty=1.3
    )

    def run(shard: VocabShard) -> mx.array:
        mask = GrammarMask(grammar, tokenizer, size, eos)
        procs = processors_for(params, tokenizer, size, eos)
        out = mask(history[: len(prompt)], logits[:, shard.start : shard.stop], shard)
        out = mask(history, out, shard)  # then the reply so far
        for p in procs:
            out = p(history, out, shard)
        return out

    expected = run(whole)
    assert mx.isinf(expected).sum().item() > size // 2  # the grammar cut most tokens
    assert mx.array_equal(mx.concatenate([run(s) for s in _halves(size)], axis=1), expected)
    (bias,) = processors_for(SamplingParams(logit_bias=((5, 7.0),)), tokenizer, size, eos)
    biased = bias(history, logits, whole)
    assert biased[0, 5].item() == pytest.approx(logits[0, 5].item() + 7.0)
    assert mx.array_equal(biased[:, 6:], logits[:, 6:])
