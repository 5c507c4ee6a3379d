"""Tool calling in `Chat` (conversation/chat.py): the turns of a conversation with tools.

`Chat(model, tokenizer, tools=[...])` shows OpenAI-style function definitions to the
chat template (transformers' `tools=`); a reply's calls, in the format the template
teaches (`conversation/tool_calls.py`, the server's parsers), are kept out of the text the
reply yields and land in `chat.last_tool_calls` and in the history's assistant message
(`tool_calls`, arguments as dicts: what templates render). `send_tool_result(call,
result)` answers a call with a role "tool" message and returns the model's next reply;
`add_tool_result` answers one without a reply yet (several calls in one turn).
`tool_choice="required"` or a function's name constrains a reply to one call, as the
server's `tool_choice` does (ValueError when the model's format is unknown).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from .tool_calls import ToolStream, forced_call_grammar, tool_format


class ChatTools:
    """The tool-calling part of `Chat` (its `history`, `tools`, `_reply`, `_grammar_mask`)."""

    tools: list[dict] | None
    history: list[dict]
    last_tool_calls: list[dict]
    _turn: int

    def add_tool_result(self, call: str | dict, result: Any) -> None:
        """Answer one of the last reply's calls (its id, its function's name, or the call
        itself) with `result` (a str, or anything JSON can write): a role "tool" message."""
        self.history.append(self._tool_message(call, result))

    def send_tool_result(self, call: str | dict, result: Any, **kw: Any) -> str:
        """`add_tool_result`, then the model's whole next reply (see `stream_tool_result`)."""
        return "".join(self.stream_tool_result(call, result, **kw))

    def stream_tool_result(self, call: str | dict, result: Any, **kw: Any) -> Iterator[str]:
        """Answer `call` with `result` and yield the model's next reply as it is decoded
        (the keywords of `Chat.stream`: should_stop, schema, tool_choice)."""
        message = self._tool_message(call, result)
        yield from self._reply([message], **kw)

    def _tool_message(self, call: str | dict, result: Any) -> dict:
        calls = next((m["tool_calls"] for m in reversed(self.history) if m.get("tool_calls")), [])
        key = call.get("id") if isinstance(call, dict) else call
        found = next((c for c in calls if c.get("id") == key), None) or next(
            (c for c in calls if c["function"]["name"] == key), None
        )
        if found is None:
            known = ", ".join(f"{c.get('id')} ({c['function']['name']})" for c in calls)
            raise ValueError(f"no tool call {key!r} to answer; the last calls: {known or 'none'}")
        content = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
        return {
            "role": "tool",
            "tool_call_id": found.get("id"),
            "name": found["function"]["name"],
            "content": content,
        }

    def _grammar_mask(self, grammar: str):
        """The logits processor that keeps replies in `grammar` (a tool call's, or a JSON
        schema's: `send(schema=...)`)."""
        from ..engine.grammar import GrammarMask, check_grammar

        size = self.model.args.vocab_size
        check_grammar(grammar, self.tokenizer, size, self._renderer.eos)
        return GrammarMask(grammar, self.tokenizer, size, self._renderer.eos)

    def _tool_processors(self, tool_choice: str | None) -> list:
        """The grammar mask of a reply that must call a tool (`tool_choice` "required" or
        a function's name), or none."""
        if tool_choice in (None, "auto", "none"):
            return []
        if not self.tools:
            raise ValueError("tool_choice needs tools: Chat(..., tools=[...])")
        names = [t["function"]["name"] for t in self.tools]
        if tool_choice != "required":
            if tool_choice not in names:
                raise ValueError(f"tool_choice {tool_choice!r} is not one of the tools {names}")
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        grammar = forced_call_grammar(
            self.tools, tool_choice, self.tokenizer, self._model_type(), parallel=False
        )
        if grammar is None:
            raise ValueError("this model's chat template has no tool-call format to force")
        return [self._grammar_mask(grammar)]

    def _tool_stream(self, tool_choice: str | None) -> ToolStream | None:
        """The splitter of a reply into text and calls (None: no tools this turn)."""
        use = self.tools and tool_choice != "none"
        fmt = tool_format(self.tokenizer, self._model_type()) if use else None
        # Ids the same on every rank (the history, which templates may render, must be).
        prefix = f"call_{self._turn}_"
        return ToolStream(fmt, self.tools, prefix) if fmt is not None else None

    def _model_type(self) -> str | None:
        """The model's family (its row names the tool-call formats to look for first)."""
        return getattr(getattr(self.model, "args", None), "model_type", None)

    def _keep_calls(self, message: dict, text: str, calls: list[dict]) -> None:
        """The reply `message` as its text and the calls parsed from it."""
        self.last_tool_calls = [
            {**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in calls
        ]
        if self.last_tool_calls:
            message["content"] = text
            message["tool_calls"] = self.last_tool_calls


def _arguments(call: dict) -> Any:
    args = call["function"]["arguments"]
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args
