"""The engine's cache facade (engine/caches.py) over every layer kind's cache: tokens held,
stepping back or why not, checkpoint and restore of a state. One process, tiny arrays."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from llama_tp.engine import caches


def _feed(cache, n: int, t0: int = 0) -> None:
    """n tokens into every layer: keys/values for KV layers, a state for recurrent ones."""
    for t in range(t0, t0 + n):
        kv = mx.full((1, 1, 1, 2), float(t))
        for c in cache:
            if isinstance(c, ArraysCache):  # a conv state and a recurrent state
                c[0] = (c[0] if c[0] is not None else mx.zeros((1, 2))) + t
                c[1] = (c[1] if c[1] is not None else mx.zeros((1, 3))) * 0.5 + t
            else:
                c.update_and_fetch(kv, kv)


def test_kv_and_window_rewind_until_the_window_wraps():
    cache = [KVCache(), RotatingKVCache(max_size=4)]
    _feed(cache, 3)
    assert caches.held(cache) == 3 and caches.can_rewind(cache, 2)
    caches.rewind(cache, 2)
    assert caches.held(cache) == 1
    _feed(cache, 5, 1)
    assert caches.held(cache) == 6 and not caches.can_rewind(cache, 1)
    assert caches.can_rewind(cache, 0)  # nothing to step back over
    with pytest.raises(caches.CacheError, match="^speculative decoding: a sliding-window"):
        caches.rewind(cache, 1, "speculative decoding")


def test_a_recurrent_state_is_checkpointed_not_rewound():
    cache = [KVCache(), ArraysCache(size=2)]
    _feed(cache, 2)
    assert caches.why_not_rewind(cache).startswith("a recurrent layer's state")
    snap = caches.checkpoint(cache)
    state = cache[1][0].tolist()
    _feed(cache, 3, 2)
    assert caches.held(cache) == 5 and cache[1][0].tolist() != state
    caches.restore(cache, snap)
    assert caches.held(cache) == 2 and cache[1][0].tolist() == state
    assert len(caches.arrays(cache)) == 4  # keys, values, the two states
    with pytest.raises(caches.CacheError, match="counts its tokens"):
        caches.held([ArraysCache(size=2)])


def test_a_wrapped_window_restores_its_copy():
    cache = [RotatingKVCache(max_size=2)]
    _feed(cache, 3)
    snap = caches.checkpoint(cache)
    keys = cache[0].keys.tolist()
    _feed(cache, 1, 3)  # written in place into the same buffer
    caches.restore(cache, snap)
    assert cache[0].keys.tolist() == keys and caches.held(cache) == 3


def test_batches_merge_extend_filter_extract():
    a, b = [KVCache(), ArraysCache(size=2)], [KVCache(), ArraysCache(size=2)]
    _feed(a, 2)
    _feed(b, 2, 10)
    batch = caches.merge(a)
    caches.extend(batch, caches.merge(b))
    assert batch[1][0].shape[0] == 2
    caches.filter_rows(batch, [1])
    one = caches.extract(batch, 0)
    assert one[1][0].tolist() == b[1][0].tolist()


def test_an_end_of_sequence_past_a_wrapped_window(tmp_path):
    """A reply that ends (its end-of-sequence token fed) once gpt-oss's sliding windows
    have wrapped: the caches cannot step back over that token, so they keep it, and a
    chat's next turn reuses what they hold (it used to fail with a speculative-decoding
    error)."""
    from gpt_oss_fixtures import write_gpt_oss

    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.build import build_model
    from llama_tp.checkpoints.tokenizer import load_tokenizer
    from llama_tp.conversation.chat import Chat
    from llama_tp.engine.generation import stream_generate

    ckpt = open_checkpoint(write_gpt_oss(tmp_path / "gpt_oss"))
    model, tok = build_model(ckpt), load_tokenizer(ckpt)
    prompt = list(range(5, 13))  # past the window of 4
    plain = [
        r.token for r in stream_generate(model, tok, prompt, max_tokens=6, eos_token_ids=set())
    ]
    cache = caches.new(model)
    out = [
        r.token
        for r in stream_generate(
            model, tok, prompt, max_tokens=6, eos_token_ids={plain[3]}, cache=cache
        )
    ]
    assert out == plain[: plain.index(plain[3]) + 1]
    assert caches.held(cache) == len(prompt) + len(out)  # the fed end of sequence kept
    chat = Chat(model, tok, max_tokens=4)
    chat.send("hi")
    chat.send("again")
    assert chat.last_stats.prompt_tokens > chat.last_stats.prefilled_tokens >= 1
