"""Embeddings on one process, through the real clients (`openai` `embeddings.create`,
`ollama` `embed`, `embeddings`, `ps`) against an app served in this process: the pooling
each checkpoint declares (sentence-transformers' files, a GGUF's `pooling_type`) checked
against mlx-lm's own model class on the same folder, `dimensions` refused or cut,
the four input shapes, base64, the 400s naming the field, and a decode that keeps
getting tokens beside a large embedding request. The model-level hidden states
(`hidden`) of the pipeline stage and of mlx-lm's classes are checked here too;
tests/test_embeddings_ranks.py compares 1 and 2 ranks."""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
from embedding_kit import (  # noqa: E402
    AUTH,
    Oracle,
    declare,
    ollama_client,
    vectors,
)
from hostile import ROUTES, malformed, raw  # noqa: E402
from serve_client import KEY, http, openai_client, serving  # noqa: E402

from llama_tp.checkpoints.pooling import EmbeddingSpec, embedding_spec  # noqa: E402
from llama_tp.server.runner import create_app  # noqa: E402

TEXTS = ["Tensor parallel", "a", "Tensor parallel", "The quick brown fox jumps over the lazy dog"]
IDS = [[5, 9, 13], [40, 7, 7, 8, 11], [5, 9, 13]]  # no BOS: each starts differently


@pytest.fixture(scope="module")
def served(tiny_dir):
    """(base URL, app, oracle): the tiny model (context 512) in this process."""
    from llama_tp import load

    model, tokenizer = load(tiny_dir)
    app = create_app(model, tokenizer, model_name="tiny", api_key=KEY)
    with serving(app) as base:
        yield base, app, Oracle(tiny_dir)


def use(app, spec: EmbeddingSpec) -> None:
    """Serve the checkpoint's embedding as `spec` declares it from now on."""
    app.state.model = replace(app.state.model, embedding=spec)


def test_each_declared_pooling_is_mlx_lms_hidden_states_pooled(served, tmp_path):
    base, app, oracle = served
    c = openai_client(base)
    for pooling in ("mean", "cls", "last"):
        spec = embedding_spec(declare(tmp_path / pooling, pooling))
        assert (spec.pooling, spec.source, spec.problem) == (pooling, "1_Pooling/config.json", None)
        use(app, spec)
        for inputs in (TEXTS, IDS):
            got = vectors(c.embeddings.create(model="m", input=inputs))  # base64 on the wire
            want = np.array([oracle.vector(x, pooling) for x in inputs])
            np.testing.assert_allclose(got, want, atol=2e-5, err_msg=pooling)
            np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
            assert np.array_equal(got[0], got[2])  # equal inputs in one batch: equal vectors
        # a text and its token ids are one input; the other shapes of `input`
        one = c.embeddings.create(model="m", input=TEXTS[3], encoding_format="float")
        ids = oracle.ids(TEXTS[3])
        again = c.embeddings.create(model="m", input=ids, encoding_format="float")
        listed = c.embeddings.create(model="m", input=[ids], encoding_format="float")
        assert one.data[0].embedding == again.data[0].embedding == listed.data[0].embedding
        assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    # undeclared: the last token's
    use(app, embedding_spec(tmp_path / "nothing"))
    assert app.state.model.embedding.pooling == "last"
    got = vectors(c.embeddings.create(model="m", input=TEXTS[:2]))
    want = np.array([oracle.vector(x, "last") for x in TEXTS[:2]])
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_base64_is_the_little_endian_float32_of_the_vector(served):
    base, app, _ = served
    use(app, EmbeddingSpec())
    c = openai_client(base)
    floats = c.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    encoded = c.embeddings.create(model="m", input=TEXTS, encoding_format="base64")
    assert encoded.model == "tiny" and len(encoded.data) == len(TEXTS)
    for f, e in zip(floats.data, encoded.data, strict=True):
        assert isinstance(e.embedding, str)
        got = np.frombuffer(base64.b64decode(e.embedding), "<f4")
        assert got.tolist() == np.array(f.embedding, np.float32).tolist()


