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
