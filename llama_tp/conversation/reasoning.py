"""A reply's reasoning, told apart from its answer: each family's markers, whether the
prompt already opened the block, and the splitter that streams the two apart.

    markers = reasoning_markers(tokenizer, "qwen3")        # Markers("think", ...) or None
    opened = prompt_opens(markers, tokenizer, prompt_ids)   # the template wrote `<think>`
    split = ReasoningSplit(markers, opened)
    reasoning, content = split.feed("Let me see</th")       # ("Let me see", "")
    reasoning, content = split.feed("ink>\n\nParis.")       # ("", "Paris.")

`MARKERS` holds one description per way of marking reasoning: `<think>`...`</think>`
(Qwen3/3.5/3.6, DeepSeek-R1 and V3.1+, MiniMax, GLM, Kimi K2-Thinking, Step-3.5,
Nemotron), Mistral's `[THINK]`, Kimi K3's `<|open|>think<|sep|>` tags, Gemma 4's thought
channel and gpt-oss's harmony `analysis` channel (whose replies the harmony tool format
splits whole: reasoning, answer and calls are one syntax there). A family's registry row
names the markers its releases use (`Family.reasoning`); `reasoning_markers` takes the
first of them the tokenizer holds, else any whose markers its vocabulary and chat template
both hold, as mlx-lm infers them.

Some templates open the block in the generation prompt (DeepSeek-V3.1 with `thinking`,
Qwen3.5, MiniMax-M2, Step-3.5): the reply then starts inside it (`prompt_opens`). Others
leave it to the model (Qwen3, Gemma 4), whose reply may start with the start marker.
`ReasoningSplit` handles both, holds back text that may be the start of a marker, and
drops the whitespace around the reasoning (the templates put newlines there). A tool
call's start marker ends the reasoning too (`ends`): a call written inside an unclosed
block is still a call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from ..engine.stops import find_stop, partial_stop

TAIL = 48  # prompt tokens decoded to find whether the template opened the block


@dataclass(frozen=True)
class Markers:
    """How a family marks reasoning: between `start` and `end`, written with the
    vocabulary's `tokens` (a tokenizer without them does not write this family's
    reasoning, as mlx-lm infers it). `close`: the text a reasoning budget forces to end
    the block (default `end`)."""

    name: str
    start: str
    end: str
    tokens: tuple[str, ...]
    close: str = ""

    @property
    def forced(self) -> str:
        return self.close or self.end

    def held_by(self, tokenizer: Any) -> bool:
        """Whether `tokenizer`'s vocabulary holds the markers' tokens."""
        vocab = _vocab(tokenizer)
        return all(t in vocab for t in self.tokens)


MARKERS = {
    m.name: m
    for m in (
        Markers("think", "<think>", "</think>", ("<think>", "</think>")),
        Markers("mistral_think", "[THINK]", "[/THINK]", ("[THINK]", "[/THINK]")),
        Markers(
            "kimi_xtml",
            "<|open|>think<|sep|>",
            "<|close|>think<|sep|>",
            ("<|open|>", "<|close|>", "<|sep|>"),
        ),
        Markers("gemma4_channel", "<|channel>thought", "<channel|>", ("<|channel>", "<channel|>")),
        # (a budget forces `<|end|>` alone: the model opens the next channel, the final
        # answer's or a call's, as a forced call's grammar allows)
        Markers(
            "harmony",
            "<|channel|>analysis<|message|>",
            "<|end|>",
            ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"),
        ),
    )
}
_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocab(tokenizer: Any) -> frozenset[str]:
    """The token strings of `tokenizer` (read once: a release's vocabulary is large)."""
    try:
        return _VOCABS[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = frozenset(tokenizer.get_vocab())
    try:
        _VOCABS[tokenizer] = vocab
    except TypeError:  # not weakly referenceable: read each time
        pass
    return vocab


def reasoning_markers(tokenizer: Any, model_type: str | None = None) -> Markers | None:
    """The markers of `tokenizer`'s replies: its family's first that it holds, else the
    first of all that it holds; None for a model that does not reason."""
    from ..models.registry import FAMILIES

    family = FAMILIES.get(model_type) if model_type else None
    names = [*(family.reasoning if family else ()), *MARKERS]
    for name in dict.fromkeys(names):
        if MARKERS[name].held_by(tokenizer):
            return MARKERS[name]
    return None


def prompt_opens(markers: Markers | None, tokenizer: Any, prompt: list[int]) -> bool:
    """Whether the prompt (token ids) ends inside an open reasoning block: its last start
    marker comes after its last end marker (the generation prompt wrote the start)."""
    if markers is None or not prompt:
        return False
    text = tokenizer.decode(list(prompt[-TAIL:]))
    return text.rfind(markers.start) > text.rfind(markers.end)


def template_switches(tokenizer: Any, enabled: bool | None, effort: str | None) -> dict:
    """The chat-template variables that turn reasoning on or off (`enabled`) or set its
    effort: `enable_thinking` (Qwen, GLM, DeepSeek, Nemotron, Gemma 4) and `thinking`
    (DeepSeek-V3.1+, Kimi K3), `reasoning_effort` where the template reads it (gpt-oss,
    DeepSeek-V4: "low", "medium", "high"). An effort of "none" or "minimal" turns it off
    where there is no effort to set; another turns it on."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    out: dict[str, Any] = {}
    if effort is not None:
        if "reasoning_effort" in template:
            out["reasoning_effort"] = "low" if effort in ("none", "minimal") else effort
        elif enabled is None:
            enabled = effort not in ("none", "minimal")
    if enabled is not None:
        out["enable_thinking"] = out["thinking"] = enabled
    return out


class ReasoningSplit:
    """A reply's text split into (reasoning, content) as it streams.

    `opened`: the reply starts inside the block (the prompt opened it); else a reply that
    starts (after whitespace) with the start marker opens it. The end marker, or one of
    `ends` (left in the content: a tool call's start), closes it; later markers are
    content. Text that may be the start of a marker is held back until it is known, and
    so is whitespace at the reasoning's edges (dropped).
    """

    def __init__(self, markers: Markers, opened: bool, ends: tuple[str, ...] = ()):
        self.markers, self.ends = markers, tuple(e for e in ends if e)
        self.state = "reasoning" if opened else "start"
        self.held = ""  # undecided text
        self.began = False  # reasoning text sent (whitespace before it is dropped)

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) of `text` that can be sent now."""
        self.held += text
        reasoning = content = ""
        while self.held:
            state = self.state
            if state == "start":
                body, start = self.held.lstrip(), self.markers.start
                if body.startswith(start):
                    self.held, self.state = body[len(start) :], "reasoning"
                elif len(body) < len(start) and start.startswith(body):
                    break  # whitespace, or the start marker's beginning: undecided
                else:
                    self.state = "content"
            elif state == "reasoning":
                reasoning += self._reasoning()
                if self.state == "reasoning":
                    break
            elif state == "gap":  # the whitespace after the end marker is dropped
                self.held = self.held.lstrip()
                self.state = "content" if self.held else "gap"
            else:
                content, self.held = content + self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The (reasoning, content) held back at the end of the reply."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return (held.strip() if not self.began else held.rstrip()), ""
        return "", held if self.state in ("start", "content") else ""

    def _reasoning(self) -> str:
        """The reasoning in `held` that can be sent (the state moves on at an end)."""
        ends = [self.markers.end, *self.ends]
        at, marker = find_stop(self.held, ends)
        if marker is not None:
            out = self._edges(self.held[:at], end=True)
            if marker == self.markers.end:  # the marker is dropped, then the gap after it
                self.held, self.state = self.held[at + len(marker) :], "gap"
            else:  # a call's start: it is the content's (its tool format reads it)
                self.held, self.state = self.held[at:], "content"
            return out
        keep = partial_stop(self.held, ends)
        body, tail = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        out = self._edges(body, end=False)
        self.held = body[len(body.rstrip()) :] + tail if out or self.began else tail
        return out

    def _edges(self, text: str, end: bool) -> str:
        """`text` without the whitespace before the first reasoning sent, and without its
        trailing whitespace (held back, or dropped at the `end`)."""
        if not self.began:
            text = text.lstrip()
        out = text.rstrip()
        self.began = self.began or bool(out)
        return out
