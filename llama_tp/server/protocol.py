"""The OpenAI request formats: validation with field-naming errors.

Nothing here knows about HTTP or ranks: `parse_*` turn a decoded JSON body into a
`Request` (or raise `RequestError`); `encode` and `fit` make its prompt tokens and
bound its reply. What is sent back is built in `responses.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.batch import SamplingParams

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
MAX_DRAFT_TOKENS = 16  # a request's num_draft_tokens (prompt lookup, greedy only)
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A bad request: answered with `status` and OpenAI's error body naming `param`."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = "invalid_value",
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(str(self), self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Defaults:
    """The command's flags that stand in for fields a request leaves out."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: int | None = None  # for requests without one (None: a fresh one each)
    system_prompt: str | None = None
    use_chat_template: bool = True
    num_draft_tokens: int = 0  # --num-draft-tokens: drafts for greedy requests that do not say


@dataclass
class Request:
    """A validated completion request, not yet tokenized (chat: `messages`; else `prompt`)."""

    chat: bool
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str | list[int] = ""
    max_tokens_given: bool = False


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(
            f"'{name}' must be a number, got {type(v).__name__}", name, code="invalid_type"
        )
    if not lo <= v <= hi:
        raise RequestError(f"'{name}' must be between {lo:g} and {hi:g}, got {v}", name)
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(
            f"'{name}' must be an integer, got {type(v).__name__}", name, code="invalid_type"
        )
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise RequestError(f"'{name}' must be {bound}, got {v}", name)
    return v


def _boolean(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(
            f"'{name}' must be a boolean, got {type(v).__name__}", name, code="invalid_type"
        )
    return v


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise RequestError(
            "'stop' must be a string or a list of strings", "stop", code="invalid_type"
        )
    if len(v) > MAX_STOPS:
        raise RequestError(f"'stop' may hold at most {MAX_STOPS} strings, got {len(v)}", "stop")
    return tuple(s for s in v if s)


def _drafts(body: dict, defaults: Defaults, temperature: float) -> int:
    """num_draft_tokens (a llama_tp extension): prompt-lookup drafts per step, greedy only.

    Drafting is refused for sampled requests: a seeded request must give the same text
    alone (where it would draft) and in a batch (where it cannot). The server's default
    applies to greedy requests only.
    """
    name = "num_draft_tokens"
    k = _integer(body, name, 0, MAX_DRAFT_TOKENS)
    if k is None:
        return defaults.num_draft_tokens if temperature == 0 else 0
    if k and temperature > 0:
        raise RequestError(
            f"'{name}' needs greedy decoding (temperature 0): drafts are not verified "
            f"for sampled requests, got temperature {temperature:g}",
            name,
        )
    return k


def _common(body: Any, defaults: Defaults, chat: bool) -> Request:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, code="invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", "model", code="invalid_type")
    n = _integer(body, "n", 1)
    if n not in (None, 1):
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", "n")
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens, given = defaults.max_tokens, False
    for name in names:
        v = _integer(body, name, 1)
        if v is not None:
            max_tokens, given = v, True
            break
    temperature = _number(body, "temperature", 0.0, 2.0, defaults.temperature)
    top_p = _number(body, "top_p", 0.0, 1.0, defaults.top_p)
    if top_p == 0.0:
        raise RequestError("'top_p' must be greater than 0", "top_p")
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)
    stream = _boolean(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestError(
                "'stream_options' must be an object", "stream_options", code="invalid_type"
            )
        try:
            include_usage = _boolean(opts, "include_usage")
        except RequestError as e:
            raise RequestError(str(e), "stream_options.include_usage", code=e.code) from None
    if chat:
        logprobs = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not logprobs:
            raise RequestError("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        k = (top or 0) if logprobs else None
    else:
        k = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        min_p=defaults.min_p,
        top_k=defaults.top_k,
        stop=_stops(body),
        logprobs=k,
        num_draft_tokens=_drafts(body, defaults, temperature),
    )
    return Request(chat, params, stream, include_usage, seed, max_tokens_given=given)


def parse_chat(body: Any, defaults: Defaults) -> Request:
    """A /v1/chat/completions body -> Request (RequestError naming the bad field)."""
    req = _common(body, defaults, chat=True)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty list", "messages", code="invalid_type")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object", where, code="invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
        req.messages.append({"role": role, "content": _content(m.get("content"), where, role)})
    if defaults.system_prompt and not any(m["role"] == "system" for m in req.messages):
        req.messages.insert(0, {"role": "system", "content": defaults.system_prompt})
    return req


def _content(c: Any, where: str, role: str) -> str:
    if c is None and role == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: text only
        texts = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise RequestError(
                    f"'{where}.content[{j}]' must be a text part",
                    f"{where}.content",
                    code="invalid_type",
                )
            if not isinstance(part.get("text"), str):
                raise RequestError(
                    f"'{where}.content[{j}].text' must be a string", f"{where}.content"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(
        f"'{where}.content' must be a string or a list of text parts",
        f"{where}.content",
        code="invalid_type",
    )


def parse_completion(body: Any, defaults: Defaults) -> Request:
    """A /v1/completions body -> Request; `prompt` is a string or a list of token ids."""
    req = _common(body, defaults, chat=False)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    ok = isinstance(p, str) or (
        isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
    )
    if not ok:
        raise RequestError(
            "'prompt' must be a string or a list of token ids (one prompt per request)",
            "prompt",
            code="invalid_type",
        )
    if not p:
        raise RequestError("'prompt' is empty", "prompt")
    req.prompt = p
    return req


def encode(req: Request, tokenizer, defaults: Defaults, vocab_size: int) -> list[int]:
    """The prompt's token ids: chat messages through the chat template (as `generate`)."""
    if not req.chat:
        if isinstance(req.prompt, str):
            return list(tokenizer.encode(req.prompt))
        if any(not 0 <= t < vocab_size for t in req.prompt):
            raise RequestError(f"'prompt' token ids must be in [0, {vocab_size})", "prompt")
        return list(req.prompt)
    if defaults.use_chat_template and tokenizer.has_chat_template:
        try:
            ids = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
        except Exception as e:  # the template may reject e.g. a role order
            raise RequestError(
                f"the chat template rejected the messages: {e}", "messages"
            ) from None
        return list(ids)
    return list(tokenizer.encode("\n".join(m["content"] for m in req.messages)))


def fit(req: Request, n_prompt: int, context: int) -> None:
    """400 when the prompt leaves no room in the context; else lower max_tokens to fit."""
    if n_prompt >= context:
        raise RequestError(
            f"the prompt is {n_prompt} tokens, but the model's context is {context} tokens: "
            "no room to generate",
            "messages" if req.chat else "prompt",
            code="context_length_exceeded",
        )
    req.params.max_tokens = min(req.params.max_tokens, context - n_prompt)
