"""Reasoning told apart from the answer (conversation/reasoning.py), on its own: every
family's markers split at every chunk boundary, the budget's forced end marker
(engine/logits_processors.py `BudgetMask`), the template switches of `reasoning_effort`,
the checks of `chat_template_kwargs`, and every native family's row naming markers."""

from __future__ import annotations

import pytest

from llama_tp.conversation.reasoning import MARKERS, ReasoningSplit, template_switches
from llama_tp.engine.logits_processors import BudgetMask
from llama_tp.engine.settings import ReasoningBudget, SamplingParams, SettingsError
from llama_tp.models.registry import FAMILIES
from llama_tp.server.errors import RequestError
from llama_tp.server.reasoning import checked_kwargs

# (markers, the prompt opened the block, the reply, its reasoning, its content), as the
# releases write them (the newlines around the thinking are the templates')
REPLIES = [
    (
        "think",
        True,
        "\nThe capital is Paris.\n</think>\n\nParis.",
        "The capital is Paris.",
        "Paris.",
    ),
    ("think", False, "<think>\nhmm, a\n\nb\n</think>\n\nParis.", "hmm, a\n\nb", "Paris."),
    ("think", False, "Paris. <think>x</think>", "", "Paris. <think>x</think>"),
    ("think", True, "truncated before its end  ", "truncated before its end", ""),
    ("think", True, "</think>Paris.", "", "Paris."),
    ("think", True, "a</think>b</think>c", "a", "b</think>c"),
    ("think", False, "<thin", "", "<thin"),
    ("think", False, "  \n", "", "  \n"),
    ("mistral_think", False, "[THINK]2 + 2 = 4[/THINK]4", "2 + 2 = 4", "4"),
    ("kimi_xtml", True, "plan<|close|>think<|sep|>done", "plan", "done"),
    (
        "gemma4_channel",
        False,
        "<|channel>thought\nweighing it<channel|>The answer",
        "weighing it",
        "The answer",
    ),  # fmt: skip
    ("harmony", False, "<|channel|>analysis<|message|>User asks.<|end|>", "User asks.", ""),
]


