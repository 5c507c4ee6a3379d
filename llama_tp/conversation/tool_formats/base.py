"""What every tool-call format is made of, and the splitter that runs one over a reply.

A `ToolFormat` describes one way models write calls: its name, the template text (and
vocabulary) that shows it, its parser (a generator over `reader.Reader` that reports what
it reads to a `Calls`), the grammar of a forced call (`lark.py`), and how its call ids look.
`ReplySplitter` feeds a reply through a format's parser as it streams:

    split = ReplySplitter(fmt, tools)
    delta = split.feed(text)      # ReplyDelta: content now, call deltas (arguments as written)
    delta = split.finish()        # the rest; split.tool_calls(): OpenAI's `tool_calls`

Text that may begin a call is held back until it is a call or is not. A call is certain
(`Calls.start`, and its deltas are sent) once its name and the start of its arguments
are read; until then text that stops being a call is content again, so a malformed call
stays content, streamed or not. Parsing a whole reply is `feed` then `finish`: the same
path, so a streamed reply gives the same content and calls whatever its pieces.
"""

from __future__ import annotations

import hashlib
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .reader import Reader, Step, one_of, spaces, until

Parser = Callable[[Reader, "Calls", list], Step]


@dataclass
class ReplyDelta:
    """One piece of a reply, split: reasoning, content, and the calls' deltas (OpenAI's
    `delta.tool_calls` entries). The contract's `conversation/reply.py` `ReplyDelta`:
    defined here, beneath `tool_calls.py`, which reply.py imports (reply.py can take it
    from `tool_calls`, one class)."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def __add__(self, other: ReplyDelta) -> ReplyDelta:
        return ReplyDelta(
            self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls
        )


@dataclass(frozen=True)
class ToolFormat:
    """One way of writing tool calls (see the module's docstring). `markers`: template text
    that shows it (all of them, and none of `unless`); `tokens`: vocabulary entries that
    show it in a tokenizer whose template does not; `start`/`end`: the text a call begins
    and ends with (for readers that want them); `grammar(spell, functions, parallel)`: the
    Lark rules of the forced call(s), whose rule `calls` is the reply (None: not forced);
    `short_ids`: ids of 9 letters and digits (Mistral's templates insist on them);
    `reasoning`: the format carries the reply's reasoning too (gpt-oss's harmony)."""

    name: str
    parse: Parser
    grammar: Callable[[Any, list[dict], bool], str] | None = None
    markers: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    tokens: tuple[str, ...] = ()
    start: str = ""
    end: str = ""
    short_ids: bool = False
    reasoning: bool = False

    @property
    def kind(self) -> str:  # the name the first tool_calls.py used
        return self.name

    def shown_by(self, template: str) -> bool:
        """Whether a chat template's text teaches this format."""
        return (
            bool(self.markers)
            and all(m in template for m in self.markers)
            and not any(u in template for u in self.unless)
        )

    def in_vocabulary(self, vocab: Any) -> bool:
        """Whether a vocabulary holds this format's own tokens."""
        return bool(self.tokens) and all(t in vocab for t in self.tokens)


class Calls:
    """What a parser finds in a reply, kept as the `ReplyDelta` to hand on next and as the
    complete calls (id, name, arguments' pieces)."""

    def __init__(self, r: Reader, new_id: Callable[[int], str]):
        self.r, self.new_id = r, new_id
        self.delta = ReplyDelta()
        self.found: list[tuple[str, str, list[str]]] = []
        self.open = False

    def content(self, text: str) -> None:
        self.delta.content += text

    def reasoning(self, text: str) -> None:
        self.delta.reasoning += text

    def start(self, name: str, given_id: str | None = None) -> None:
        """A call is certain: its first delta (the text it began with is no longer held)."""
        self.r.mark = None
        i = len(self.found)
        cid = given_id or self.new_id(i)
        self.found.append((cid, name, []))
        fn = {"name": name, "arguments": ""}
        self.delta.calls.append({"index": i, "id": cid, "type": "function", "function": fn})
        self.open = True

    def args(self, text: str) -> None:
        """A piece of the open call's arguments (JSON text, as written)."""
        if not text or not self.found:
            return
        i = len(self.found) - 1
        self.found[i][2].append(text)
        last = self.delta.calls[-1] if self.delta.calls else None
        if last is not None and last["index"] == i:
            last["function"]["arguments"] += text
        else:
            self.delta.calls.append({"index": i, "function": {"arguments": text}})

    def end(self) -> None:
        self.open = False

    def rollback(self) -> None:
        """The text from `r.mark` was not a call: it is content."""
        if self.r.mark is not None:
            self.content(self.r.buf[self.r.mark : self.r.pos])
            self.r.mark = None

    def take(self) -> ReplyDelta:
        delta, self.delta = self.delta, ReplyDelta()
        return delta


def call_ids(prefix: str | None, short: bool) -> Callable[[int], str]:
    """Call k's id: `prefix` and k (the same on every rank), else random; with `short`,
    9 letters and digits (from `prefix` and k when given)."""
    alphabet = string.ascii_letters + string.digits

    def new_id(k: int) -> str:
        if short:
            if prefix:
                digest = hashlib.sha256(f"{prefix}{k}".encode()).digest()
                return "".join(alphabet[b % len(alphabet)] for b in digest[:9])
            return "".join(secrets.choice(alphabet) for _ in range(9))
        return f"{prefix}{k}" if prefix else f"call_{secrets.token_hex(12)}"

    return new_id


class ReplySplitter:
    """A reply split by `fmt` into reasoning (formats that carry it), content and calls
    (see the module's docstring); `tools`: the request's (OpenAI definitions), whose
    parameters type the values of formats that write them as text."""

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None = None, prefix: str | None = None):
        self.fmt = fmt
        self.r = Reader()
        self.calls = Calls(self.r, call_ids(prefix, fmt.short_ids))
        self._parser: Step | None = fmt.parse(self.r, self.calls, tools or [])
        self._run()

    def feed(self, text: str) -> ReplyDelta:
        """The pieces `text` completes."""
        if text:
            self.r.add(text)
            self._run()
        return self.calls.take()

    def finish(self) -> ReplyDelta:
        """The rest, the reply being complete (a call cut short ends where it stopped)."""
        self.r.eof = True
        for _ in range(1000):  # a parser at the reply's end does not wait
            if self._parser is None:
                break
            self._run()
        self.calls.rollback()
        self.calls.end()
        return self.calls.take()

    def tool_calls(self) -> list[dict]:
        """The calls found so far, as OpenAI's `message.tool_calls`."""
        return [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": "".join(a)}}
            for cid, name, a in self.calls.found
        ]

    def _run(self) -> None:
        if self._parser is None:
            return
        try:
            next(self._parser)
        except StopIteration:
            self._parser = None
            self.calls.content(self.r.rest())  # a parser that is done leaves text
            self.r.pos = len(self.r.buf)


