"""A request's reasoning controls, and its reply split for the routes (rank 0 only).

Controls, every route's in the end (the Anthropic, Ollama and Responses routes set them
on the OpenAI chat body they become):

- `chat_template_kwargs`: variables for the chat template (Qwen3's `enable_thinking`,
  DeepSeek-V3.1's `thinking`, gpt-oss's `reasoning_effort`), over the server's
  `--chat-template-args`; `enable_thinking` and `thinking` stand for each other, since
  families read one or the other. Names the renderer passes itself are refused.
- `reasoning_effort`: "none" / "minimal" turn reasoning off, "low" / "medium" / "high"
  on, or set the effort where the template reads one (`reasoning.template_switches`).
- `reasoning_budget_tokens` (llama.cpp's name; `thinking_budget_tokens` too): the think
  block is closed after that many tokens (`engine.settings.ReasoningBudget`), over the
  server's `--reasoning-budget`; -1: no budget.

`ReplyParts.of(...)` then makes the splitter of one reply (`conversation.reply.ReplyStream`)
from the model's markers, whether the request's prompt opened the block, and the tools.
"""

from __future__ import annotations

from typing import Any

from ..conversation.reasoning import Markers, template_switches
from ..engine.settings import ReasoningBudget
from .errors import RequestError

# What the prompt renderer passes itself, or would change what a template is.
RESERVED = frozenset(
    (
        "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
        "tokenize", "return_dict", "return_tensors", "chat_template", "padding",
        "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
        "conversation",
    )
)  # fmt: skip
SWITCHES = ("enable_thinking", "thinking")  # the names families read for on / off


def checked_kwargs(given: dict[str, Any] | None, field: str = "chat_template_kwargs") -> dict:
    """`given` (a request's or the server's chat template variables) checked: names that
    are identifiers and not the renderer's own; the two thinking switches mirrored."""
    out = {}
    for key, value in (given or {}).items():
        if not key.isidentifier() or key in RESERVED:
            why = "is set by the server" if key in RESERVED else "is not a template variable"
            raise RequestError(f"'{field}.{key}' {why}"[:200], field)
        out[key] = value
    for a, b in (SWITCHES, SWITCHES[::-1]):
        if isinstance(out.get(a), bool) and b not in out:
            out[b] = out[a]
    return out


def template_kwargs(
    tokenizer: Any, defaults: dict, effort: str | None, given: dict
) -> dict[str, Any]:
    """The chat template's variables of one request: the server's defaults, then what
    its `reasoning_effort` switches, then its own `chat_template_kwargs`."""
    return {**defaults, **template_switches(tokenizer, None, effort), **given}


def budget(
    tokens: int | None, markers: Markers | None, tokenizer: Any, opened: bool
) -> ReasoningBudget | None:
    """The reasoning budget of `tokens` (None or -1: none) for a model with `markers`;
    none for a model that does not reason (clients such as Claude Code send a budget
    whatever the model: it answers as it would without)."""
    if tokens is None or tokens < 0 or markers is None:
        return None

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return ReasoningBudget(tokens, ids(markers.forced), ids(markers.start), opened)
