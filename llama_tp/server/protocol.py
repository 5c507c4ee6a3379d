"""The OpenAI request formats: strict pydantic models, translated to the engine's request.

Nothing here knows about HTTP or ranks. `ChatBody` and `CompletionBody` are the
request bodies (strict: a string is not a number, a float not an integer);
`parse_chat` / `parse_completion` turn a decoded body (server/bodies.py) into a
`Request` whose settings are the engine's validated `SamplingParams`, held to the
model's `Limits` (server/limits.py); its prompt tokens, its fit to the context and
the grammar it asks for are server/prompts.py's. A validation error becomes a
`RequestError` naming OpenAI's `param` (`validation_error`). What is sent back is
built in `responses.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..engine.settings import MAX_INDEX, SamplingParams, SettingsError
from . import reasoning
from . import tools as tool_calls
from .bodies import openai_param, validate
from .errors import RequestError, error_body  # noqa: F401 (routes import both from here)
from .limits import Limits

MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
MAX_DRAFT_TOKENS = 16  # a request's num_draft_tokens (drafts checked per step)
ROLES = ("system", "developer", "user", "assistant", "tool")


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
    num_draft_tokens: int = 0  # --num-draft-tokens: for requests that do not say
    # --chat-template-args: template variables under every request's (server/reasoning.py)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_budget: int = -1  # --reasoning-budget: think-block tokens (-1: no budget)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal[ROLES]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None
    # an earlier reply's reasoning handed back (vLLM's and DeepSeek's name; mlx-lm's)
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _content(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError("content is required (null only for the assistant)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: text only
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchema(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


Count = Annotated[int, Field(ge=1)]


class _Common(_Body):
    model: str | None = None
    n: Literal[1] | None = None  # one choice per request
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    # not OpenAI's, but mlx-lm's server and others take them
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    # a llama_tp extension: drafts (prompt lookup) checked per step while the request
    # decodes alone; the text is the same with or without
    num_draft_tokens: Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | None = None
    # logits processors (engine/logits_processors.py); the penalties are mlx-lm's
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    repetition_context_size: Count | None = None
    response_format: ResponseFormat | None = None
    # the think block closed after N tokens (llama.cpp's names; server/reasoning.py)
    reasoning_budget_tokens: Annotated[int, Field(ge=-1, le=MAX_INDEX)] | None = None
    thinking_budget_tokens: Annotated[int, Field(ge=-1, le=MAX_INDEX)] | None = None


class ChatBody(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[tool_calls.Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | tool_calls.NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Count | None = None
    # vLLM's: the last message left open for the model to continue (a "prefill"), or
    # the messages rendered without the assistant's generation prompt
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # reasoning (server/reasoning.py): the template's variables, the effort, a budget
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


@dataclass
class Request:
    """A validated completion request, not yet tokenized (chat: `messages`; else `prompt`)."""

    chat: bool
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    seed: int | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | list[int] = ""
    tools: list[dict] | None = None  # the tools the template shows and replies may call
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True  # a forced reply may make several calls
    response_format: ResponseFormat | None = None
    continue_final: bool = False  # the reply continues the last message (a prefill)
    add_generation_prompt: bool = True
    # reasoning (server/reasoning.py): the template's variables (the server's, the
    # request's own), the effort, the budget, and whether the prompt opened the block
    template_defaults: dict[str, Any] = field(default_factory=dict)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_effort: str | None = None
    reasoning_budget: int | None = None
    reasoning_open: bool = False


_FIELDS = (
    {
        name
        for m in (ChatBody, CompletionBody, Message, TextPart, StreamOptions, ResponseFormat)
        for name in m.model_fields
    }
    | {
        name
        for m in (
            JsonSchema,
            ToolCall,
            FunctionCall,
            tool_calls.Tool,
            tool_calls.Function,
            tool_calls.NamedChoice,
        )
        for name in m.model_fields
    }
    | {"schema"}
)


def validation_error(errors: list[dict]) -> RequestError:
    """The first of pydantic's errors as OpenAI's: `param` is the field's path
    ("messages[0].role"); pydantic's union and type tags are left out of it."""
    e = errors[0]
    param = ""
    for part in e["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _FIELDS:
            param += f".{part}" if param else part
    kind = e["type"]
    if kind in ("json_invalid", "model_attributes_type"):
        return RequestError(
            f"the body is not a valid JSON object: {e['msg']}", None, code="invalid_json"
        )
    typed = kind.endswith("_type") or kind in ("missing", "union_tag_invalid")
    msg = e["msg"]
    message = f"'{param}': {msg[:1].lower()}{msg[1:]}" if param else msg
    if "input" in e and kind != "missing":
        message += f", got {e['input']!r}"[:200]
    return RequestError(message, param or None, code="invalid_type" if typed else "invalid_value")


def parse_chat(body: Any, defaults: Defaults, limits: Limits | None = None) -> Request:
    """A decoded /v1/chat/completions body -> Request (RequestError naming the bad field),
    held to `limits` when given."""
    if limits is not None:
        limits.precheck(body, openai_param)
    req = chat_request(validate(ChatBody, body, validation_error), defaults, limits)
    if limits is not None:
        limits.check(req)
    return req


def parse_completion(body: Any, defaults: Defaults, limits: Limits | None = None) -> Request:
    """A decoded /v1/completions body -> Request (RequestError naming the bad field),
    held to `limits` when given."""
    req = completion_request(validate(CompletionBody, body, validation_error), defaults, limits)
    if limits is not None:
        limits.check(req)
    return req


def chat_request(body: ChatBody, defaults: Defaults, limits: Limits | None = None) -> Request:
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    k = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    req = _request(body, defaults, True, max_tokens, k, limits)
    depth = limits.json_depth if limits is not None else Limits.json_depth
    req.messages = [tool_calls.message(m, i, depth) for i, m in enumerate(body.messages)]
    tool_calls.choose(req, body.tools, body.tool_choice)
    req.parallel_tool_calls = body.parallel_tool_calls is not False
    _prefill(req, body)
    req.template_defaults = defaults.template_kwargs
    req.template_kwargs = reasoning.checked_kwargs(body.chat_template_kwargs)
    req.reasoning_effort = body.reasoning_effort
    if defaults.system_prompt and not any(m["role"] == "system" for m in req.messages):
        req.messages.insert(0, {"role": "system", "content": defaults.system_prompt})
    return req


def _prefill(req: Request, body: ChatBody) -> None:
    """vLLM's continue_final_message / add_generation_prompt on the request."""
    req.continue_final = bool(body.continue_final_message)
    req.add_generation_prompt = body.add_generation_prompt is not False
    if req.continue_final and body.add_generation_prompt:
        raise RequestError(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true: the "
            "reply either continues the last message or starts a new one",
            "continue_final_message",
        )
    last = body.messages[-1]
    if req.continue_final and (last.tool_calls or not last.text()):
        raise RequestError(
            f"'continue_final_message' needs text to continue: messages[{len(body.messages) - 1}]"
            + (" holds tool calls" if last.tool_calls else " has no content"),
            "continue_final_message",
        )


def completion_request(
    body: CompletionBody, defaults: Defaults, limits: Limits | None = None
) -> Request:
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise RequestError(
                f"'prompt' must be one prompt (one per request), got {len(p)}", "prompt"
            )
        p = p[0]  # a batch of one prompt
    if not p:
        raise RequestError("'prompt' is empty", "prompt")
    req = _request(body, defaults, False, body.max_tokens, body.logprobs, limits)
    req.prompt = p
    return req


def _request(
    body: _Common, defaults: Defaults, chat: bool, max_tokens, logprobs, limits: Limits | None
) -> Request:
    """The settings every route shares, as the engine's SamplingParams (held to the
    model's `limits` first, when given)."""
    if limits is not None:
        limits.check_settings(body)
    drafts = body.num_draft_tokens
    bias = _bias(body.logit_bias)
    try:
        params = SamplingParams(
            max_tokens=max_tokens or defaults.max_tokens,
            temperature=_given(body.temperature, defaults.temperature),
            top_p=_given(body.top_p, defaults.top_p),
            min_p=_given(body.min_p, defaults.min_p),
            top_k=defaults.top_k if body.top_k is None else body.top_k,
            stop=tuple(
                s for s in ([body.stop] if isinstance(body.stop, str) else body.stop or []) if s
            ),
            logprobs=logprobs,
            num_draft_tokens=defaults.num_draft_tokens if drafts is None else drafts,
            logit_bias=bias,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty or 0.0,
            penalty_context=body.repetition_context_size or 20,
        )
    except SettingsError as e:
        name = _API_NAMES.get(e.field, e.field)
        raise RequestError(e.named(f"'{name}'"), name) from None
    opts = body.stream_options
    req = Request(chat, params, bool(body.stream), bool(opts and opts.include_usage), body.seed)
    req.response_format = body.response_format
    budgets = (body.reasoning_budget_tokens, body.thinking_budget_tokens)
    req.reasoning_budget = next((b for b in budgets if b is not None), None)
    return req


# The engine's names of the settings whose API field is called otherwise.
_API_NAMES = {"penalty_context": "repetition_context_size"}


def _bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as (id, bias) pairs."""
    out = []
    for key, value in (bias or {}).items():
        # ASCII digits only ("²".isdigit() is true, and int() refuses it), and few of them
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            raise RequestError(
                f"'logit_bias' keys must be token ids, got {key!r}"[:200], "logit_bias"
            )
        out.append((int(key), float(value)))
    return tuple(out)


def _given(value: float | None, default: float) -> float:
    return default if value is None else float(value)
