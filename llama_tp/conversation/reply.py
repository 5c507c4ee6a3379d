"""A reply as the client reads it: reasoning, content and tool calls, split as it streams.

`ReplyDelta` is what one piece of a streamed reply becomes: the reasoning text (the
model's thinking, which OpenAI's chat route sends as `reasoning_content`), the content
(the answer) and the tool calls' deltas (OpenAI's `delta.tool_calls` entries: each with
its `index`; the first of a call also with its `id`, `type` and `function.name`, every
one with a fragment of `function.arguments`, the fragments of a call joined being its
arguments' JSON text).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .reasoning import Markers, ReasoningSplit
from .tool_calls import ToolFormat, ToolStream


@dataclass
class ReplyDelta:
    """One piece of a reply, split (see the module's docstring)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __add__(self, other: ReplyDelta) -> ReplyDelta:
        return ReplyDelta(
            self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls
        )


class ReplyStream:
    """One reply, split as it streams: its reasoning by `markers` (the reply starting
    inside the block when the prompt `opened` it), its content's tool calls by `fmt`
    (`tool_calls.ToolStream`: `tools` the request's, `prefix` its calls' ids). A tool
    call's start marker also ends an unclosed reasoning block."""

    def __init__(
        self,
        markers: Markers | None,
        opened: bool,
        fmt: ToolFormat | None = None,
        tools: list[dict] | None = None,
        prefix: str | None = None,
    ):
        ends = (fmt.start,) if fmt is not None and fmt.start else ()
        self.thinking = ReasoningSplit(markers, opened, ends) if markers is not None else None
        self.calls = ToolStream(fmt, tools, prefix) if fmt is not None else None
        self.tool_calls: list[dict] = []  # the reply's complete calls, once finished

    def feed(self, text: str) -> ReplyDelta:
        """The split of `text`, as far as it can be told now."""
        reasoning, content = self.thinking.feed(text) if self.thinking else ("", text)
        return ReplyDelta(reasoning, *self._content(content))

    def finish(self) -> ReplyDelta:
        """The rest of the reply, held back until its end (the calls complete)."""
        reasoning, content = self.thinking.finish() if self.thinking else ("", "")
        out = ReplyDelta(reasoning, *self._content(content))
        if self.calls is not None:
            rest, self.tool_calls = self.calls.finish()
            out.content += rest
            out.calls += self._deltas(self.tool_calls)
        return out

    def _content(self, text: str) -> tuple[str, list[dict]]:
        if self.calls is None or not text:
            return text, []
        return self.calls.feed(text), self._deltas()

    def _deltas(self, finished: list[dict] | None = None) -> list[dict]:
        """The calls' deltas since the last ones (a format that streams its arguments
        gives them as written; else each call whole once the reply ends)."""
        deltas = getattr(self.calls, "deltas", None)
        if deltas is not None:
            return deltas()
        return [{"index": i, **c} for i, c in enumerate(finished or [])]
