"""A validated request's prompt: its tokens through the one prompt renderer (with the
template's variables), its fit to the model's context, and the grammar it asks for
(`response_format`, or a forced tool call in the family's format, after the reasoning
block the prompt opened)."""

from __future__ import annotations

from ..checkpoints.chat_template import ChatTemplateError
from ..engine.grammar import GrammarError, json_schema_grammar
from . import reasoning
from . import tools as tool_calls
from .errors import RequestError
from .limits import Limits
from .protocol import Request


def prompt_tokens(req: Request, renderer) -> tuple[list[int], tuple[str, ...]]:
    """The prompt's token ids, and the stop strings its rendering adds: chat messages
    through the one prompt renderer (as `generate` and `Chat` render them). Token ids
    were checked against the vocabulary with the request (`Limits.check`)."""
    if req.chat:
        try:
            tokenizer = renderer.tokenizer
            kwargs = reasoning.template_kwargs(
                tokenizer, req.template_defaults, req.reasoning_effort, req.template_kwargs
            )
            ids = renderer.encode(
                req.messages, req.tools, req.continue_final, req.add_generation_prompt, **kwargs
            )
            return ids, renderer.stops
        except ChatTemplateError as e:  # the template may reject e.g. a role order
            field_ = "continue_final_message" if req.continue_final else "messages"
            raise RequestError(
                f"the chat template rejected the messages: {e}"[:500], field_
            ) from None
    if isinstance(req.prompt, str):
        return list(renderer.tokenizer.encode(req.prompt)), ()
    return list(req.prompt), ()


def grammar_for(
    req: Request,
    tokenizer,
    limits: Limits | None = None,
    model_type: str | None = None,
    think_end: str | None = None,
) -> tuple[str, str] | None:
    """(the llguidance grammar `response_format` or a required tool call asks for, the
    field that asks), or None; 400 naming the field when its schema is too large or not
    one a grammar can be made of, or when the model's tool-call format (its family's,
    `model_type`, or its template's) is unknown: a forced call is never dropped.
    `think_end`: the prompt opened a reasoning block the reply closes with it before the
    call or the JSON. Compiling it is the caller's (`engine.grammar`)."""
    fmt, field_ = req.response_format, "response_format"
    try:
        if fmt is not None and fmt.type in ("json_object", "json_schema"):
            if fmt.type == "json_object":
                schema: dict = {"type": "object"}
            elif fmt.json_schema is None:
                raise GrammarError("'json_schema' is required with type 'json_schema'")
            else:
                schema = fmt.json_schema.schema_
                if limits is not None:
                    limits.check_schema(schema, field_)
            if think_end:  # the answer follows the schema, after the reasoning
                return tool_calls.json_after_reasoning(schema, tokenizer, think_end), field_
            return json_schema_grammar(schema), field_
        if req.tools and req.tool_choice not in ("auto", "none"):
            field_ = "tools"  # a function's parameters: the schema of a forced call
            fns = [t["function"] for t in req.tools]
            if isinstance(req.tool_choice, dict):  # one named function
                fns = [f for f in fns if f["name"] == req.tool_choice["function"]["name"]]
            if limits is not None:
                limits.check_schema([f.get("parameters") for f in fns], field_)
            grammar = tool_calls.forced_call_grammar(
                req.tools,
                req.tool_choice,
                tokenizer,
                model_type,
                parallel=req.parallel_tool_calls,
                think_end=think_end,
            )
            return (grammar, field_) if grammar is not None else None
    except tool_calls.ForcedCallError as e:
        raise RequestError(f"'{field_}': {e}", field_) from None
    except GrammarError as e:
        raise RequestError(f"'{field_}' cannot be compiled into a grammar: {e}", field_) from None
    return None


def fit(req: Request, n_prompt: int, context: int) -> None:
    """400 when the prompt leaves no room in the context; else lower max_tokens to fit."""
    if n_prompt >= context:
        raise RequestError(
            f"the prompt is {n_prompt} tokens, but the model's context is {context} tokens: "
            "no room to generate",
            "messages" if req.chat else "prompt",
            code="context_length_exceeded",
        )
    req.params = req.params.but(max_tokens=min(req.params.max_tokens, context - n_prompt))