def test_dimensions_only_where_the_model_declares_matryoshka(served, tmp_path):
    base, app, oracle = served
    c, o = openai_client(base), ollama_client(base)
    use(app, embedding_spec(declare(tmp_path / "plain", "last")))
    for call in (
        lambda: c.embeddings.create(model="m", input="hi", dimensions=16),
        lambda: c.embeddings.create(model="m", input="hi", dimensions=0),
        lambda: c.embeddings.create(model="m", input="hi", dimensions=65),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == "dimensions", e.value.body
    with pytest.raises(ollama.ResponseError) as e:
        o.embed(model="m", input="hi", dimensions=16)
    assert e.value.status_code == 400 and e.value.error.startswith("dimensions: not supported")
    # Matryoshka sizes listed: those (and the full size) only
    use(app, embedding_spec(declare(tmp_path / "mrl", "last", matryoshka_dimensions=[16, 32])))
    full = oracle.vector(TEXTS[3], "last")
    for n in (16, 32, 64):
        r = c.embeddings.create(model="m", input=TEXTS[3], dimensions=n)
        got = np.array(r.data[0].embedding)
        cut = full[:n] / np.linalg.norm(full[:n])
        np.testing.assert_allclose(got, cut, atol=2e-5)
        (same,) = o.embed(model="m", input=TEXTS[3], dimensions=n).embeddings
        np.testing.assert_allclose(same, got, atol=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="m", input="hi", dimensions=20)
    assert e.value.body["param"] == "dimensions" and "16, 32" in e.value.body["message"]
    # is_matryoshka: any size
    use(app, embedding_spec(declare(tmp_path / "any", "last", is_matryoshka=True)))
    assert len(c.embeddings.create(model="m", input="hi", dimensions=20).data[0].embedding) == 20


def test_ollama_embed_embeddings_ps_and_show(served):
    base, app, oracle = served
    use(app, EmbeddingSpec())
    o, c = ollama_client(base), openai_client(base)
    r = o.embed(model="tiny", input=TEXTS)
    want = np.array([oracle.vector(x, "last") for x in TEXTS])
    np.testing.assert_allclose(np.array(r.embeddings), want, atol=2e-5)
    assert r.model == "tiny" and r.prompt_eval_count == sum(len(oracle.ids(t)) for t in TEXTS)
    assert r.total_duration > 0
    (one,) = o.embed(model="tiny", input=TEXTS[3]).embeddings
    np.testing.assert_allclose(one, want[3], atol=2e-5)
    assert o.embed(model="tiny", input="").embeddings == []  # Ollama's "load the model"
    # the older route: the pooled vector, not normalized
    raw_vector = np.array(o.embeddings(model="tiny", prompt=TEXTS[3]).embedding)
    assert abs(np.linalg.norm(raw_vector) - 1) > 1e-3
    np.testing.assert_allclose(raw_vector / np.linalg.norm(raw_vector), want[3], atol=2e-5)
    assert list(o.embeddings(model="tiny", prompt="").embedding) == []
    # truncate: an input past the context cut to its first 512 tokens, or a 400
    long = " ".join(f"w{i}" for i in range(400))
    ids = oracle.ids(long)
    assert len(ids) > 512
    (cut,) = o.embed(model="tiny", input=long).embeddings
    np.testing.assert_allclose(cut, oracle.vector(ids[:512], "last"), atol=2e-5)
    with pytest.raises(ollama.ResponseError) as e:
        o.embed(model="tiny", input=["hi", long], truncate=False)
    assert e.value.status_code == 400 and e.value.error.startswith("input.1: "), e.value.error
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="m", input=["hi", long])
    assert e.value.body["param"] == "input[1]" and "context" in e.value.body["message"]
    (model,) = o.ps().models
    assert model.name == model.model == "tiny:latest" and model.size > 100_000
    assert model.expires_at.year > 2100 and model.context_length == 512
    code, text = http(f"{base}/api/show", {"model": "tiny"}, AUTH)
    assert code == 200 and "embedding" in json.loads(text)["capabilities"]


