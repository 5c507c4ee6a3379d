"""Multi-turn chat: the `Chat` class (`python -m llama_tp.chat` is in chat.py).

    from llama_tp import Chat, load
    model, tokenizer = load(path)               # sharded under mlx.launch
    chat = Chat(model, tokenizer, system="Be brief.", max_tokens=128)
    print(chat.send("What is the capital of France?"))
    for piece in chat.stream("And of Germany?"):
        print(piece, end="", flush=True)

Every rank runs the same turns (SPMD): the replies are identical on every rank,
and only rank 0 should print them (`llama_tp.distributed.print0`). The KV cache
is kept between turns; a turn prefills only the tokens the cache does not
already hold (`chat.last_stats`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints.chat_template import FALLBACK_STOP, ChatTemplateError, renderer_for
from ..cluster.distributed import all_gather_object, world
from ..engine import caches
from ..engine.drafters import make_drafter
from ..engine.generation import stream_generate
from ..engine.grammar import json_schema_grammar
from ..engine.settings import SamplingParams, driver_keywords, request_params
from ..engine.speculative import SpecStats
from .chat_tools import ChatTools

__all__ = ["FALLBACK_STOP", "Chat", "ChatTemplateError", "ContextOverflowError", "TurnStats"]
OVERFLOW_MODES = ("error", "drop_oldest")


def _mark(i: int) -> str:
    # Private-use characters: no template escapes or trims them, no user types them.
    return f"\ue000{i}\ue001"


class ContextOverflowError(ValueError):
    """The conversation does not fit into the model's context."""


@dataclass
class TurnStats:
    """What one turn cost; `Chat.last_stats` after each `send`/`stream`."""

    prompt_tokens: int  # the whole conversation as the model saw it this turn
    reused_tokens: int  # of those, already in the KV cache from earlier turns
    prefilled_tokens: int  # computed this turn: prompt_tokens - reused_tokens
    generated_tokens: int  # sampled this turn (an end-of-turn token included)
    finish_reason: str  # "stop" (end of turn or stop string), "length" or "interrupted"
    stop_string: str | None  # the stop string that ended the reply, if one did
    prompt_tps: float  # prefill speed, tokens per second
    generation_tps: float
    dropped_messages: int  # oldest messages dropped to fit (overflow="drop_oldest")
    context_tokens: int  # tokens held in the KV cache after the turn
    speculative: SpecStats | None = None  # with a drafter: acceptance, tokens per forward


