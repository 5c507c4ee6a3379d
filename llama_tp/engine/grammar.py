"""Constrained decoding with llguidance: a grammar the reply must follow, as a mask.

    grammar = json_schema_grammar({"type": "object", ...})   # or json_object_grammar()
    check_grammar(grammar, tokenizer, vocab_size)            # GrammarError: cannot compile
    params = SamplingParams(grammar=grammar)                 # the engine masks every step

A grammar is llguidance's JSON text (serializable: rank 0 sends it to every rank in
the scheduler's decision). `GrammarMask` is the sequence's logits processor: from
the tokens generated so far (the same on every rank) it advances llguidance's
matcher and computes the allowed-token bitmask over the whole vocabulary, then
keeps this rank's columns of it (`VocabShard.start`..`stop`), so each rank of a
vocabulary-parallel head masks its own slice and the ranks stay in agreement.
When the grammar is complete the mask allows the end-of-sequence tokens only.

Compiling is the costly part (up to about 0.1 s within `LIMITS`): `compile_grammar`
compiles a grammar once and keeps it, so the server compiles a request's grammar while
preparing it, off its event loop and its step loop, and every rank's `GrammarMask`
starts from a copy (server/scheduler.py has the other ranks compile it ahead too).

Chosen over outlines-core and xgrammar by measurement (docs/serving.md#structured-output):
a 3 MB wheel with no dependencies, 56 us per token mask and 1.5 ms to compile a
schema on the built-in model's 49152-token vocabulary (outlines-core: 551 us, 23 ms;
xgrammar needs torch).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import numpy as np

from ..cluster.affinity import background_thread

# Compact JSON (no optional whitespace): a model cannot pad a reply with spaces forever.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The grammar (a JSON schema, a tool's parameters) does not compile."""


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text that validates against `schema`."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except Exception as e:  # llguidance raises ValueError / RuntimeError on bad schemas
        raise GrammarError(str(e).splitlines()[0]) from None