def test_bad_inputs_are_400s_naming_the_field(served, tmp_path):
    base, app, _ = served
    use(app, EmbeddingSpec())
    s = type("S", (), {"port": int(base.rsplit(":", 1)[1])})
    cases = [
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {}, "input"),
        ("/v1/embeddings", {"input": ["a", 3]}, "input[1]"),
        ("/v1/embeddings", {"input": [[1, 2], "a"]}, "input[1]"),
        ("/v1/embeddings", {"input": [[1, 2], []]}, "input[1]"),
        ("/v1/embeddings", {"input": [1, 10**6]}, "input"),
        ("/v1/embeddings", {"input": ["a", "b"] * 1100}, "input"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "dimensions": "8"}, "dimensions"),
        ("/api/embed", {"input": ["a", 3]}, "input.1"),
        ("/api/embed", {"input": [[1, 2]]}, "input.0"),
        ("/api/embed", {"input": "a", "truncate": "no"}, "truncate"),
        ("/api/embeddings", {"prompt": 3}, "prompt"),
    ]
    for path, body, field in cases:
        status, text = http(f"{base}{path}", body, AUTH)
        error = json.loads(text)["error"]
        if path.startswith("/v1/"):
            assert status == 400 and error["param"] == field, (body, text)
        else:
            assert status == 400 and error.startswith(f"{field}: "), (body, text)
    # a checkpoint whose declared pooling llama_tp does not run: 400 naming the model
    use(app, embedding_spec(declare(tmp_path / "max", "pooling_mode_max_tokens")))
    status, text = http(f"{base}/v1/embeddings", {"input": "a"}, AUTH)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "model" and "'tiny'" in error["message"], text
    assert "pooling_mode_max_tokens" in error["message"]
    use(app, EmbeddingSpec())
    # generated malformed bodies on these routes: never a 5xx
    rng = random.Random(51)
    for _ in range(120):
        path = rng.choice(["/v1/embeddings", "/api/embed", "/api/embeddings"])
        data, headers = malformed(rng, ROUTES[path])
        status, _, text = raw(s, "POST", path, data, headers, timeout=30)
        assert status < 500, (path, data[:300], text)


