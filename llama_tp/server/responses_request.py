"""The Responses API's requests (POST /v1/responses) as OpenAI chat bodies.

`chat_body(data, store)` turns a Responses body into the chat body asking the same: the
conversation of `previous_response_id` (server/response_store.py) and then `input` (a
string, or items: server/responses_items.py) become `messages`, `instructions` the
system message that opens them (with the system and developer messages that open the
input: templates read one); flat function `tools` become OpenAI's nested ones,
`tool_choice` the chat route's (an "allowed_tools" choice narrows the tools),
`max_output_tokens` `max_tokens`, `text.format` `response_format`, `reasoning.effort`
`reasoning_effort`; fields the chat route takes beyond OpenAI's (`seed`, `top_k`,
`chat_template_kwargs`, ...) pass on as given.

The body returned carries its `Turn`: the conversation the store keeps, the fields the
response object repeats. A bad body is a RequestError naming the field as OpenAI does;
built-in tools (web_search, file_search, mcp, ...), background responses, conversations
and stored prompts are refused by name, and `previous_response_id` when the store does
not hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .bodies import validate
from .errors import RequestError
from .response_store import ResponseStore, Stored
from .responses_items import FIELDS, merge_system, messages, named, refuse

# Fields a chat body takes beyond the Responses API's (llama_tp's and vLLM's extensions),
# passed on as given: the chat route checks them and names them alike.
EXTRAS = (
    "seed",
    "top_k",
    "min_p",
    "stop",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "repetition_context_size",
    "num_draft_tokens",
    "chat_template_kwargs",
    "reasoning_budget_tokens",
    "thinking_budget_tokens",
)
# Efforts beyond the chat route's highest ("high") ask for its highest.
EFFORTS = {"xhigh": "high", "max": "high"}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # e.g. user, service_tier


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # the model's own: ignored


Summary = Literal["auto", "concise", "detailed"]


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Summary | None = None
    generate_summary: Summary | None = None  # the older name of `summary`


class ResponsesBody(_Body):
    model: str | None = None  # one model is served: any name is taken
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None  # ranges: the chat route's, named alike
    top_p: float | None = None
    top_logprobs: int | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    include: list[str] | None = None  # what to add to the answer: ours holds it all
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


_FIELDS = (
    FIELDS
    | {"schema"}
    | {
        n
        for m in (FunctionTool, TextFormat, TextConfig, ReasoningConfig, ResponsesBody)
        for n in m.model_fields
    }
)


@dataclass
class Turn:
    """What a request's answer needs besides the chat completion: the conversation it
    extends (the previous response's items, then this input's), the fields the response
    object repeats, and the answer's options."""

    items: tuple[dict[str, Any], ...]
    echo: dict[str, Any]
    stream: bool = False
    store: bool = True
    summary: bool = False  # reasoning asked as a summary too (`reasoning.summary`)
    previous: Stored | None = None


class ChatBody(dict):
    """An OpenAI chat body that carries the `turn` of the Responses request it came from."""

    turn: Turn


def chat_body(data: Any, store: ResponseStore) -> ChatBody:
    """A Responses body -> the OpenAI chat body asking the same (RequestError naming the
    field of a bad one, or a `previous_response_id` the store does not hold)."""
    b = validate(ResponsesBody, data, named((), _FIELDS))
    for name, why in (
        ("background", "background responses"),
        ("conversation", "conversations"),
        ("prompt", "stored prompts"),
    ):
        if getattr(b, name) not in (None, False):
            raise refuse((name,), f"{why} are not supported by this server")
    previous = None
    if b.previous_response_id is not None:
        previous = store.get(b.previous_response_id)
        if previous is None:
            raise RequestError(
                f"'previous_response_id': no response with id {b.previous_response_id!r} is "
                "stored (never stored, deleted, or evicted from this server's store)",
                "previous_response_id",
                code="previous_response_not_found",
            )
    given = (
        [{"type": "message", "role": "user", "content": b.input}]
        if isinstance(b.input, str)
        else list(b.input or [])
    )
    if previous is None and not given:
        raise RequestError("'input' is required (without 'previous_response_id')", "input")
    items = (*(previous.items if previous else ()), *given)
    chat = messages(items, len(items) - len(given))
    if b.instructions:
        chat.insert(0, {"role": "system", "content": b.instructions})
    out = ChatBody(messages=merge_system(chat))
    tools = _tools(b.tools or [])
    if tools:
        out["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in tools
        ]
    if b.tool_choice is not None and (tools or b.tool_choice not in ("auto", "none")):
        out["tool_choice"] = _tool_choice(b.tool_choice, out)
    if b.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = b.parallel_tool_calls
    for name, as_chat in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
    ):
        if getattr(b, name) is not None:
            out[as_chat] = getattr(b, name)
    if b.top_logprobs is not None:
        out.update(logprobs=True, top_logprobs=b.top_logprobs)
    fmt = b.text.format if b.text else None
    if fmt is not None and fmt.type != "text":
        out["response_format"] = _response_format(fmt)
    effort = b.reasoning.effort if b.reasoning else None
    if effort is not None:
        out["reasoning_effort"] = EFFORTS.get(effort, effort)
    out.update({k: data[k] for k in EXTRAS if k in data})
    if b.stream:
        out.update(stream=True, stream_options={"include_usage": True})
    summary = bool(b.reasoning and (b.reasoning.summary or b.reasoning.generate_summary))
    out.turn = Turn(items, _echo(b, tools), bool(b.stream), b.store is not False, summary, previous)
    return out


