"""gpt-oss's harmony: a reply of messages on channels, reasoning and calls among them.

After the generation prompt `<|start|>assistant` a reply is messages, each a header and
a body, the next one after `<|start|>assistant`:

    <|channel|>analysis<|message|>I'm thinking<|end|>                          reasoning
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json
        <|message|>{"city": "Paris"}<|call|>                                     a call
    <|channel|>final<|message|>Hello!<|return|>                                 content

The recipient `to=functions.f` may also come before the channel (` to=functions.f
<|channel|>commentary json<|message|>`, as the template renders calls); a commentary
message to no one is content (a preamble); a message to another recipient (a built-in
tool) is dropped, as llama.cpp does. `openai-harmony` would read this too, but it fetches
its vocabulary from the internet when first used and reads token ids of the o200k
vocabulary; this reads the text, whatever the tokenizer.
"""

from __future__ import annotations

import re

from .base import Calls
from .json_text import json_value
from .reader import Reader, Step, literal, spaces, until

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
HEADER_LIMIT = 512
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _header(r: Reader) -> Step:
    """A message's header, to `<|message|>` (read): (channel, recipient), or None."""
    channel, recipient = "", None
    while True:
        text, stop = yield from until(r, (CHANNEL, MESSAGE), limit=HEADER_LIMIT)
        if text is None or stop is None:
            return None
        found = _RECIPIENT.search(text)
        if found:
            recipient = found.group(1)
        if stop == MESSAGE:
            return channel, recipient
        if channel:  # a header that starts again (`<|channel|>commentary to=assistant`)
            recipient = None
        word, _ = yield from _word(r)
        channel = word


def _word(r: Reader) -> Step:
    """The channel's name: letters to the next space or tag (unread)."""
    while True:
        i = r.pos
        while i < len(r.buf) and (r.buf[i].isalnum() or r.buf[i] in "_-"):
            i += 1
        if i < len(r.buf) or r.eof:
            word, r.pos = r.buf[r.pos : i], i
            return word, None
        yield


def harmony(r: Reader, calls: Calls, tools: list) -> Step:
    """The harmony reply's parser: reasoning, content and calls (module docstring)."""
    while True:
        yield from spaces(r)
        if r.pos >= len(r.buf) and r.eof:
            return
        yield from literal(r, START + "assistant")
        r.mark = r.pos
        header = yield from _header(r)
        if header is None:  # not a header: the rest of this message is content
            calls.rollback()
            _, stop = yield from until(r, ENDS + (START,), calls.content)
            if stop == START:
                r.pos -= len(START)
            if stop is None:
                return
            continue
        r.mark = None
        channel, recipient = header
        if recipient and recipient.startswith("functions."):
            yield from spaces(r)
            calls.start(recipient.removeprefix("functions."))
            if (yield from json_value(r, calls.args, "{")) is None:
                calls.end()
                yield from until(r, ENDS)
                continue
            calls.end()
            yield from spaces(r)
            yield from until(r, ENDS)  # the end of the call's message
            continue
        out = None
        if recipient is None or recipient == "assistant":
            out = calls.reasoning if channel == "analysis" else calls.content
        _, stop = yield from until(r, ENDS + (START,), out)
        if stop == START:  # a message left open
            r.pos -= len(START)
        if stop is None:
            return
