"""Embeddings across ranks: `python -m llama_tp.serve` on 2 ranks (tensor-parallel) gives
the vectors one process gives (to float rounding), through `openai` and `ollama`, with
the pooling and Matryoshka sizes it reads from the folder's sentence-transformers files
and config.json; a chat beside them on 2 ranks keeps its text; `ps` lists the model."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
from embedding_kit import (  # noqa: E402
    AUTH,
    Oracle,
    declare,
    model_copy,
    ollama_client,
    vectors,
)
from serve_client import KEY, Server, chat, http, openai_client, serving  # noqa: E402

from llama_tp.checkpoints.pooling import embedding_spec  # noqa: E402

pytestmark = pytest.mark.ranks

TEXTS = ["Tensor parallel", "a", "Ranks share the heads", "Tensor parallel"]


@pytest.fixture(scope="module")
def folder(tiny_dir, tmp_path_factory):
    """The tiny model as an embedding release ships: last-token pooling declared by
    sentence-transformers' files, Matryoshka sizes 16 and 32 in config.json."""
    d = model_copy(tiny_dir, tmp_path_factory.mktemp("emb") / "model")
    return declare(d, "last", matryoshka_dimensions=[16, 32])


@pytest.fixture(scope="module")
def servers(folder, tmp_path_factory):
    """{1: the base URL of the model served in this process, 2: a 2-rank server}."""
    from llama_tp import load

    two = Server(2, folder, tmp_path_factory.mktemp("emb-logs"))
    try:
        from llama_tp.server.runner import create_app

        model, tokenizer = load(folder)
        app = create_app(model, tokenizer, api_key=KEY, embedding=embedding_spec(folder))
        with serving(app) as one:
            two.wait_ready()
            yield {1: one, 2: two.base}
    finally:
        two.close()


def test_two_ranks_give_one_process_s_vectors(servers, folder):
    oracle = Oracle(folder)
    ids = oracle.ids(" ".join(f"w{i}" for i in range(80)))
    got = {}
    for n, base in servers.items():
        c, o = openai_client(base), ollama_client(base)
        texts = vectors(c.embeddings.create(model="m", input=TEXTS))
        tokens = vectors(c.embeddings.create(model="m", input=[ids, ids[:7]]))
        short = vectors(c.embeddings.create(model="m", input=TEXTS, dimensions=16))
        embed = np.array(o.embed(model="m", input=TEXTS).embeddings)
        np.testing.assert_allclose(embed, texts, atol=1e-6)
        assert np.array_equal(texts[0], texts[3])  # equal inputs in one batch
        np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
        with pytest.raises(openai.BadRequestError) as e:
            c.embeddings.create(model="m", input="hi", dimensions=20)
        assert e.value.body["param"] == "dimensions"
        got[n] = (texts, tokens, short)
    for a, b in zip(got[1], got[2], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    texts, tokens, short = got[2]
    want = np.array([oracle.vector(x, "last") for x in TEXTS])
    np.testing.assert_allclose(texts, want, atol=2e-5)
    np.testing.assert_allclose(tokens[0], oracle.vector(ids, "last"), atol=2e-5)
    cut = want[:, :16] / np.linalg.norm(want[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, cut, atol=2e-5)


def test_a_chat_beside_embeddings_on_two_ranks_and_ps(servers):
    base = servers[2]
    c = openai_client(base)
    alone = chat(c, "hello", max_tokens=24)[0]
    many = [f"input number {i} " * 20 for i in range(40)]
    out = {}
    worker = threading.Thread(
        target=lambda: out.update(v=vectors(c.embeddings.create(model="m", input=many)))
    )
    worker.start()
    beside = chat(c, "hello", stream=True, max_tokens=24)[0]
    worker.join(60)
    assert beside == alone and out["v"].shape == (40, 64)
    one = ollama_client(servers[1]).ps().models[0]
    (model,) = ollama_client(base).ps().models
    assert model.name == "model:latest" and model.context_length == 512
    assert model.size >= one.size > 0 and model.digest  # both ranks' weights together
    assert model.details.family == "llama" and model.details.format == "safetensors"
    code, text = http(f"{base}/metrics", None, AUTH)
    assert code == 200 and "llama_tp_embedding_inputs_total" in text
