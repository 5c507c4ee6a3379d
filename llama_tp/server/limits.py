"""Every bound a request is held to, in one place, for the three APIs at once.

`Limits` is made once per served model (`Limits.of(model, tokenizer)`): sizes, counts
and contexts against the model's own limits. A request meets them in order, each
before the work it protects:

1. `body_bytes`: the body, before it is read (server/guard.py, with the key checked
   first);
2. `json_values` and `json_depth`: the decoded body (server/bodies.py);
3. `precheck`: the counts of the body's top-level lists (`messages`, `tools`, the same
   names in all three APIs), before any API's pydantic model reads them;
4. `check_settings` and `check`: the OpenAI request every API becomes: numeric fields
   against the model (`top_k` within the vocabulary, `repetition_context_size` within
   the context, `logit_bias` and prompt ids), stop strings, and the prompt's text,
   which cannot fit when it has more bytes than the context holds tokens times the
   longest token's bytes: refused before it is tokenized;
5. `schema_bytes`: a schema to compile into a grammar (engine/grammar.py bounds the
   compilation itself with llguidance's limits).

An embedding request (server/embeddings.py) meets 1 and 2, then `check_embedding_texts`
(how many inputs, and their text's size: each must fit the context unless the API
truncates, all of them `embedding_tokens`) before they are tokenized, and
`fit_embedding` (each input's tokens within the context, or truncated to it; ids within
the vocabulary; all of them within `embedding_tokens`) after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .bodies import label
from .errors import RequestError

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """The bounds of one served model's requests (docs/serving.md#reliability)."""

    context: int  # tokens: the model's context
    vocab: int  # token ids are in [0, vocab): the model's, less any its tokenizer lacks
    token_bytes: int = 256  # the longest token's text, in UTF-8 bytes
    max_body: int = 0  # bytes of a request body (0: from the prompt bound, >= 8 MiB)
    json_depth: int = 64  # nesting of a body's JSON
    tools: int = 512  # tools in one request
    stop_chars: int = 1000  # characters of one stop string
    schema_bytes: int = 32 * 1024  # a JSON schema (or forced tool calls' schemas) as JSON
    embedding_inputs: int = 2048  # inputs of one embedding request (OpenAI's bound)
    embedding_total: int = 300_000  # their tokens together (OpenAI's bound; >= a context)

    @classmethod
    def of(cls, context: int, vocab: int, tokenizer: Any = None, max_body: int = 0) -> Limits:
        """The limits of a model of `context` tokens whose ids are in [0, vocab), read with
        `tokenizer` (mlx-lm's wrapper; its vocabulary gives the longest token)."""
        known, longest = _vocabulary(tokenizer)
        # A padded vocabulary (more rows than tokens) has ids no text comes from.
        return cls(context, min(vocab, known or vocab), longest, max_body)

    @property
    def prompt_bytes(self) -> int:
        """The most text (UTF-8 bytes) a prompt that fits the context can have."""
        return self.context * self.token_bytes

    @property
    def body_bytes(self) -> int:
        """The largest body read: room for the largest prompt that can fit, escaped."""
        return self.max_body or max(8 * MIB, 2 * self.prompt_bytes + MIB)

    @property
    def json_values(self) -> int:
        """Objects and arrays in one body (parsing many tiny ones holds the interpreter)."""
        return max(100_000, 2 * self.context)

    @property
    def messages(self) -> int:
        """Messages in one request: each takes at least one token of the context."""
        return self.context

    def precheck(self, data: Any, place) -> None:
        """The counts of a decoded body's top-level lists, before an API's model reads it
        (`place` writes a field's name, as the API does)."""
        if not isinstance(data, dict):
            return
        for name, most in (("messages", self.messages), ("tools", self.tools)):
            items = data.get(name)
            if isinstance(items, list) and len(items) > most:
                why = "the model's context" if name == "messages" else "this server's limit"
                raise RequestError(
                    f"{label(place, (name,))}: {len(items)} {name}; at most {most} ({why})",
                    place((name,)),
                    code="too_many",
                )

    @property
    def embedding_tokens(self) -> int:
        """The tokens of one embedding request's inputs together: at least one context."""
        return max(self.embedding_total, self.context)

    def check_embedding_texts(self, texts: list, truncate: bool, field: str, place, loc) -> None:
        """An embedding request's inputs before they are tokenized: their count, none
        empty, each text small enough to fit the context (unless `truncate`: the API cuts
        it) and all of them within `embedding_tokens`. `place` writes a field's name as
        the API does, `loc(i)` is input i's place in the body."""
        if len(texts) > self.embedding_inputs:
            raise RequestError(
                f"{label(place, (field,))}: {len(texts)} inputs; at most "
                f"{self.embedding_inputs} are embedded in one request",
                place((field,)),
                code="too_many",
            )
        total = 0
        for i, t in enumerate(texts):
            if not t:
                raise RequestError(f"{label(place, loc(i))}: empty", place(loc(i)))
            size = _utf8(t) if isinstance(t, str) else 0
            total += size
            if size > self.prompt_bytes and not truncate:
                raise RequestError(
                    f"{label(place, loc(i))}: {size} bytes of text, but at most "
                    f"{self.prompt_bytes} can fit the model's context of {self.context} tokens",
                    place(loc(i)),
                    code="context_length_exceeded",
                )
        most = self.embedding_tokens * self.token_bytes
        if total > most:
            raise RequestError(
                f"{label(place, (field,))}: {total} bytes of text, more than the "
                f"{self.embedding_tokens} tokens one request embeds can hold ({most} bytes)",
                place((field,)),
                code="too_large",
            )

    def fit_embedding(
        self, ids: list[list[int]], truncate: bool, field: str, place, loc
    ) -> list[list[int]]:
        """Each input's token ids within the vocabulary and the context (cut to its first
        `context` tokens when `truncate`, as Ollama does), all of them within
        `embedding_tokens` (`place`, `loc`: as `check_embedding_texts`)."""
        out = []
        for i, t in enumerate(ids):
            name, param = label(place, loc(i)), place(loc(i))
            if not t:
                raise RequestError(f"{name}: no tokens", param)
            if any(not 0 <= x < self.vocab for x in t):
                raise RequestError(f"{name}: token ids must be in [0, {self.vocab})", param)
            if len(t) > self.context:
                if not truncate:
                    raise RequestError(
                        f"{name}: {len(t)} tokens, but the model's context is "
                        f"{self.context} tokens",
                        param,
                        code="context_length_exceeded",
                    )
                t = t[: self.context]
            out.append(t)
        total = sum(len(t) for t in out)
        if total > self.embedding_tokens:
            raise RequestError(
                f"{label(place, (field,))}: {total} tokens; at most {self.embedding_tokens} "
                "are embedded in one request",
                place((field,)),
                code="too_large",
            )
        return out

    def check_settings(self, body: Any) -> None:
        """The numeric fields of an OpenAI body (protocol's pydantic model) that depend on
        the model, and the stop strings (RequestError naming the field)."""
        if body.top_k is not None and body.top_k > self.vocab:
            _out("top_k", f"must be from 0 to {self.vocab} (the model's vocabulary)", body.top_k)
        n = body.repetition_context_size
        if n is not None and n > self.context:
            _out(
                "repetition_context_size",
                f"must be from 1 to {self.context} (the model's context)",
                n,
            )
        if body.logit_bias is not None and len(body.logit_bias) > self.vocab:
            _out("logit_bias", f"must have at most {self.vocab} entries", len(body.logit_bias))
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        for s in stops:
            if len(s) > self.stop_chars:
                _out("stop", f"strings must have at most {self.stop_chars} characters", len(s))

    def check(self, req: Any) -> None:
        """Token ids within the vocabulary, and the size of the prompt's text, of an OpenAI
        request (protocol.Request; RequestError naming the field)."""
        if any(not 0 <= t < self.vocab for t, _ in req.params.logit_bias):
            raise RequestError(
                f"'logit_bias' keys must be token ids in [0, {self.vocab})", "logit_bias"
            )
        if isinstance(req.prompt, list) and any(not 0 <= t < self.vocab for t in req.prompt):
            raise RequestError(f"'prompt' token ids must be in [0, {self.vocab})", "prompt")
        field, size = self._prompt_size(req)
        if size > self.prompt_bytes:
            raise RequestError(
                f"the prompt's text is {size} bytes, but at most {self.prompt_bytes} can fit "
                f"the model's context of {self.context} tokens (no token is longer than "
                f"{self.token_bytes} bytes): no room to generate",
                field,
                code="context_length_exceeded",
            )

    def _prompt_size(self, req: Any) -> tuple[str, int]:
        """(the field, the UTF-8 bytes of text the prompt renders at least)."""
        if not req.chat:  # token ids are counted when the prompt is fitted (`fit`)
            return "prompt", 0 if isinstance(req.prompt, list) else _utf8(req.prompt)
        size = sum(_utf8(m.get("content") or "") for m in req.messages)
        if req.tools:
            size += sum(len(json.dumps(t, ensure_ascii=False)) for t in req.tools)
        return "messages", size

    def check_schema(self, schema: Any, field: str) -> None:
        """A schema (or a forced call's tools) small enough to compile into a grammar."""
        size = len(json.dumps(schema, ensure_ascii=False))
        if size > self.schema_bytes:
            raise RequestError(
                f"'{field}': the schema is {size} bytes as JSON; at most {self.schema_bytes} "
                "are compiled into a grammar",
                field,
                code="schema_too_large",
            )


def _out(field: str, rule: str, value: Any) -> None:
    raise RequestError(f"'{field}' {rule}, got {value!r}", field)


def _utf8(text: str) -> int:
    # Characters bound the bytes from below; encoding a long text only when it matters.
    return len(text) if text.isascii() else len(text.encode("utf-8", "replace"))


def _vocabulary(tokenizer: Any) -> tuple[int, int]:
    """(the tokens `tokenizer` knows, the longest one's UTF-8 bytes), from its vocabulary's
    keys; (0, a generous default) without one. A key is never shorter than the text its
    token decodes to (byte-level BPE spells a byte with one or two, SentencePiece a space
    with three), so a prompt of n bytes has at least n / token_bytes tokens."""
    vocab = None
    for source in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        get = getattr(source, "get_vocab", None)
        if get is not None:
            try:
                vocab = get()
                break
            except Exception:  # some wrappers forward and fail: try the next
                continue
    if not vocab:
        return 0, Limits.token_bytes  # the field's default: a generous bound
    known = max(vocab.values()) + 1 if isinstance(vocab, dict) else len(vocab)
    longest = max(
        len(k.encode("utf-8", "replace")) if isinstance(k, str) else len(k) for k in vocab
    )
    return known, longest
