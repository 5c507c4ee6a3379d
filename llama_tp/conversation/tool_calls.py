"""A reply's tool calls, in the format the model's chat template teaches.

The formats themselves (Hermes JSON, Qwen3-Coder's XML, DeepSeek's, Kimi's, GLM's,
MiniMax's, harmony, Llama's, Gemma's, Mistral's, Nemotron's) are described in
`tool_formats/`; this is what the server (`server/tools.py`, `server/app.py`) and `Chat`
use of them. `tool_format` finds a model's format (its family's row, then the template
and vocabulary). `ToolStream` splits a reply into text and calls as it streams, holding
back what may be a call, so a reader sees either text or a call, and the calls' deltas
with their arguments as they are written. `forced_call_grammar` is the grammar
(llguidance) of a reply that must call a tool (`tool_choice` "required" or a named
function): one call in that format, or several, its arguments following the function's
`parameters` schema; `ForcedCallError` when the format is unknown or cannot be forced.
"""

from __future__ import annotations

import weakref
from typing import Any

from .tool_formats import FORMATS, ReplyDelta, ReplySplitter, ToolFormat, detect, template_text
from .tool_formats.lark import Spell

__all__ = [
    "FORMATS",
    "ForcedCallError",
    "ReplyDelta",
    "ReplySplitter",
    "ToolFormat",
    "ToolStream",
    "forced_call_grammar",
    "json_after_reasoning",
    "tool_format",
]


_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {type: fmt}


def tool_format(tokenizer: Any, model_type: str | None = None) -> ToolFormat | None:
    """The format `tokenizer`'s template teaches (the `model_type` family's first), or
    None (`tool_formats.detect`; found once per tokenizer and family: every request with
    tools asks)."""
    try:
        found = _FOUND.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: found each time
        return detect(tokenizer, model_type)
    if model_type not in found:
        found[model_type] = detect(tokenizer, model_type)
    return found[model_type]


class ToolStream:
    """A reply's text, split into content and tool calls as it streams.

    `feed(text)` returns the content that can be sent now (text that may be the start
    of a call is held back); `deltas()` the calls' deltas since it was last asked
    (OpenAI's `delta.tool_calls` entries, the arguments as the model writes them);
    `finish()` the rest of the content and every call (OpenAI's `tool_calls` entries),
    once. A call that does not parse stays content. A call the model gives no id gets
    `prefix` and its number ("call_0"), or a random one. A format that carries the
    reply's reasoning (harmony) keeps it in `reasoning`.
    """

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None, prefix: str | None = None):
        self.fmt, self.tools = fmt, tools
        self._split = ReplySplitter(fmt, tools, prefix)
        self._deltas: list[dict] = []
        self.reasoning = ""
        self._done = False

    def feed(self, text: str) -> str:
        return self._take(self._split.feed(text))

    def deltas(self) -> list[dict]:
        out, self._deltas = self._deltas, []
        return out

    def finish(self) -> tuple[str, list[dict]]:
        if self._done:
            return "", []
        self._done = True
        return self._take(self._split.finish()), self._split.tool_calls()

    def _take(self, delta) -> str:
        self._deltas += delta.calls
        self.reasoning += delta.reasoning
        return delta.content


class ForcedCallError(ValueError):
    """A forced call this model cannot be held to (its format unknown or not forceable)."""


def forced_call_grammar(
    tools: list[dict] | None,
    choice: Any,
    tokenizer: Any,
    model_type: str | None = None,
    *,
    parallel: bool = True,
    think_end: str | None = None,
) -> str | None:
    """The grammar of a reply of `tools`' calls (OpenAI's definitions) in the model's
    format, for `choice` (OpenAI's tool_choice): a named function, one call of it;
    "required", one call, or (`parallel`, OpenAI's `parallel_tool_calls`) one or more
    (as vLLM's guided decoding has them). `think_end`: the
    reply starts inside a reasoning block the prompt opened: free text without it, it,
    optional whitespace, then the calls. None for "auto" and "none"; ForcedCallError
    when the model's format is unknown or has no grammar."""
    from ..engine.grammar import lark_grammar

    if choice in ("auto", "none", None) or not tools:
        return None
    fmt = tool_format(tokenizer, model_type)
    if fmt is None or fmt.grammar is None:
        shown = "no tool-call format llama_tp knows" if fmt is None else f"the format {fmt.name}"
        known = ", ".join(FORMATS)
        why = "" if fmt is None else ", which llama_tp reads but cannot force"
        where = "this model's chat template" if template_text(tokenizer) else "this model"
        raise ForcedCallError(
            f"{where} has {shown}{why} (known: {known}): a call cannot be forced; "
            "use tool_choice 'auto'"
        )
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        fns = [f for f in fns if f["name"] == choice["function"]["name"]]
        parallel = False
    sp = Spell(tokenizer)
    calls = fmt.grammar(sp, fns, parallel)
    if think_end and not fmt.reasoning:  # (harmony's grammar has its analysis channel)
        calls = _after_reasoning(sp, think_end, calls)
    return lark_grammar(sp.grammar(calls))


def json_after_reasoning(schema: dict, tokenizer: Any, think_end: str) -> str:
    """The grammar of a reply that starts inside the reasoning block the prompt opened
    (free text without `think_end`, then it) and then writes JSON following `schema`
    (`response_format`: the answer follows the schema, the reasoning is free)."""
    from ..engine.grammar import lark_grammar

    sp = Spell(tokenizer)
    return lark_grammar(sp.grammar(_after_reasoning(sp, think_end, sp.json(schema))))


def _after_reasoning(sp: Spell, think_end: str, then: str) -> str:
    """The Lark of free reasoning text to `think_end`, a little whitespace (the templates
    write "\n\n" there; more would let a model pad forever), then `then`."""
    sp.rules.append(r"WS: /[ \t\r\n]{1,4}/")
    return f"{sp.text_until(think_end)} WS? {then}"