class Chat(ChatTools):
    """A conversation with a (possibly sharded) model, reusing its KV cache between turns.

    `params`: the sampling settings (`SamplingParams`: max_tokens, temperature, top-p,
    min-p, top-k, stop strings, draft tokens), or the keywords of the same names (mlx-lm's:
    `temp`; not both). `system`: the system message; `stop`: strings that end a reply (never
    shown, not kept in the history); `max_context`: the context limit in tokens
    (default: the model's `max_position_embeddings`); `overflow`: what to do when
    a turn (its prompt plus `max_tokens`) would not fit: "error" raises
    `ContextOverflowError`, "drop_oldest" drops the oldest user/assistant turns
    (the system message stays). `seed` makes sampling reproducible (turn k
    uses `seed + k`); greedy decoding (`temp=0`, the default) needs none.
    `should_stop()`, asked after every token on every rank, interrupts a reply.
    `draft` ("ngram", a draft model or a `Drafter`) decodes speculatively with up
    to `num_draft_tokens` drafted tokens per step; the draft keeps its own cache
    across turns, trimmed with the model's. `tools`: OpenAI-style function
    definitions the template shows; a reply's calls land in `last_tool_calls`, answered
    with `send_tool_result` (conversation/chat_tools.py).

    Under mlx.launch every rank must make the same calls in the same order.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        system: str | None = None,
        *,
        params: SamplingParams | None = None,
        max_tokens: int | None = None,
        temp: float | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: list[str] | tuple[str, ...] | str | None = None,
        max_context: int | None = None,
        overflow: str = "error",
        should_stop: Callable[[], bool] | None = None,
        group: mx.distributed.Group | None = None,
        draft: Any = None,
        num_draft_tokens: int | None = None,
        tools: list[dict] | None = None,
    ):
        # The seed is the turns' (`seed + k`), not the settings'.
        given = driver_keywords(locals(), but=("seed",))
        self.params = params = request_params("Chat", params, draft is not None, given)
        if overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
        if max_context is None:
            max_context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        if max_context is not None and max_context <= 0:
            raise ValueError(f"max_context must be positive, got {max_context}")
        self.model, self.tokenizer = model, tokenizer
        self.group = group or world()
        self.seed = seed
        self.stop, self.max_context, self.overflow = list(params.stop), max_context, overflow
        self.should_stop = should_stop
        self.drafter = make_drafter(draft, model)
        self.history: list[dict[str, Any]] = []
        self.last_stats: TurnStats | None = None
        self.tools, self.last_tool_calls = tools, []
        self._renderer = renderer_for(tokenizer)
        self._cache = caches.new(model)
        self._held: list[int] = []  # the tokens in the cache, exactly
        # A recurrent state cannot step back: checkpoints of the cache at the ends of the
        # turns' segments (a prompt before its generation prompt, the whole prompt), as
        # (tokens held, checkpoint), prefixes of `_held`, to go back to (`_reuse`)
        self._marks: list[tuple[int, caches.Checkpoint]] = []
        self._tokens_of: dict[int, tuple[dict, str, list[int]]] = {}  # id(reply) -> its tokens
        self._turn = 0
        self.system = system

    # -- settings: `params` (and `stop`) change between turns -------------------

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        self.params = self.params.but(max_tokens=value)

    # -- conversation state -------------------------------------------------

    @property
    def system(self) -> str | None:
        if self.history and self.history[0].get("role") == "system":
            return self.history[0]["content"]
        return None

    @system.setter
    def system(self, text: str | None) -> None:
        has = bool(self.history) and self.history[0].get("role") == "system"
        if text is None:
            if has:
                del self.history[0]
        elif has:
            self.history[0] = {"role": "system", "content": text}
        else:
            self.history.insert(0, {"role": "system", "content": text})

    def reset(self) -> None:
        """Forget the conversation (the system message stays). The KV cache is kept:
        the next turn reuses whatever prefix still matches (e.g. the system prompt)."""
        system = self.system
        self.history.clear()
        self.system = system
        self._tokens_of.clear()
        self._turn = 0

    @property
    def context_tokens(self) -> int:
        """Tokens held in the KV cache."""
        return len(self._held)

    # -- a turn -------------------------------------------------------------

    def send(
        self,
        text: str,
        *,
        should_stop: Callable[[], bool] | None = None,
        schema: dict | None = None,
        tool_choice: str | None = None,
    ) -> str:
        """The whole reply to `text` (see `stream`)."""
        return "".join(
            self.stream(text, should_stop=should_stop, schema=schema, tool_choice=tool_choice)
        )

    def stream(
        self,
        text: str,
        *,
        should_stop: Callable[[], bool] | None = None,
        schema: dict | None = None,
        tool_choice: str | None = None,
    ) -> Iterator[str]:
        """Add the user message `text` and yield the reply in pieces as it is decoded.

        The reply joins the history when it ends: at an end-of-turn token, a
        stop string, `max_tokens`, `should_stop()` (on any rank), or when the
        caller stops iterating (then with the text yielded so far; under
        mlx.launch every rank must stop at the same piece). `schema`: a JSON schema
        the reply follows (constrained decoding, `engine/grammar.py`; {"type":
        "object"} for any JSON object); `grammar.GrammarError` when it cannot compile.
        `tool_choice`: "required" or a function's name makes the reply one call of `tools`.
        """
        if not isinstance(text, str):
            raise TypeError(f"the message must be a str, not {type(text).__name__}")
        yield from self._reply(
            [{"role": "user", "content": text}], should_stop, schema, tool_choice
        )

    def _reply(self, add: list[dict], should_stop=None, schema=None, tool_choice=None):
        """The reply to the history and `add` (the new messages), yielded as decoded."""
        processors = self._tool_processors(tool_choice)
        if schema is not None:
            processors = [self._grammar_mask(json_schema_grammar(schema))]
        calls, self.last_tool_calls = self._tool_stream(tool_choice), []
        before = list(self.history)
        messages, tokens, dropped = self._fit([*self.history, *add])
        reused = self._reuse(tokens)
        new = tokens[reused:]
        marks = ()
        if caches.recurrent(self._cache):  # checkpoints at this turn's segment ends
            ends = (self._user_end(messages, tokens), len(tokens))
            marks = tuple(m - reused for m in ends if m is not None and m > reused)
        seed = None if self.seed is None else self.seed + self._turn
        self._turn += 1
        params = self.params.but(seed=seed, stop=(*self.stop, *self._renderer.stops))
        self.history[:] = messages
        live = {id(m) for m in messages}
        self._tokens_of = {k: v for k, v in self._tokens_of.items() if k in live}
        steps = stream_generate(
            self.model,
            self.tokenizer,
            new,
            params,
            cache=self._cache,
            history=self._held[:reused],
            should_stop=should_stop or self.should_stop,
            group=self.group,
            draft=None if processors else self.drafter,  # a grammar follows one token
            logits_processors=processors,
            marks=marks,
            on_mark=lambda n, cache: self._keep_mark(reused + n, caches.checkpoint(cache)),
        )
        generated: list[int] = []
        shown: list[str] = []
        said, found = [], []  # with tools: the text yielded, the calls parsed
        last, state = None, "failed"
        try:
            for r in steps:
                last = r
                generated.append(r.token)
                if r.text:
                    shown.append(r.text)
                    said.append(calls.feed(r.text) if calls else r.text)
                    if said[-1]:
                        yield said[-1]
                if r.finish_reason:
                    break
            if calls:  # what was held back: text, or the calls
                rest, found = calls.finish()
                said.append(rest)
                if rest:
                    yield rest
            state = "complete"
        except GeneratorExit:  # the caller stopped iterating: keep the reply so far
            state = "closed"
            raise
        finally:
            steps.close()
            if state == "failed":  # an error mid-turn: the cache may be half-written
                self.history[:] = before
                self._cache = caches.new(self.model)
                self._held, self._marks = [], []
            else:
                reply = "".join(shown)
                finish = last.finish_reason if last and last.finish_reason else "interrupted"
                stop_hit = last.stop_string if last else None
                eos = last is not None and last.eos
                self._end_turn(reused, new, generated, reply, finish, eos, stop_hit, state)
                self._keep_calls(self.history[-1], "".join(said), found)
                self.last_stats = TurnStats(
                    len(tokens),
                    reused,
                    len(new),
                    len(generated),
                    finish,
                    stop_hit,
                    last.prompt_tps if last else 0.0,
                    last.generation_tps if last else 0.0,
                    dropped,
                    len(self._held),
                    last.speculative if last else None,
                )

    def _reuse(self, tokens: list[int]) -> int:
        """Trim the cache to its longest prefix shared with `tokens`; return its length.

        At least one token is always left to prefill (it yields the first logits)."""
        common = 0
        for a, b in zip(tokens, self._held, strict=False):
            if a != b:
                break
            common += 1
        if not tokens:
            raise ValueError("the chat template rendered an empty prompt")
        common = min(common, len(tokens) - 1)
        extra = len(self._held) - common
        if caches.can_rewind(self._cache, extra):
            caches.rewind(self._cache, extra)
        else:  # a layer kind that cannot step back: its latest checkpoint that fits
            held, snap = max(
                ((n, c) for n, c in self._marks if n <= common),
                default=(0, None),
                key=lambda m: m[0],
            )
            if snap is not None:
                caches.restore(self._cache, snap)
                common = held
            else:  # none (a wrapped window): start afresh
                self._cache, common = caches.new(self.model), 0
        self._held = self._held[:common]
        self._marks = [(n, c) for n, c in self._marks if n <= common]
        return common

    MARKS = 4  # recurrent-state checkpoints kept (each the size of the state)

    def _keep_mark(self, held: int, snap: caches.Checkpoint) -> None:
        self._marks = [*self._marks, (held, snap)][-self.MARKS :]

    def _user_end(self, messages: list[dict], tokens: list[int]) -> int | None:
        """Where `tokens` (of `messages`, ending with the generation prompt) end without the
        generation prompt: the next turn renders the reply after it (thinking templates
        change what follows it), so a checkpoint there serves. None when the generation
        prompt's tokens do not stand alone at the end."""
        try:
            whole = self._apply(messages, tokenize=False)
            bare = self._renderer.apply(
                messages, tokenize=False, add_generation_prompt=False, tools=self.tools
            )
        except Exception:
            return None
        if not whole.startswith(bare) or len(whole) == len(bare):
            return None
        tail = self._encode(whole[len(bare) :])
        if not tail or tokens[-len(tail) :] != tail:
            return None
        return len(tokens) - len(tail)

    def _end_turn(self, reused, new, generated, reply, finish, eos, stop_hit, state) -> None:
        # Generation may have fed one token fewer than it sampled (at max_tokens), or one
        # more (a last token a layer kind could not step back over): the cache says. Caches
        # that do not count them (recurrent states only: a pipeline stage of linear-
        # attention layers) start over, on every rank alike: the next turn prefills it all.
        try:
            held: int | None = caches.held(self._cache) if self._cache else 0
        except caches.CacheError:
            held = None
        if self.group.size() > 1:
            seen = all_gather_object(held, self.group)
            held = None if None in seen else min(seen)
        if held is None:
            self._cache, held = caches.new(self.model), 0
        self._held = (self._held[:reused] + new + generated)[:held]
        message = {"role": "assistant", "content": reply}
        self.history.append(message)
        tokens = generated
        if tokens and eos:
            tokens = tokens[:-1]  # the end-of-turn token: the template writes its own
        if state != "complete" or stop_hit is not None:
            tokens = self._tokens_for(tokens, reply)
        if tokens is not None:
            self._tokens_of[id(message)] = (message, reply, tokens)

    def _tokens_for(self, tokens: list[int], text: str) -> list[int] | None:
        """The longest prefix of `tokens` that decodes to `text` (a reply cut short), if any."""
        for n in range(len(tokens), max(-1, len(tokens) - 24), -1):
            if self.tokenizer.decode(tokens[:n]) == text:
                return tokens[:n]
        return None

    # -- prompt -------------------------------------------------------------

    def _apply(self, messages: list[dict], tokenize: bool) -> list[int] | str:
        return self._renderer.apply(messages, tokenize=tokenize, tools=self.tools)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _render(self, messages: list[dict]) -> list[int]:
        """The conversation's token ids, ending with the assistant's generation prompt.

        Replies keep the tokens they were generated as (the text of a reply does
        not always tokenize back to them), so the cache of earlier turns matches."""
        marked, parts = [], []
        for m in messages:
            known = self._tokens_of.get(id(m))
            if known and known[0] is m and m.get("content") == known[1]:
                m = {**m, "content": _mark(len(parts))}
                parts.append(known[2])
            marked.append(m)
        if not parts:
            return self._apply(messages, tokenize=True)
        text = self._apply(marked, tokenize=False)
        tokens: list[int] = []
        for i, part in enumerate(parts):
            before, found, text = text.partition(_mark(i))
            if not found or _mark(i) in text:
                return self._apply(messages, tokenize=True)
            tokens += self._encode(before) + part
        return tokens + self._encode(text)

    def _fit(self, messages: list[dict]) -> tuple[list[dict], list[int], int]:
        """`messages` (less its oldest turns with overflow="drop_oldest") and their tokens."""
        dropped = 0
        while True:
            tokens = self._render(messages)
            need = len(tokens) + self.max_tokens
            if self.max_context is None or need <= self.max_context:
                return messages, tokens, dropped
            counts = (
                f"{len(tokens)} prompt tokens + max_tokens {self.max_tokens} = {need} tokens, "
                f"over the context limit of {self.max_context}"
            )
            if self.overflow == "error":
                raise ContextOverflowError(
                    f"the conversation needs {counts}; reset() it, lower max_tokens, raise "
                    "max_context or pass overflow='drop_oldest'"
                )
            first = 1 if messages[0].get("role") == "system" else 0
            nxt = next(
                (i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), None
            )
            if nxt is None:
                raise ContextOverflowError(f"the message alone needs {counts}")
            dropped += nxt - first
            messages = messages[:first] + messages[nxt:]


# -- python -m llama_tp.chat ---------------------------------------------------
