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
