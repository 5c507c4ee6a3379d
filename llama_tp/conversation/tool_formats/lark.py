"""The pieces of a forced call's grammar (llguidance's Lark), for one tokenizer.

`Spell(tokenizer)` writes text as the model must emit it: every added token of the
tokenizer (special or not: Qwen's `<tool_call>` is an added token that is not special)
by its id, `<[151657]>`, the rest as strings. llguidance keeps added tokens apart from
text (a string in the grammar can only be spelled by ordinary tokens), so a marker
written as a string would make the model spell it out, and a grammar that forces it
fails at once ("token ... doesn't satisfy the grammar"). It also writes JSON-schema
values (`%json`), free text up to an end marker, and extra rules:

    sp = Spell(tokenizer)
    call = f'{sp("<tool_call>\\n")} {sp.json(schema)} {sp("\\n</tool_call>")}'
    lark = sp.grammar(call)            # "start: ..." and the rules it made
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any

from ...engine.grammar import JSON_DEFAULTS

_META = set("\\.+*?()|[]{}^$#&-~/")


def regex_text(text: str) -> str:
    """`text` as a regex matching itself, inside llguidance's `/.../`."""
    out = []
    for c in text:
        if c in _META:
            out.append("\\" + c)
        elif c in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c])
        else:
            out.append(c)
    return "".join(out)


class Spell:
    """Lark pieces for `tokenizer` (see the module's docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokens, self._split = _added_tokens(tokenizer)
        self.rules: list[str] = []
        self._terminals: dict[str, str] = {}

    def parts(self, text: str) -> list[tuple[str, bool]]:
        """`text` cut into (piece, whether it is an added token)."""
        out, at = [], 0
        for m in self._split.finditer(text) if self._split else ():
            if m.start() > at:
                out.append((text[at : m.start()], False))
            out.append((m.group(), True))
            at = m.end()
        if at < len(text):
            out.append((text[at:], False))
        return out

    def __call__(self, text: str) -> str:
        """`text` as the model writes it: added tokens by id, strings between."""
        return " ".join(
            f"<[{self.tokens[p]}]>" if token else json.dumps(p, ensure_ascii=False)
            for p, token in self.parts(text)
        )

    def json(self, schema: dict) -> str:
        """A JSON value following `schema` (compact, as chat templates write JSON)."""
        return "%json " + json.dumps({**schema, "x-guidance": JSON_DEFAULTS}, ensure_ascii=False)

    def rule(self, body: str) -> str:
        """A new rule of `body`; its name."""
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def text_until(self, end: str, least: int = 0, most: int | None = None) -> str:
        """Free text (of `least` to `most` characters) that does not hold `end`, then
        `end`: the parsers read such a value up to the first `end`."""
        parts = self.parts(end)
        first, token = parts[0]
        size = f"{{{least},{'' if most is None else most}}}"
        if token:  # the text cannot spell the token, but it must not spell its text either
            key = f"{first}{size}"
            if key not in self._terminals:
                name = f"TEXT{len(self._terminals)}"
                self._terminals[key] = name
                self.rules.append(f"{name}: /(?s:.{size})/ & ~/(?s:.*){regex_text(first)}(?s:.*)/")
            head = f"{self._terminals[key]} {self(first)}"
        else:  # lazy: it ends at the first `end`
            name = f"r{len(self.rules)}"
            self.rules.append(f"{name}[lazy]: /(?s:.{size}){regex_text(first)}/")
            head = name
        rest = "".join(p for p, _ in parts[1:])
        return f"{head} {self(rest)}" if rest else head

    def grammar(self, start: str) -> str:
        """The whole grammar: `start: {start}` and every rule made."""
        return "\n".join([f"start: {start}", *self.rules, ""])


_ADDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _added_tokens(tokenizer: Any) -> tuple[dict[str, int], re.Pattern | None]:
    """The tokenizer's added tokens (text -> id) and a pattern finding them in text
    (made once per tokenizer: a release may have thousands)."""
    try:
        if tokenizer in _ADDED:
            return _ADDED[tokenizer]
    except TypeError:  # not weakly referable: made each time
        pass
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = {str(getattr(t, "content", t)): i for i, t in decoder.items()}
    tokens.pop("", None)
    names = sorted(tokens, key=len, reverse=True)
    found = tokens, re.compile("|".join(map(re.escape, names))) if names else None
    try:
        _ADDED[tokenizer] = found
    except TypeError:
        pass
    return found


def repeat(sp: Spell, item: str, sep: str, parallel: bool, optional: bool = False) -> str:
    """One `item`, or (`parallel`) one or more with `sep` text (`optional`: or none)
    between."""
    if not parallel:
        return item
    name = sp.rule(item)
    between = (f"({sp(sep)})? " if optional else f"{sp(sep)} ") if sep else ""
    return f"{name} ({between}{name})*"


def choice(items: list[str]) -> str:
    """One of `items` (Lark expressions)."""
    return items[0] if len(items) == 1 else "(" + " | ".join(items) + ")"


def ordered(sp: Spell, items: list[tuple[str, bool]], sep: str) -> str:
    """The present ones of `items` ((expression, required)) in their order, `sep` text
    between: every required one, any of the others. "" when there are none."""
    if not items:
        return ""
    comma = f"{sp(sep)} " if sep else ""
    tails = [""] * (len(items) + 1)  # tails[i]: items i.. each after a separator
    for i in range(len(items) - 1, -1, -1):
        expr, required = items[i]
        piece = f"{comma}{expr}" if required else f"({comma}{expr})?"
        tails[i] = f"{piece} {tails[i + 1]}".strip()
    firsts = []  # the first present item is k: all before it optional
    for k, (expr, required) in enumerate(items):
        firsts.append(f"{expr} {tails[k + 1]}".strip())
        if required:
            break
    body = sp.rule(" | ".join(firsts))
    return f"{body}?" if all(not r for _, r in items) else body
