"""Ollama's routes that describe the served model: `/api/tags` (the models it has),
`/api/ps` (the models loaded), `/api/show` and `/api/version`, in the shapes the
`ollama` client parses; and the time and model name as Ollama writes them.

llama_tp serves one model, loaded for as long as the server runs: `ps` lists it with
the bytes of the weights all ranks hold together (`size`, replicas included; also
`size_vram` on Metal, where that memory is the GPU's, 0 on a CPU), its digest (the
weights' fingerprint the ranks compare at start-up) and, as Ollama does for a model
kept loaded for good (`keep_alive` -1), an expiry far ahead.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations.

import time
from typing import Any

FOREVER = "2318-01-01T00:00:00Z"  # `expires_at` of a model that stays loaded


def now() -> str:
    """The time as Ollama writes it: RFC 3339 in UTC with nanoseconds."""
    ns = time.time_ns()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns // 10**9)) + f".{ns % 10**9:09d}Z"


def tag(name: str) -> str:
    """A model name as Ollama lists one: with a tag."""
    return name if ":" in name else f"{name}:latest"


def entry(info: Any) -> dict[str, Any]:
    """The served model (app.ModelInfo) as Ollama's model lists hold it."""
    details = {"format": "", "family": "", "parameter_size": "", "quantization_level": ""}
    details.update(info.details)
    return {
        "name": tag(info.name),
        "model": tag(info.name),
        "size": info.size,
        "digest": info.digest,
        "details": details,
    }


def capabilities(info: Any) -> list[str]:
    """What `/api/show` says the model does ("thinking": its replies mark reasoning;
    "embedding": its hidden states pool)."""
    out = ["completion", "tools", *(["thinking"] if info.markers else [])]
    return out + (["embedding"] if info.embedding.problem is None else [])


def routes(model):
    """The router of Ollama's model routes (mounted under /api); `model()` is the served
    model's ModelInfo (RequestError 503 while loading)."""
    from fastapi import APIRouter

    from ..cluster.diagnostics import llama_tp_version

    router = APIRouter()
    started = now()

    @router.get("/tags")
    async def tags():
        return {"models": [{**entry(model()), "modified_at": started}]}

    @router.get("/ps")
    async def ps():
        info = model()
        loaded = {
            "expires_at": FOREVER,
            "size_vram": info.size_vram,
            "context_length": info.context,
        }
        return {"models": [{**entry(info), **loaded}]}

    @router.post("/show")
    async def show():
        info = model()
        return {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": entry(info)["details"],
            "model_info": {
                "general.architecture": "llama_tp",
                "llama_tp.context_length": info.context,
            },
            "capabilities": capabilities(info),
        }

    @router.get("/version")
    async def version():
        return {"version": llama_tp_version()}

    return router
