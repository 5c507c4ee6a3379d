"""The tool-call splitter on its own: text and calls of each format, streamed in any
pieces the same as whole (conversation/tool_calls.py; served: tests/test_serve_tools.py)."""

from __future__ import annotations

import json

import pytest

from llama_tp.conversation.tool_calls import FORMATS, ToolFormat, ToolStream

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
OURS = {"json_tools": "hermes", "mistral": "mistral_json"}  # mlx-lm's names -> ours


def _format(kind: str) -> ToolFormat:
    return FORMATS[OURS.get(kind, kind)]


REPLIES = {  # what each family's model writes for CALL (and twice, where it can)
    "json_tools": "Let me check.\n<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>",
    "mistral": "[TOOL_CALLS][" + json.dumps(CALL) + "]",
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
}


def _split(fmt: ToolFormat, reply: str, step: int) -> tuple[str, list]:
    s = ToolStream(fmt, None)
    text = "".join(s.feed(reply[i : i + step]) for i in range(0, len(reply), step))
    rest, calls = s.finish()
    return text + rest, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in calls]  # fmt: skip


@pytest.mark.parametrize("kind", sorted(REPLIES))
def test_each_format_gives_its_call_streamed_in_any_pieces(kind):
    fmt = _format(kind)
    whole = _split(fmt, REPLIES[kind], len(REPLIES[kind]))
    assert whole[1] == [("get_weather", {"city": "Paris"})]
    assert whole[0] == ("Let me check.\n" if kind == "json_tools" else "")
    for step in (1, 2, 3, 7):
        assert _split(fmt, REPLIES[kind], step) == whole


@pytest.mark.parametrize("kind", sorted(REPLIES))
def test_text_without_a_call_stays_text(kind):
    fmt = _format(kind)
    for reply in ("Paris is sunny.", "<tool", "{not json", "a <tool_call> b"):
        assert _split(fmt, reply, 1) == (reply, [])


def test_hermes_streams_the_text_before_a_call_at_once():
    s = ToolStream(_format("json_tools"), None)
    assert s.feed("Sure. <tool") == "Sure. "  # "<tool" may start a call: held back
    assert s.feed("_call>\n{") == ""
    assert s.feed('"name": "f", "arguments": {}}\n</tool_call>') == ""
    assert s.finish()[0] == "" and s.finish()[1] == []  # finished once