# -- the shape most formats share: content, then sections of calls between markers ------

Section = Callable[[Reader, Calls, list, str], Step]


def content(r: Reader, calls: Calls, starts: tuple[str, ...], after_call: bool) -> Step:
    """Content up to the first of `starts` (read; returned), or to the end (None). Just
    after a call, whitespace before another call or the end is dropped."""
    if after_call:
        gap = yield from spaces(r)
        stop = yield from one_of(r, starts)
        if stop is not None or r.pos >= len(r.buf):
            return stop
        calls.content(gap)
    _, stop = yield from until(r, starts, calls.content)
    return stop


def marked(starts: tuple[str, ...], section: Section) -> Parser:
    """A parser of content with calls in sections that begin with one of `starts`:
    `section(r, calls, tools, start)` reads one (a call it reads is certain once it calls
    `calls.start`; while `r.mark` is set its text may still be content) and returns
    whether it read calls."""

    def parse(r: Reader, calls: Calls, tools: list, after: bool = False) -> Step:
        while True:
            stop = yield from content(r, calls, starts, after)
            if stop is None:
                return
            r.mark = r.pos - len(stop)
            after = yield from section(r, calls, tools, stop)
            calls.end()
            if r.mark is not None:
                calls.rollback()
                after = False

    return parse


def name_ok(name: str | None) -> bool:
    """A function's name as formats write it (no markup, no spaces)."""
    return bool(name) and not any(c.isspace() or c in '<>{}[]"' for c in name)


def skip_to(r: Reader, ends: tuple[str, ...]) -> Step:
    """Drop what is left of a call that broke off, to the first of `ends` (read)."""
    yield from until(r, ends)
