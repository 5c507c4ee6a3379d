"""A reply as the client reads it: reasoning, content and tool calls, split as it streams.

`ReplyDelta` (defined with the tool formats, `tool_formats/base.py`) is what one piece of
a streamed reply becomes: the reasoning text (the model's thinking, which OpenAI's chat
route sends as `reasoning_content`), the content (the answer) and the tool calls' deltas
(OpenAI's `delta.tool_calls` entries: each with its `index`; the first of a call also
with its `id`, `type` and `function.name`, every one with a fragment of
`function.arguments`, the fragments of a call joined being its arguments' JSON text).

`ReplyStream` makes them: the reasoning split off by the family's markers
(`reasoning.ReasoningSplit`), then the content's calls by its tool format
(`tool_calls.ToolStream`). gpt-oss's harmony is one syntax for all three (channels):
its format's own splitter reads the whole reply.
"""

from __future__ import annotations

from .reasoning import Markers, ReasoningSplit
from .tool_calls import FORMATS, ReplyDelta, ReplySplitter, ToolFormat, ToolStream

__all__ = ["ReplyDelta", "ReplyStream"]


class ReplyStream:
    """One reply, split as it streams: its reasoning by `markers` (the reply starting
    inside the block when the prompt `opened` it), its content's tool calls by `fmt`
    (`tools` the request's, `prefix` its calls' ids). A tool call's start marker also
    ends an unclosed reasoning block."""

    def __init__(
        self,
        markers: Markers | None,
        opened: bool,
        fmt: ToolFormat | None = None,
        tools: list[dict] | None = None,
        prefix: str | None = None,
    ):
        self.tool_calls: list[dict] = []  # the reply's complete calls, once finished
        self.whole = None  # a format that splits the whole reply (harmony's channels)
        if (fmt is not None and fmt.reasoning) or (
            markers is not None and markers.name == "harmony"
        ):
            self.whole = ReplySplitter(
                fmt if fmt is not None else FORMATS["harmony"], tools, prefix
            )
            self.thinking = self.calls = None
            return
        ends = (fmt.start,) if fmt is not None and fmt.start else ()
        self.thinking = ReasoningSplit(markers, opened, ends) if markers is not None else None
        self.calls = ToolStream(fmt, tools, prefix) if fmt is not None else None

    def feed(self, text: str) -> ReplyDelta:
        """The split of `text`, as far as it can be told now."""
        if self.whole is not None:
            return self.whole.feed(text)
        reasoning, content = self.thinking.feed(text) if self.thinking else ("", text)
        return ReplyDelta(reasoning, *self._content(content))

    def finish(self) -> ReplyDelta:
        """The rest of the reply, held back until its end (the calls complete)."""
        if self.whole is not None:
            out = self.whole.finish()
            self.tool_calls = self.whole.tool_calls()
            return out
        reasoning, content = self.thinking.finish() if self.thinking else ("", "")
        out = ReplyDelta(reasoning, *self._content(content))
        if self.calls is not None:
            rest, self.tool_calls = self.calls.finish()
            out.content += rest
            out.calls += self.calls.deltas()
        return out

    def _content(self, text: str) -> tuple[str, list[dict]]:
        if self.calls is None or not text:
            return text, []
        return self.calls.feed(text), self.calls.deltas()
