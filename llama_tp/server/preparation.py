"""Preparing a request, off the event loop: from its body's bytes to the engine's request.

`Preparation.prepare` runs the one request-parsing path in a worker thread, for the
three APIs alike (an `Api` says how one names fields and turns its body into OpenAI's):

    decode (bodies.py) -> Limits.precheck -> the API's translation -> parse_chat /
    parse_completion (validation, Limits.check) -> the prompt's tokens -> fit

and then compiles the grammar the request asks for (engine/grammar.py keeps it, so the
step loop only copies it). Nothing of this runs on the event loop, which keeps
answering the other requests, nor in the step loop, which keeps decoding them.

Work is split into lanes, so that costly requests wait for each other and never for the
cheap ones: bodies up to LARGE_BODY on a pool of SMALL_WORKERS threads; larger bodies
one at a time on their own thread; grammar compilations one at a time on theirs. The two
costly lanes run at a lower priority (`background_thread`: nice +10), so that on a busy
machine they take the cores the step loop leaves. At most WAITING requests wait in the
large-body or the grammar lane (429 beyond). After a large body the freed memory is
handed back to the system (glibc's `malloc_trim`), so a burst of large requests leaves
no lasting growth.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..cluster.affinity import background_thread
from ..conversation.reasoning import prompt_opens
from ..engine.grammar import GrammarError, compile_grammar, is_compiled
from . import reasoning
from .bodies import Place, decode, openai_param
from .errors import RequestError
from .prompts import fit, grammar_for, prompt_tokens
from .protocol import Defaults, Request, parse_chat, parse_completion

LARGE_BODY = 256 * 1024  # bytes: larger bodies are prepared in the large-body lane
SMALL_WORKERS = 4
WAITING = 16  # requests waiting in the large-body or the grammar lane


@dataclass(frozen=True)
class Api:
    """How an API's bodies become OpenAI's: `translate(data, context)` -> (the OpenAI
    body, or None when there is nothing to generate; whether it is a chat), `context`
    being the model's; `place` writes a field's name as the API's errors do, `names`
    renames OpenAI's fields in the errors of the OpenAI request a body became."""

    translate: Callable[[Any, int], tuple[dict | None, bool]]
    place: Place = openai_param
    names: dict[str, str] = field(default_factory=dict)

    def renamed(self, e: RequestError) -> RequestError:
        """`e` with the field named as this API names it ("name: ...", or "'name': ..."
        in an API that quotes names as OpenAI's does)."""
        name = self.names.get(e.param or "")
        if name is None:
            return e
        text, quoted = str(e), f"'{e.param}'"
        head = f"'{name}'" if self.place is openai_param else name
        if text.startswith(quoted):
            text = f"{head}: {text[len(quoted) :].lstrip(': ')}"
        else:
            text = text.replace(quoted, head)
        return RequestError(text, name, e.status, e.code, e.kind)


def _openai(chat: bool) -> Callable[[Any, int], tuple[dict, bool]]:
    def translate(data: Any, context: int) -> tuple[dict, bool]:
        if not isinstance(data, dict):
            raise RequestError(f"the body is not a JSON object, got {type(data).__name__}")
        return data, chat

    return translate


OPENAI_CHAT = Api(_openai(True))
OPENAI_COMPLETION = Api(_openai(False))


@dataclass
class Prepared:
    """A request ready to queue: the OpenAI body it became, the engine's request and its
    prompt's token ids (`req` None: nothing to generate)."""

    body: dict | None
    data: Any = None  # the body as decoded (the API's own, before its translation)
    req: Request | None = None
    ids: list[int] = field(default_factory=list)
    grammar: tuple[str, str] | None = None  # (the grammar asked for, the field asking)
    api: Api = OPENAI_CHAT  # the API it came through (how its errors name fields)


