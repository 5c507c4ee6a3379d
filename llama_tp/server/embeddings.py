"""`POST /v1/embeddings` (OpenAI's), and what Ollama's embedding routes share with it.

A body becomes an `EmbeddingRequest` off the event loop (`Preparation.offload`): decoded
and held to the model's `Limits` (server/limits.py: the inputs' count and size, each
within the context), its inputs tokenized with the tokenizer's own special tokens (as
the model's sentence-transformers or llama.cpp tokenization adds them); token ids are
taken as given. `Embeddings.compute` queues it with rank 0's scheduler (every rank
computes it, a chunk per step beside the decoding rows: engine/embeddings.py) and
awaits its vectors; `finish` normalizes them (L2, unless asked not to) after cutting
them to `dimensions` where the checkpoint allows it (checkpoints/pooling.py).

OpenAI's body: `input` is a string, a list of strings, a list of token ids or a list of
lists of them; `encoding_format` "float" (default) or "base64" (the little-endian
float32 bytes, as the openai client decodes them); `dimensions`; `model` and `user` are
read and ignored (one model is served). The answer: `{"object": "list", "data":
[{"object": "embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens",
"total_tokens"}}`.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations.

import asyncio
import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .bodies import Place, decode, field_path, label, openai_param, validate
from .errors import RequestError
from .scheduler import Failure

POLL = 0.5  # seconds between checks that the client is still connected


@dataclass
class EmbeddingRequest:
    """An embedding request as every API's body becomes it."""

    inputs: list[list[int]]  # each input's token ids
    dimensions: int | None = None  # values per vector (None: the model's hidden size)
    normalize: bool = True
    base64: bool = False  # OpenAI's encoding_format "base64"
    data: Any = None  # the body as decoded


@dataclass
class Computed:
    """An embedding request's answer: its vectors (float32, finished) and token count."""

    vectors: list[np.ndarray]
    tokens: int


def read_inputs(value: Any, field: str, place: Place, ids: bool = True) -> list:
    """A body's inputs: a string or a list of strings; with `ids`, also a list of token
    ids (one input) or a list of lists of them. 400 naming the field (or the entry at
    fault) otherwise."""
    what = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else type(value).__name__
        why = what if ids else "a string or a list of strings"
        raise RequestError(f"{label(place, (field,))}: must be {why}, got {got}", field)
    if ids and all(_token(x) for x in value):
        return [value]
    strings = isinstance(value[0], str) or not ids
    for i, x in enumerate(value):
        if not (isinstance(x, str) if strings else _tokens(x)):
            at, like = (field, i), "a string" if strings else "a list of token ids"
            why = f"{label(place, at)}: must be {like} as the first input is, got {x!r}"
            raise RequestError(why[:200], place(at))
    return value


def _token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tokens(x: Any) -> bool:
    return isinstance(x, list) and all(_token(t) for t in x)


def tokenized(items: list, info: Any, truncate: bool, field: str, place: Place) -> list[list[int]]:
    """The inputs' token ids, held to the model's limits (see limits.py)."""
    limits = info.limits

    def loc(i: int) -> tuple:
        return (field, i) if len(items) > 1 else (field,)

    limits.check_embedding_texts(items, truncate, field, place, loc)
    encode = info.renderer.tokenizer.encode
    ids = [list(encode(x)) if isinstance(x, str) else list(x) for x in items]
    return limits.fit_embedding(ids, truncate, field, place, loc)


def check_dimensions(n: int | None, info: Any, place: Place) -> None:
    """400 naming `dimensions` unless the model allows vectors of `n` values."""
    if n is None:
        return
    why = info.embedding.dimensions_refusal(n, info.dim)
    if why is not None:
        raise RequestError(f"{label(place, ('dimensions',))}: {why}", "dimensions")


def finish(vectors: list[list[float]], dimensions: int | None, normalize: bool) -> list:
    """The engine's pooled vectors cut to `dimensions` values (Matryoshka), then scaled to
    unit length when `normalize`: float32 arrays."""
    out = []
    for v in vectors:
        a = np.asarray(v, np.float32)[:dimensions]
        if normalize:
            a = a / max(float(np.linalg.norm(a)), 1e-12)
        out.append(a.astype(np.float32))
    return out


