"""One request's sampling settings, validated once for every driver.

`SamplingParams` is what `stream_generate`, `Chat`, the batch engine behind the
server and `batch_generate` all take (OpenAI's names where they exist). Its
checks are the engine's own rules; a bad value raises `SettingsError` naming the
field, which the command line turns into a flag (`--top-p ...`) and the server
into OpenAI's `param`. Limits that belong to an API (OpenAI's temperature <= 2,
at most 20 top log-probabilities) stay with that API's request model.

`KEYWORDS` describes each setting once as the drivers take it (a keyword, mlx-lm's name:
`temp`) and the commands (a flag: `--temp`): the drivers' keywords, the commands'
sampling flags and the names their errors give derive from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

MAX_DRAFT_TOKENS = 64
MAX_INDEX = 2**31 - 1  # MLX indexes and slices with 32-bit integers


@dataclass(frozen=True)
class ReasoningBudget:
    """How many tokens a reply may reason for: after `tokens` tokens inside the block
    (from the reply's start when the prompt `opened` it, else after the `start` ids),
    the `end` ids are forced, one per step, unless the model closed the block itself."""

    tokens: int
    end: tuple[int, ...]
    start: tuple[int, ...] = ()
    opened: bool = False


class SettingsError(ValueError):
    """A setting out of range: `field` is its name, the message says the rule and value."""

    def __init__(self, field: str, rule: str, value: object):
        super().__init__(f"{field} {rule}, got {value!r}")
        self.field, self.rule, self.value = field, rule, value

    def named(self, name: str) -> str:
        """The message with the setting called `name` (a flag, an API field)."""
        return f"{name} {self.rule}, got {self.value!r}"


@dataclass
class SamplingParams:
    """One sequence's settings. `seed` with the token's index picks every random draw
    (`sampling.token_key`): the same settings and prompt give the same tokens. `seed`
    None: rank 0 chooses one at generation and every rank takes it (`stream_generate`,
    `Chat`; a batch's rows always say theirs)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    seed: int | None = 0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: no log-probabilities; k: the token's and the k best
    num_draft_tokens: int = 0  # prompt-lookup / draft-model tokens verified per step
    # Logits processors (engine/logits_processors.py), on every rank's columns alike:
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence_penalty: float = 0.0  # mlx-lm's: over the last `penalty_context` tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0  # 0: off; else mlx-lm's divisor (> 0)
    penalty_context: int = 20  # mlx-lm's repetition_context_size
    grammar: str | None = None  # an llguidance grammar (JSON text) the reply must follow
    reasoning_budget: ReasoningBudget | None = None  # the think block closed after N tokens

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        _integer("max_tokens", self.max_tokens, 1)
        _number("temperature", self.temperature, 0.0, math.inf, "must be >= 0")
        _number("top_p", self.top_p, 0.0, 1.0, "must be in (0, 1]", open_low=True)
        _number("min_p", self.min_p, 0.0, 1.0, "must be in [0, 1]")
        _integer("top_k", self.top_k, 0)
        if self.seed is not None:
            _integer("seed", self.seed, -(2**63), 2**64 - 1)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SettingsError("stop", "must hold non-empty strings", self.stop)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0)
        _integer("num_draft_tokens", self.num_draft_tokens, 0, MAX_DRAFT_TOKENS)
        self.logit_bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        for _, b in self.logit_bias:
            _number("logit_bias", b, -100.0, 100.0, "values must be in [-100, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            _number(name, getattr(self, name), -2.0, 2.0, "must be in [-2, 2]")
        _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf, "must be >= 0")
        _integer("penalty_context", self.penalty_context, 1, MAX_INDEX)
        if self.reasoning_budget is not None:
            _integer("reasoning_budget", self.reasoning_budget.tokens, 0, MAX_INDEX)
            if not self.reasoning_budget.end:
                raise SettingsError("reasoning_budget", "needs the end marker's ids", ())
        if self.grammar is not None and self.num_draft_tokens:
            raise SettingsError(
                "num_draft_tokens", "must be 0 with a grammar", self.num_draft_tokens
            )

    @property
    def processed(self) -> bool:
        """Some logits processor runs on this sequence's logits."""
        return bool(
            self.logit_bias or self.presence_penalty or self.frequency_penalty
            or self.repetition_penalty or self.grammar or self.reasoning_budget
        )  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Sampled with top-p, min-p or top-k (the candidates path of the sampler)."""
        return not self.greedy and (self.top_p < 1.0 or self.min_p > 0.0 or self.top_k > 0)

    def but(self, **changes) -> SamplingParams:
        """A copy with `changes`, validated again."""
        return replace(self, **changes)


class Keyword(NamedTuple):
    """A sampling setting as the drivers take it, a keyword (mlx-lm's name), and as the
    commands take it, a flag."""

    field: str  # SamplingParams' field
    keyword: str  # stream_generate's, Chat's and batch_generate's keyword
    flag: str | None  # the commands' flag
    help: str = ""  # the flag's help where every command gives it alike


# The one list the drivers' keywords, the commands' sampling flags and the names in their
# errors derive from (their defaults are SamplingParams').
KEYWORDS = (
    Keyword("max_tokens", "max_tokens", "--max-tokens"),
    Keyword("temperature", "temp", "--temp", "sampling temperature (0: greedy)"),
    Keyword("top_p", "top_p", "--top-p", "nucleus sampling mass"),
    Keyword("min_p", "min_p", "--min-p", "keep tokens >= min-p * the best"),
    Keyword("top_k", "top_k", "--top-k", "keep the k most likely tokens"),
    Keyword("seed", "seed", "--seed"),
    Keyword("stop", "stop", "--stop"),
    Keyword("logprobs", "logprobs", None),
    Keyword("num_draft_tokens", "num_draft_tokens", "--num-draft-tokens"),
)
DRAFT_TOKENS = 4  # drafted per step when a driver is given a drafter and no count


def default(field: str) -> object:
    """SamplingParams' default for `field`."""
    return SamplingParams.__dataclass_fields__[field].default


def driver_keywords(args: Mapping[str, object], but: tuple[str, ...] = ()) -> dict[str, object]:
    """The sampling keywords a driver was given (not None), by their names, from its
    arguments `args` (its `locals()` on entry), less `but` (a name the driver uses for
    something else: Chat's seed)."""
    return {
        k.keyword: args[k.keyword]
        for k in KEYWORDS
        if k.keyword not in but and args.get(k.keyword) is not None
    }


def keyword_params(given: Mapping[str, object], drafting: bool = False) -> SamplingParams:
    """The settings a driver's keywords `given` say (`driver_keywords`); what they leave
    out takes SamplingParams' default, but the seed None (agreed at generation) and draft
    tokens only with a drafter (default 4). A bad value's error names its keyword."""
    values = {k.field: given[k.keyword] for k in KEYWORDS if k.keyword in given}
    values.setdefault("seed", None)
    values["num_draft_tokens"] = values.get("num_draft_tokens", DRAFT_TOKENS) if drafting else 0
    try:
        return SamplingParams(**values)
    except SettingsError as e:
        name = next((k.keyword for k in KEYWORDS if k.field == e.field), e.field)
        raise SettingsError(name, e.rule, e.value) from None


def request_params(
    who: str, params: SamplingParams | None, drafting: bool, given: Mapping[str, object]
) -> SamplingParams:
    """A driver's settings (`stream_generate`, `Chat`): `params` as given, or what its
    keywords `given` say (`keyword_params`); both at once: TypeError naming `who` and the
    keywords. Without a drafter no draft tokens; with one at least 1 (`SettingsError`)."""
    if params is not None and given:
        raise TypeError(
            f"{who} takes params or the sampling keywords, not both ({', '.join(given)})"
        )
    if params is None:
        params = keyword_params(given, drafting)
    elif not drafting:
        params = params.but(num_draft_tokens=0)
    if drafting and params.num_draft_tokens == 0:
        raise SettingsError("num_draft_tokens", "must be at least 1 with a drafter", 0)
    return params


def _integer(field: str, v: object, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SettingsError(field, "must be an integer", v)
    if v < lo or (hi is not None and v > hi):
        rule = f"must be from {lo} to {hi}" if hi is not None else f"must be >= {lo}"
        rule = "must be positive" if (lo, hi) == (1, None) else rule
        raise SettingsError(field, rule, v)


def _number(field: str, v: object, lo: float, hi: float, rule: str, open_low=False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SettingsError(field, "must be a number", v)
    if not (lo < v <= hi if open_low else lo <= v <= hi):  # NaN fails both
        raise SettingsError(field, rule, v)