def _echo(b: ResponsesBody, tools: list[FunctionTool]) -> dict[str, Any]:
    """The request's fields the response object repeats (OpenAI's defaults where unsaid)."""
    reasoning = b.reasoning or ReasoningConfig()
    return {
        "instructions": b.instructions,
        "max_output_tokens": b.max_output_tokens,
        "metadata": b.metadata or {},
        "parallel_tool_calls": b.parallel_tool_calls is not False,
        "previous_response_id": b.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort,
            "summary": reasoning.summary or reasoning.generate_summary,
        },
        "store": b.store is not False,
        "temperature": b.temperature,
        "text": {
            "format": (
                b.text.format if b.text and b.text.format else TextFormat(type="text")
            ).model_dump(by_alias=True, exclude_none=True)
        },
        "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
        "tools": [t.model_dump() for t in tools],
        "top_logprobs": b.top_logprobs,
        "top_p": b.top_p,
        "truncation": b.truncation or "disabled",
        "user": b.user,
    }


def _tools(given: list[Any]) -> list[FunctionTool]:
    """The request's tools: function tools, each name once."""
    out, seen = [], set()
    for k, raw in enumerate(given):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            why = f"this server offers function tools only, got {kind!r}"
            raise refuse(("tools", k, "type"), why)
        tool = validate(FunctionTool, raw, named(("tools", k), _FIELDS))
        if tool.name in seen:
            raise refuse(("tools", k, "name"), f"{tool.name!r} is defined twice")
        seen.add(tool.name)
        out.append(tool)
    return out


def _tool_choice(choice: str | dict[str, Any], out: dict[str, Any]) -> str | dict[str, Any]:
    """Responses' tool_choice as the chat route's (allowed_tools narrows `out["tools"]`)."""
    if isinstance(choice, str):
        return choice
    kind, names = choice.get("type"), [t["function"]["name"] for t in out.get("tools", [])]
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        allowed = choice.get("tools")
        if not isinstance(allowed, list) or not allowed:
            raise refuse(("tool_choice", "tools"), "a list of the tools allowed is required")
        keep = set()
        for j, t in enumerate(allowed):
            name = t.get("name") if isinstance(t, dict) and t.get("type") == "function" else None
            if name not in names:
                raise refuse(
                    ("tool_choice", "tools", j),
                    f"not one of the function tools ({', '.join(names[:10])})",
                )
            keep.add(name)
        out["tools"] = [t for t in out["tools"] if t["function"]["name"] in keep]
        return choice["mode"]
    raise refuse(
        ("tool_choice",),
        "'auto', 'none', 'required', {'type': 'function', 'name': "
        "...} or {'type': 'allowed_tools', 'mode': ..., 'tools': [...]}; got "
        f"{choice!r}"[:200],
    )


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise refuse(("text", "format", "schema"), "required with type 'json_schema'")
    schema = {"name": fmt.name or "response", "schema": fmt.schema_}
    schema.update(
        {
            k: v
            for k, v in (("description", fmt.description), ("strict", fmt.strict))
            if v is not None
        }
    )
    return {"type": "json_schema", "json_schema": schema}


# The chat body's fields a Responses body's became, by their Responses names (in errors).
NAMES = {
    "messages": "input",
    "continue_final_message": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "logprobs": "top_logprobs",
}