def json_object_grammar() -> str:
    """The grammar of any JSON object."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(lark: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON schema)."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except Exception as e:  # a bad embedded schema
        raise GrammarError(str(e).splitlines()[0]) from None


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # the server prepares requests on several threads

# llguidance's resource limits, which bound a grammar's compilation and each step's mask
# (its defaults, but a smaller grammar: 20k symbols compile in about 0.1 s here,
# docs/serving.md#reliability). A grammar past them leaves the matcher in its error
# state, which `compile_grammar` and `GrammarMask` turn into a GrammarError.
LIMITS = {"max_grammar_size": 20_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000}
CACHED = 32  # compiled grammars kept (their matchers copied for each request)


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos: frozenset[int]):
    """llguidance's tokenizer for mlx-lm's `tokenizer` (made once: about 0.3 s)."""
    from llguidance.hf import from_tokenizer

    with _LOCK:
        mine = _TOKENIZERS.setdefault(tokenizer, {})
        key = (vocab_size, eos)
        if key not in mine:
            hf = getattr(tokenizer, "_tokenizer", tokenizer)
            mine[key] = from_tokenizer(hf, n_vocab=vocab_size, eos_token=sorted(eos))
        return mine[key]


_COMPILED: OrderedDict = OrderedDict()  # (llguidance tokenizer id, grammar) -> matcher


def compile_grammar(grammar: str, tokenizer: Any, vocab_size: int, eos: frozenset[int]):
    """A fresh matcher of `grammar` at its start; GrammarError when it does not compile,
    exceeds `LIMITS`, or fails before the reply's first free choice. Compiled once: the
    last CACHED grammars (and refusals) are kept, and a request gets a copy (0.1 ms).
    Thread-safe; the compilation itself runs without the GIL."""
    import llguidance

    ll = ll_tokenizer(tokenizer, vocab_size, eos)
    key = (id(ll), grammar)
    with _LOCK:
        template = _COMPILED.get(key)
        if template is not None:
            _COMPILED.move_to_end(key)
    if template is None:
        limits = llguidance.LLParserLimits(**LIMITS)
        template = llguidance.LLMatcher(ll, grammar, log_level=0, limits=limits)
        try:
            _first_steps(template.deep_copy(), vocab_size)
        except GrammarError as e:
            template = e
        with _LOCK:
            _COMPILED[key] = template
            while len(_COMPILED) > CACHED:
                _COMPILED.popitem(last=False)
    if isinstance(template, GrammarError):
        raise GrammarError(str(template))
    return template.deep_copy()


def is_compiled(grammar: str) -> bool:
    """Whether `grammar` is among the kept ones (compiled, or refused)."""
    with _LOCK:
        return any(g == grammar for _, g in _COMPILED)


PROBE = 64  # a first free choice of at most this many tokens is tried token by token


def _first_steps(matcher, vocab_size: int) -> None:
    """GrammarError when the matcher fails before the reply's first free choice (a `$ref`
    loop, a row past llguidance's item limit), or on one of the few tokens that choice
    allows: such a grammar compiles, but a reply cannot follow it."""
    for _ in range(4):
        allowed = None if matcher.is_error() else _allowed(matcher, vocab_size)
        if allowed is None or matcher.is_error() or not allowed.any():
            raise GrammarError(_why(matcher))
        forced = matcher.compute_ff_tokens()
        if forced:
            matcher.consume_tokens(forced)
            continue
        choices = np.flatnonzero(allowed)
        if len(choices) <= PROBE:
            for t in choices.tolist():
                probe = matcher.deep_copy()
                if probe.consume_token(t) and not probe.is_stopped():
                    _allowed(probe, vocab_size)
                if probe.is_error():
                    raise GrammarError(_why(probe))
        return


def _allowed(matcher, vocab_size: int) -> np.ndarray:
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)


def _why(matcher) -> str:
    text = matcher.get_error().splitlines()[0] if matcher.get_error() else "no token allowed"
    text = text.removeprefix("Parser Error: ")
    if " " not in text:  # llguidance's bare names (NoExtensionBias: e.g. a $ref loop)
        text = f"no reply can follow it ({text})"
    return text[:300]


def check_grammar(grammar: str, tokenizer: Any, vocab_size: int, eos: frozenset[int]) -> None:
    """GrammarError naming the first problem when llguidance cannot compile `grammar`, or
    its matcher fails at once (`compile_grammar`, which keeps it for the request)."""
    compile_grammar(grammar, tokenizer, vocab_size, eos)


class Prefetch:
    """Grammars compiled ahead on a thread of their own, off the step loop: on every rank
    but rank 0 (which compiled them while preparing the requests), so that a request's
    `GrammarMask` only copies its compiled grammar when it joins the batch."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: frozenset[int]):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos
        # at a lower priority than the step loop it runs beside
        self._pool = ThreadPoolExecutor(1, "llama_tp-grammar-ahead", background_thread)
        self._futures: dict[int, Future] = {}

    def want(self, grammars: dict[int, str]) -> None:
        """Start compiling each request's grammar (request id -> grammar)."""
        for uid, grammar in grammars.items():
            self._futures[uid] = self._pool.submit(self._compile, grammar)

    def _compile(self, grammar: str) -> None:
        try:
            compile_grammar(grammar, self.tokenizer, self.vocab_size, self.eos)
        except GrammarError:  # kept as refused: the request ends with it when it joins
            pass

    def ready(self, awaited: list[int]) -> list[int]:
        """Of the `awaited` requests, those whose grammar is compiled here (the others'
        are forgotten: they joined, or were cancelled)."""
        keep = set(awaited)
        self._futures = {u: f for u, f in self._futures.items() if u in keep}
        return [u for u, f in self._futures.items() if f.done()]


class GrammarMask:
    """A sequence's logits processor: -inf for the tokens `grammar` does not allow next.

    Called with the tokens the logits follow (prompt and reply so far); the first call
    (the prompt's last forward) fixes where the reply starts. A shorter history than
    the last call's (rejected drafts) rolls the matcher back. A matcher that fails on
    the way (a limit reached mid-reply) raises GrammarError: the reply ends with an
    error, never as if the grammar were complete.
    """

    def __init__(self, grammar: str, tokenizer: Any, vocab_size: int, eos: frozenset[int]):
        self.matcher = compile_grammar(grammar, tokenizer, vocab_size, eos)
        self.size, self.start = vocab_size, None
        self.done: list[int] = []  # reply tokens the matcher has consumed

    def __call__(self, tokens: mx.array, logits: mx.array, shard) -> mx.array:
        if self.start is None:
            self.start = tokens.shape[0]
        reply = tokens[self.start :].tolist()
        same = 0
        while same < min(len(reply), len(self.done)) and reply[same] == self.done[same]:
            same += 1
        if same < len(self.done):
            self.matcher.rollback(len(self.done) - same)
            del self.done[same:]
        for t in reply[same:]:
            self.matcher.consume_token(t)
            self.done.append(t)
        allowed = _allowed(self.matcher, self.size)
        if self.matcher.is_error():  # a limit reached, or a token it refused
            n = len(self.done)
            raise GrammarError(f"the grammar failed after {n} tokens: {_why(self.matcher)}")
        mine = mx.array(allowed[shard.start : shard.stop])
        return mx.where(mine[None], logits, -mx.inf)