class Preparation:
    """The lanes of worker threads requests are prepared on (see the module's docstring)."""

    def __init__(self, defaults: Defaults):
        self.defaults = defaults
        self._small = ThreadPoolExecutor(SMALL_WORKERS, "llama_tp-prepare")
        # The costly lanes yield the cores to the step loop and the event loop.
        self._large = ThreadPoolExecutor(1, "llama_tp-prepare-large", background_thread)
        self._grammar = ThreadPoolExecutor(1, "llama_tp-grammar", background_thread)
        self._waiting = {"large": 0, "grammar": 0}

    async def prepare(self, raw: bytes, api: Api, info: Any, count_only: bool = False) -> Prepared:
        """`raw` (a body) as a Prepared request of the model `info` (app.ModelInfo), its
        grammar compiled; RequestError naming the field as `api` does. `count_only`: the
        prompt's tokens only, for counting (not fitted to the context)."""
        large = len(raw) > LARGE_BODY
        work = _large_work if large else _prepare
        lane = "large" if large else None
        p = await self._run(lane, work, raw, api, info, self.defaults, count_only)
        p.api = api
        if p.req is None or count_only:
            return p
        if p.grammar is not None:
            grammar, name = p.grammar
            lane = None if is_compiled(grammar) else "grammar"
            try:
                await self._run(lane, _compile, grammar, info)
            except GrammarError as e:
                e = RequestError(f"'{name}' cannot be compiled into a grammar: {e}", name)
                raise api.renamed(e) from None
            # a grammar's matcher follows one token at a time: no drafts
            p.req.params = p.req.params.but(grammar=grammar, num_draft_tokens=0)
        return p

    async def offload(self, raw: bytes, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a worker thread of the lane a body of `raw`'s size takes (a route
        whose body is not one of the three APIs' chat or completion: embeddings)."""
        if len(raw) > LARGE_BODY:
            return await self._run("large", _trimmed, fn, *args)
        return await self._run(None, fn, *args)

    async def _run(self, lane: str | None, fn, *args):
        loop = asyncio.get_running_loop()
        if lane is None:
            return await loop.run_in_executor(self._small, fn, *args)
        if self._waiting[lane] >= WAITING:
            what = "large requests" if lane == "large" else "grammars to compile"
            raise RequestError(
                f"the server is busy: {self._waiting[lane]} {what} are waiting; retry later",
                None,
                429,
                "rate_limit_exceeded",
                "rate_limit_error",
            )
        self._waiting[lane] += 1
        try:
            return await loop.run_in_executor(self._large if lane == "large" else self._grammar,
                                              fn, *args)  # fmt: skip
        finally:
            self._waiting[lane] -= 1

    def close(self) -> None:
        for pool in (self._small, self._large, self._grammar):
            pool.shutdown(wait=False, cancel_futures=True)


def _prepare(raw: bytes, api: Api, info: Any, defaults: Defaults, count_only: bool) -> Prepared:
    """The one parsing path (in a worker thread): see the module's docstring."""
    limits = info.limits
    try:
        data = decode(raw, limits.json_values, limits.json_depth, api.place)
        limits.precheck(data, api.place)
        body, chat = api.translate(data, info.context)
        if body is None:
            return Prepared(None, data)
        req = (parse_chat if chat else parse_completion)(body, defaults, limits)
        ids, stops = prompt_tokens(req, info.renderer)
        if not count_only:
            fit(req, len(ids), info.context)
        if stops:
            req.params = req.params.but(stop=(*req.params.stop, *stops))
        _reasoning(req, ids, info, defaults)
        grammar = None if count_only else _grammar(req, info, limits)
        return Prepared(body, data, req, ids, grammar)
    except RequestError as e:
        raise api.renamed(e) from None


def _grammar(req: Request, info: Any, limits: Any) -> tuple[str, str] | None:
    """The request's grammar, for the model's family; after the reasoning block the
    prompt opened, where it did (the grammar starts at its end marker)."""
    think_end = info.markers.end if req.reasoning_open and info.markers is not None else None
    return grammar_for(req, info.renderer.tokenizer, limits, info.model_type or None, think_end)


def _reasoning(req: Request, ids: list[int], info: Any, defaults: Defaults) -> None:
    """Whether the prompt opened the reasoning block, and the request's budget (the
    server's for a chat that does not say, where the model reasons)."""
    tokenizer = info.renderer.tokenizer
    req.reasoning_open = prompt_opens(info.markers, tokenizer, ids)
    tokens = req.reasoning_budget
    if tokens is None and req.chat:
        tokens = defaults.reasoning_budget
    budget = reasoning.budget(tokens, info.markers, tokenizer, req.reasoning_open)
    if budget is not None:
        req.params = req.params.but(reasoning_budget=budget)


def _large_work(*args) -> Prepared:
    return _trimmed(_prepare, *args)


def _trimmed(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    finally:
        _trim()


def _compile(grammar: str, info: Any) -> None:
    r = info.renderer
    compile_grammar(grammar, r.tokenizer, info.vocab_size, r.eos)


_LIBC = None


def _trim() -> None:
    """Hand the memory a large request freed back to the system (glibc keeps it in its
    heap otherwise); a no-op elsewhere."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)
