"""q/k/v and gate/up as one product (llama_tp/parallel/fused.py): the logits of the
unfused model on every format, the memory held once, the modules kept."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf_writer import Q4_1, Q4_K, Q6_K, Q8_0, tiny_llama_gguf

from llama_tp import load_model
from llama_tp.parallel.fused import GATE_UP, QKV, fused_count

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")
SMALL = dict(dim=256, hidden=512, vocab=96, heads=4, kv_heads=2, layers=2)
TOKENS = mx.array([[1, 5, 9, 33, 2, 70, 11]])


def _logits(model) -> np.ndarray:
    return np.array(model(TOKENS).astype(mx.float32))


def _unfuse(model) -> None:
    for _, m in model.named_modules():
        if "_fused" in m.__dict__:
            object.__setattr__(m, "_fused", {})


def _check(model, exact: bool) -> None:
    n = fused_count(model)
    assert n == {"qkv": len(model.layers), "gate_up": len(model.layers)}, n
    fused = _logits(model)
    layer = model.layers[0]
    f = layer.attention._fused[QKV]
    # the modules hold views of the fused arrays: one copy of the weights
    assert (
        layer.attention.wq.weight.nbytes
        + layer.attention.wk.weight.nbytes
        + (layer.attention.wv.weight.nbytes)
        == f.params["weight"].nbytes
    )
    assert GATE_UP in layer.feed_forward._fused
    _unfuse(model)
    apart = _logits(model)
    if exact:  # each row computed as the separate product computes it
        assert np.array_equal(fused, apart)
    else:
        assert np.allclose(fused, apart, rtol=1e-4, atol=1e-4), np.abs(fused - apart).max()


@pytest.mark.parametrize("kind", [Q4_1, Q8_0, Q4_K, Q6_K], ids=["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_gguf_fused_products_give_the_unfused_logits(tmp_path, kind):
    path = tiny_llama_gguf(
        tmp_path / "m.gguf", {f"blk.*.{p}.weight": kind for p in PROJECTIONS}, **SMALL
    )
    model, _ = load_model(path)
    _check(model, exact=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_quantized_fused_products_give_the_unfused_logits(tmp_path, bits):
    from fixtures import write_hf_model

    path = write_hf_model(tmp_path / "q", quantize=(bits, 32), tokenizer=False)
    model, _ = load_model(path)
    _check(model, exact=True)


def test_float_fused_products_give_the_unfused_logits(tiny_dir):
    model, _ = load_model(tiny_dir)
    _check(model, exact=False)


def test_a_replaced_weight_is_not_computed_from_the_stale_fused_array(tiny_dir):
    model, _ = load_model(tiny_dir)
    before = _logits(model)
    wq = model.layers[0].attention.wq
    wq.weight = wq.weight * 2  # no longer the view the fused product holds
    changed = _logits(model)
    _unfuse(model)
    assert not np.allclose(before, changed)
    assert np.allclose(changed, _logits(model), rtol=1e-4, atol=1e-4)
