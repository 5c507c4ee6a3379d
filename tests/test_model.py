"""Single process: the model against mlx-lm's reference Llama, the cache, the formats."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fixtures import write_hf_model
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model

from llama_tp.checkpoints import open_checkpoint
from llama_tp.checkpoints.build import build_model

CONFIGS = {
    "gqa": dict(n_heads=8, n_kv_heads=2),
    "mha_tied": dict(n_heads=4, n_kv_heads=4, tie=True),
    "qwen2_bias": dict(n_heads=6, n_kv_heads=2, dim=48, model_type="qwen2"),
    "llama3_rope": dict(
        n_heads=4,
        n_kv_heads=1,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "interleaved_rope": dict(n_heads=4, n_kv_heads=2, rope_traditional=True),
    "head_dim_32": dict(n_heads=4, n_kv_heads=2, head_dim=32),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return write_hf_model(path, tokenizer=False, **CONFIGS[request.param])


def tokens(n: int, vocab: int = 384, seed: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, vocab, (1, n)), dtype=mx.int32)


def test_shapes_and_dtype(model_dir):
    model = build_model(open_checkpoint(model_dir))
    logits = model(tokens(7))
    assert logits.shape == (1, 7, model.args.vocab_size)
    assert logits.dtype == mx.float32


def test_matches_mlx_lm_reference(model_dir):
    """Same weights through mlx-lm's own Llama/Qwen2: same logits."""
    ours = build_model(open_checkpoint(model_dir))
    ref, _ = mlx_lm_load_model(model_dir)
    x = tokens(80)  # longer than the llama3 test's original context, so scaling matters
    np.testing.assert_allclose(np.array(ours(x)), np.array(ref(x)), atol=1e-4, rtol=1e-4)


def test_cached_decoding_equals_full_forward(model_dir):
    model = build_model(open_checkpoint(model_dir))
    x = tokens(12)
    full = model(x)
    cache = make_prompt_cache(model)
    steps = [model(x[:, :5], cache=cache)]  # a prefill chunk, then one token at a time
    steps += [model(x[:, i : i + 1], cache=cache) for i in range(5, 12)]
    np.testing.assert_allclose(
        np.array(mx.concatenate(steps, axis=1)), np.array(full), atol=1e-4, rtol=1e-4
    )


def test_quantized_checkpoint_matches_mlx_lm(tmp_path):
    path = write_hf_model(tmp_path, quantize=(4, 32), tokenizer=False)
    ours = build_model(open_checkpoint(path))
    assert type(ours.layers[0].attention.wq).__name__ == "QuantizedLinear"
    assert ours.layers[0].attention.wq.bits == 4
    ref, _ = mlx_lm_load_model(path)
    x = tokens(9)
    np.testing.assert_allclose(np.array(ours(x)), np.array(ref(x)), atol=1e-4, rtol=1e-4)


def test_stream_generate_logprobs(tmp_path):
    """The Python API's log-probabilities are those of the model's own logits."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from llama_tp.engine.generation import stream_generate

    path = write_hf_model(tmp_path)
    model = build_model(open_checkpoint(path))
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode("Hello world")
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=4, logprobs=3))
    tokens = prompt + [r.token for r in out]
    logits = model(mx.array([tokens]))[0].astype(mx.float32)
    lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    for i, r in enumerate(out):
        row = lp[len(prompt) - 1 + i]
        assert abs(r.logprob - row[r.token]) < 1e-4
        assert [t for t, _ in r.top_logprobs] == list(np.argsort(-row)[:3])
        assert r.top_logprobs[0][0] == r.token  # greedy picks the most likely token


def chunked_attention(kv_map: bool = False):
    """One fp32 attention layer (8 query / 2 KV heads); `kv_map`: the irregular
    grouping path (every query head its own copy of its KV head)."""
    from llama_tp.model_args import ModelArgs
    from llama_tp.models.attention import Attention

    mx.random.seed(3)
    args = ModelArgs(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, hidden_dim=96, vocab_size=16)
    attn = Attention(args)
    mx.eval(attn.parameters())
    if kv_map:
        object.__setattr__(attn, "_kv_index", mx.array([0, 0, 0, 1, 1, 1, 1, 0], mx.int32))
    return attn


def attend(attn, chunk, parts):
    """Outputs of `attn` over consecutive prefill parts on one KV cache (the later ones
    at an offset), with `query_chunk=chunk`."""
    from mlx_lm.models.cache import KVCache

    object.__setattr__(attn, "query_chunk", chunk)
    cache, out = KVCache(), []
    for x in parts:
        out.append(attn(x, "causal" if x.shape[1] > 1 else None, cache))
        mx.eval(out[-1])
    object.__setattr__(attn, "query_chunk", None)
    return [np.array(o) for o in out]


@pytest.mark.parametrize("kv_map", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 5, 12])
def test_attention_query_chunks_match_one_call(monkeypatch, chunk, kv_map):
    """Queries in blocks of `chunk` (a prompt's first prefill chunk, then a second
    one at a cache offset of 7, then one decoded token) give the one call's outputs,
    and do run in blocks: ceil(L / chunk) attention calls of those lengths."""
    import llama_tp.models.attention as llama_model

    attn = chunked_attention(kv_map)
    x = mx.random.normal((1, 7 + 11 + 1, 64), key=mx.random.key(4))
    parts = [x[:, :7], x[:, 7:18], x[:, 18:]]
    whole = attend(attn, None, parts)
    seen, sdpa = [], llama_model.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(llama_model, "scaled_dot_product_attention", spy)
    chunked = attend(attn, chunk, parts)
    for a, b in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    # (query length, key length) of each call: block [a, b) of a part at offset o
    # attends to keys [0, o + b)
    want = []
    for offset, length in ((0, 7), (7, 11), (18, 1)):
        if length <= chunk:
            want.append((length, offset + length))
            continue
        for a in range(0, length, chunk):
            b = min(a + chunk, length)
            want.append((b - a, offset + b))
    assert seen == want


def test_attention_query_chunks_only_for_a_causal_mask(monkeypatch):
    """An array mask (batched left padding) keeps the single call; inside
    `lazy_query_blocks` the blocks are built but not evaluated."""
    import llama_tp.models.attention as llama_model

    attn = chunked_attention()
    object.__setattr__(attn, "query_chunk", 4)
    x = mx.random.normal((1, 10, 64), key=mx.random.key(5))
    mask = mx.tril(mx.ones((10, 10), mx.bool_))
    np.testing.assert_allclose(
        np.array(attn(x, mask)), np.array(attn(x, "causal")), atol=1e-5, rtol=0
    )
    evals, real_eval = [], mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: evals.append(a) or real_eval(*a))
    attn(x, mask)
    assert evals == []
    attn(x, "causal")
    assert len(evals) == 3  # blocks 0-3, 4-7, 8-9, each evaluated when built
    evals.clear()
    with llama_model.lazy_query_blocks():
        out = attn(x, "causal")
    assert evals == [] and out.shape == (1, 10, 64)