def _split(name, opened, reply, cuts, ends=()):
    """(reasoning, content) of `reply` fed in the pieces `cuts` (positions) make."""
    split = ReasoningSplit(MARKERS[name], opened, ends)
    reasoning = content = ""
    edges = [0, *cuts, len(reply)]
    for a, b in zip(edges, edges[1:], strict=False):
        r, c = split.feed(reply[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("name,opened,reply,reasoning,content", REPLIES)
def test_a_reply_splits_the_same_at_every_chunk_boundary(name, opened, reply, reasoning, content):
    assert _split(name, opened, reply, []) == (reasoning, content)
    n = len(reply)
    for i in range(1, n):  # in two pieces, cut anywhere
        assert _split(name, opened, reply, [i]) == (reasoning, content), i
    assert _split(name, opened, reply, list(range(1, n))) == (reasoning, content)  # by char


def test_a_tool_calls_start_ends_an_unclosed_block_and_stays_content():
    reply = 'I need the weather.\n<tool_call>\n{"name": "w"}'
    for cuts in ([], list(range(1, len(reply)))):
        r, c = _split("think", True, reply, cuts, ends=("<tool_call>",))
        assert (r, c) == ("I need the weather.", '<tool_call>\n{"name": "w"}')


def test_the_budget_forces_the_end_marker_after_so_many_tokens():
    end, start = (90, 91), (80,)
    opened = BudgetMask(ReasoningBudget(3, end, start, opened=True))
    assert [opened.forced(r) for r in ([], [1], [1, 2], [1, 2, 3])] == [None, None, None, 90]
    assert opened.forced([1, 2, 3, 90]) == 91 and opened.forced([1, 2, 3, 90, 91]) is None
    assert opened.forced([1, 90, 91, 4, 5, 6]) is None  # the model closed the block itself
    # a reply that opens the block itself: counted from after its start marker
    own = BudgetMask(ReasoningBudget(2, end, start, opened=False))
    assert [own.forced(r) for r in ([5, 6, 7], [5, 80, 1], [5, 80, 1, 2])] == [None, None, 90]
    zero = BudgetMask(ReasoningBudget(0, end, start, opened=True))
    assert zero.forced([]) == 90  # budget 0: answer at once
    # read from the tokens alone: a shorter history (rejected drafts) is read the same
    assert opened.forced([1, 2, 3, 90]) == 91 and opened.forced([1, 2, 3]) == 90


class _Bytes:
    """A tokenizer of byte tokens: 1, 2 are ASCII letters, 7 and 8 the two bytes of 'é'."""

    BYTES = {1: b"a", 2: b"b", 7: b"\xc3", 8: b"\xa9", 90: b"</think>"}

    def decode(self, ids):
        return b"".join(self.BYTES[i] for i in ids).decode("utf-8", "replace")


def test_the_budget_waits_for_a_characters_last_byte():
    """A grammar refuses a marker inside a character (llama.cpp's budget waits too)."""
    mask = BudgetMask(ReasoningBudget(2, (90,), opened=True), _Bytes())
    assert mask.forced([1, 2]) == 90  # whole characters: forced at once
    assert mask.forced([1, 7]) is None  # 'é' half written: its second byte first
    assert mask.forced([1, 7, 8]) == 90 and mask.forced([1, 7, 8, 90]) is None
    assert mask.forced([7, 7, 7, 7, 7, 7]) == 90  # at most BudgetMask.WAIT tokens late


def test_the_budget_masks_every_column_but_the_forced_one_on_each_rank():
    import mlx.core as mx

    from llama_tp.parallel.vocab_shards import VocabShard

    mask = BudgetMask(ReasoningBudget(1, (6,), opened=True))
    tokens = mx.array([1, 2, 3, 4], mx.int32)  # a 3-token prompt, then one reply token
    mask.start = 3
    for lo, hi in ((0, 5), (5, 10)):  # the two ranks' columns of a 10-token vocabulary
        out = mask(tokens, mx.zeros((1, hi - lo)), VocabShard(lo, hi, 10))
        finite = [lo + i for i, v in enumerate(out[0].tolist()) if v != float("-inf")]
        assert finite == ([6] if lo == 5 else [])


def test_a_budget_is_checked_with_the_settings():
    SamplingParams(reasoning_budget=ReasoningBudget(0, (5,)))
    with pytest.raises(SettingsError, match="reasoning_budget"):
        SamplingParams(reasoning_budget=ReasoningBudget(-1, (5,)))
    with pytest.raises(SettingsError, match="end marker"):
        SamplingParams(reasoning_budget=ReasoningBudget(4, ()))


class _Template:
    def __init__(self, text: str):
        self.chat_template = text


def test_reasoning_effort_switches_what_each_template_reads():
    qwen = _Template("{% if enable_thinking is defined and enable_thinking is false %}")
    assert template_switches(qwen, None, "none") == {"enable_thinking": False, "thinking": False}
    assert template_switches(qwen, None, "high") == {"enable_thinking": True, "thinking": True}
    assert template_switches(qwen, None, None) == {}
    harmony = _Template('{{- "Reasoning: " + reasoning_effort + "\\n\\n" }}')
    assert template_switches(harmony, None, "high") == {"reasoning_effort": "high"}
    assert template_switches(harmony, None, "minimal") == {"reasoning_effort": "low"}


def test_chat_template_kwargs_are_checked_and_the_switches_mirrored():
    assert checked_kwargs({"thinking": True}) == {"thinking": True, "enable_thinking": True}
    given = {"enable_thinking": False, "thinking": True}  # both given: as given
    assert checked_kwargs(given) == given
    for bad in ({"add_generation_prompt": False}, {"chat_template": "{{ 1 }}"}, {"a b": 1}):
        with pytest.raises(RequestError, match=r"chat_template_kwargs\.") as e:
            checked_kwargs(bad)
        assert e.value.param == "chat_template_kwargs"


def test_every_native_family_names_markers_that_exist():
    for model_type, family in FAMILIES.items():
        assert family.reasoning, model_type
        assert all(name in MARKERS for name in family.reasoning), (model_type, family.reasoning)