def test_a_decode_keeps_getting_tokens_beside_a_large_embedding_request(served):
    """The step loop's own record (what each step admitted and dispatched, in order): a
    decode's tokens keep coming between a large embedding request's admission and its
    vectors, and a small embedding request queued after it is done first."""
    from llama_tp.engine.batch_messages import Embedded

    base, app, oracle = served
    use(app, EmbeddingSpec())
    engine, scheduler = app.state.engine, app.state.scheduler
    log: list[tuple[str, int]] = []
    apply, dispatch = engine.apply, scheduler.dispatch

    def logged_apply(decision):
        log.extend(("embed", e.uid) for e in decision.embeds)
        return apply(decision)

    def logged_dispatch(events):
        log.extend(("done" if isinstance(e, Embedded) else "token", e.uid) for e in events)
        dispatch(events)

    c = openai_client(base)
    big = [[3 + (i * 7 + j) % 380 for j in range(16)] for i in range(200)] + [list(range(3, 90))]
    steer = {"logit_bias": {"2": -100}, "max_tokens": 300, "temperature": 0}
    alone = c.completions.create(model="m", prompt="hello", **steer).choices[0].text
    answers: dict[str, object] = {}

    def embed(name: str, inputs) -> None:
        answers[name] = c.embeddings.create(model="m", input=inputs, encoding_format="float")

    engine.apply, scheduler.dispatch = logged_apply, logged_dispatch
    engine.embedder.budget = 16  # small chunks: many turns for a cheap request
    try:
        chunks = []
        stream = c.completions.create(model="m", prompt="hello", stream=True, **steer)
        chunks.append(next(stream))  # the decode has started
        workers = [threading.Thread(target=embed, args=("big", big))]
        workers[0].start()
        while not any(kind == "embed" for kind, _ in log) and workers[0].is_alive():
            time.sleep(0.001)  # the engine has it: queue the small one after it
        workers.append(threading.Thread(target=embed, args=("small", [TEXTS[0]])))
        workers[1].start()
        chunks += list(stream)
        for w in workers:
            w.join(60)
    finally:
        del engine.apply, scheduler.dispatch
        engine.embedder.budget = engine.prefill_step_size
    first, second = [uid for kind, uid in log if kind == "embed"]
    chat = next(uid for kind, uid in log if kind == "token")
    a, b = log.index(("embed", first)), log.index(("done", first))
    between = [x for x in log[a:b] if x == ("token", chat)]
    assert len(between) >= 20, (len(between), b - a)  # tokens all along, not once after
    assert log.index(("done", second)) < b  # requests take turns
    assert "".join(ch.text for c_ in chunks for ch in c_.choices) == alone  # caches untouched
    got = vectors(answers["big"])
    want = [oracle.vector(big[i], "last") for i in (0, 199, 200)]
    np.testing.assert_allclose(got[[0, 199, 200]], want, atol=2e-5)
    assert scheduler.embeddings() == 0
    code, text = http(f"{base}/metrics", None, AUTH)
    counts = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("llama_tp_embedding_")
    }
    assert counts["llama_tp_embedding_inputs_total"] >= 202, counts


def test_declared_pooling_of_a_gguf_and_refusals():
    def spec(kind):
        metadata = {"general.architecture": "qwen3", "qwen3.pooling_type": kind}
        return embedding_spec("x.gguf", metadata)

    assert [spec(k).pooling for k in (1, 2, 3)] == ["mean", "cls", "last"]
    assert spec(3).source == "qwen3.pooling_type" and spec(0).source is None
    assert "reranker" in spec(4).problem
    assert embedding_spec("x.gguf", {"general.architecture": "llama"}) == EmbeddingSpec()


def test_a_dense_module_after_the_pooling_is_refused(tmp_path):
    spec = embedding_spec(declare(tmp_path / "dense", "mean", dense=True))
    assert spec.pooling == "mean" and "Dense" in spec.problem


def test_every_model_kind_gives_its_final_hidden_states(tiny_dir, tmp_path):
    """The pipeline stage (one stage on one rank here; tests/test_embeddings_ranks.py and
    the launch tests run more) and mlx-lm's classes give the hidden states the head reads:
    the native Transformer's, and mlx-lm's own `model.model` output."""
    from generic_models import write_model

    from llama_tp import load
    from llama_tp.loading.pipeline import stage_module
    from llama_tp.parallel.mesh import Mesh

    model, _ = load(tiny_dir)
    x = mx.array([[1, 5, 9, 13, 40]])
    whole = model.hidden(x)
    n = len(model.layers)
    stage = stage_module(model, Mesh(1, 1, 0, 0, [[0]], None, None, [range(n)]))
    assert np.allclose(np.array(stage.hidden(x)), np.array(whole), atol=1e-6)
    logits = model(x)
    assert np.allclose(np.array(model.head(whole)), np.array(logits), atol=1e-5)
    # mlx-lm's classes (GenericModel): read at the head's input
    folder = write_model("starcoder2", tmp_path / "starcoder2", tokenizer=tiny_dir)
    generic, _ = load(folder)
    assert type(generic).__name__ == "GenericModel" and generic.hidden_refusal is None
    from mlx_lm.utils import load as mlx_load

    theirs, _ = mlx_load(str(folder))
    got = np.array(generic.hidden(x))
    assert got.shape == (1, 5, 64)
    np.testing.assert_allclose(got, np.array(theirs.model(x).astype(mx.float32)), atol=1e-5)
