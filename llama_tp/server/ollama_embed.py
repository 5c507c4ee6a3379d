"""Ollama's embedding routes onto the computation OpenAI's `/v1/embeddings` runs
(server/embeddings.py), in Ollama's shapes and field names.

- `POST /api/embed`: `input` a string or a list of strings; `truncate` (default true: an
  input longer than the context is cut to its first tokens, as Ollama cuts it; false: a
  400 naming `input`); `dimensions` where the model allows it; `options` and
  `keep_alive` read and ignored (the model stays loaded). The answer: `{"model",
  "embeddings", "total_duration", "load_duration", "prompt_eval_count"}`, each vector of
  unit length. An empty `input` is Ollama's "load the model": no embeddings.
- `POST /api/embeddings` (Ollama's older route): `prompt` -> `{"embedding": [...]}`, the
  vector as pooled, not normalized (Ollama answers it so); an empty prompt an empty one.

Errors are Ollama's `{"error": "..."}`, fields named as Ollama names them ("input.2").
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations.

from time import monotonic_ns
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from .bodies import dotted, dotted_place, validate
from .embeddings import EmbeddingRequest, Embeddings, check_dimensions, read_inputs, tokenized
from .ollama_models import tag


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # keep_alive

    model: str | None = None  # one model is served: any name is taken
    options: dict[str, Any] | None = None  # num_ctx and the like: nothing to change


class EmbedBody(_Body):
    input: Any = None  # a string or a list of them (`read_inputs`)
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=1)] | None = None


class EmbeddingsBody(_Body):
    prompt: str = ""


def embed_request(data: Any, info: Any) -> EmbeddingRequest:
    """An /api/embed body -> EmbeddingRequest (no inputs: "load the model")."""
    b = validate(EmbedBody, data, dotted())
    if b.input is None or b.input == "":
        return EmbeddingRequest([])
    items = read_inputs(b.input, "input", dotted_place, ids=False)
    check_dimensions(b.dimensions, info, dotted_place)
    ids = tokenized(items, info, b.truncate, "input", dotted_place)
    return EmbeddingRequest(ids, b.dimensions)


def embeddings_request(data: Any, info: Any) -> EmbeddingRequest:
    """An /api/embeddings body -> EmbeddingRequest (the vector not normalized)."""
    b = validate(EmbeddingsBody, data, dotted())
    if not b.prompt:
        return EmbeddingRequest([])
    return EmbeddingRequest(tokenized([b.prompt], info, False, "prompt", dotted_place), None, False)


def routes(embeddings: Embeddings):
    """The router of Ollama's embedding routes (mounted under /api)."""
    from fastapi import APIRouter
    from starlette.requests import Request as HTTPRequest

    router = APIRouter()

    @router.post("/embed")
    async def embed(request: HTTPRequest):
        t0 = monotonic_ns()
        req, done = await embeddings.compute(request, embed_request, dotted_place)
        name = (req.data or {}).get("model") or tag(embeddings.available().name)
        return {
            "model": name,
            "embeddings": [v.tolist() for v in done.vectors],
            "total_duration": monotonic_ns() - t0,
            "load_duration": 0,
            "prompt_eval_count": done.tokens,
        }

    @router.post("/embeddings")
    async def embeddings_(request: HTTPRequest):
        _, done = await embeddings.compute(request, embeddings_request, dotted_place)
        return {"embedding": done.vectors[0].tolist() if done.vectors else []}

    return router