class Embeddings:
    """The HTTP side of embedding requests, for OpenAI's and Ollama's routes alike:
    prepare the body off the event loop, queue it, await its vectors."""

    def __init__(self, preparation: Any, scheduler: Any, available: Callable[[], Any]):
        self.preparation, self.scheduler, self.available = preparation, scheduler, available

    async def compute(
        self, request: Any, parse: Callable[[Any, Any], EmbeddingRequest], place: Place
    ) -> tuple[EmbeddingRequest, Computed]:
        """The body of `request` read by `parse(data, info)` (in a worker thread, after the
        JSON's bounds), queued, and its finished vectors."""
        info = self.available()
        problem = info.embedding.problem
        if problem is not None:
            raise RequestError(f"the model {info.name!r} gives no embeddings: {problem}", "model")
        raw = await request.body()
        req = await self.preparation.offload(raw, _parse, raw, parse, info, place)
        if not req.inputs:
            return req, Computed([], 0)
        loop = asyncio.get_running_loop()
        job = self.scheduler.submit_embedding(req.inputs, info.embedding.pooling, loop)
        while True:
            try:
                item = await asyncio.wait_for(job.queue.get(), POLL)
                break
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.scheduler.cancel(job.uid)
                    raise RequestError("client closed the request", None, 499, None) from None
        if isinstance(item, Failure):  # the server's (stopping, a rank lost)
            raise RequestError(item.message, None, item.status, "unavailable", "server_error")
        if item.vectors is None:  # the model's forward failed (the same on every rank)
            why = f"the embedding failed: {item.error}"
            raise RequestError(why, None, 500, "failed", "server_error")
        return req, Computed(
            finish(item.vectors, req.dimensions, req.normalize), item.prompt_tokens
        )


def _parse(raw: bytes, parse, info: Any, place: Place) -> EmbeddingRequest:
    limits = info.limits
    data = decode(raw, limits.json_values, limits.json_depth, place)
    req = parse(data, info)
    req.data = data
    return req


# -- OpenAI's route ----------------------------------------------------------------------


class EmbeddingBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    input: Any = None  # read by `read_inputs` (four shapes)
    model: str | None = None  # one model is served: any name is taken
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None


def _named(errors: list[dict]) -> RequestError:
    """pydantic's first error as OpenAI's, naming the field ("dimensions")."""
    e = errors[0]
    if e["type"] == "model_attributes_type":
        return RequestError("the body is not a JSON object", None)
    path = field_path(e["loc"])
    message = f"'{path}': {e['msg'][:1].lower()}{e['msg'][1:]}"
    if "input" in e and e["type"] != "missing":
        message += f", got {e['input']!r}"[:200]
    return RequestError(message, path or None)


def openai_request(data: Any, info: Any) -> EmbeddingRequest:
    """An OpenAI /v1/embeddings body -> EmbeddingRequest (RequestError naming the field)."""
    body = validate(EmbeddingBody, data, _named)
    if body.input is None:
        raise RequestError("'input': required", "input", code="missing")
    items = read_inputs(body.input, "input", openai_param)
    check_dimensions(body.dimensions, info, openai_param)
    ids = tokenized(items, info, False, "input", openai_param)
    return EmbeddingRequest(ids, body.dimensions, True, body.encoding_format == "base64")


def openai_answer(req: EmbeddingRequest, done: Computed, model: str) -> dict[str, Any]:
    data = []
    for i, v in enumerate(done.vectors):
        value = base64.b64encode(v.astype("<f4").tobytes()).decode() if req.base64 else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": value})
    usage = {"prompt_tokens": done.tokens, "total_tokens": done.tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def routes(embeddings: Embeddings):
    """The router of `POST /embeddings` (mounted under /v1)."""
    from fastapi import APIRouter
    from starlette.requests import Request as HTTPRequest

    router = APIRouter()

    @router.post("/embeddings")
    async def create(request: HTTPRequest):
        req, done = await embeddings.compute(request, openai_request, openai_param)
        return openai_answer(req, done, embeddings.available().name)

    return router
