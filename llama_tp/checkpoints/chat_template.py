"""The one prompt renderer: messages -> prompt tokens, and the tokens that end a turn.

`generate`, `Chat`, `batch_generate` and the server's chat route all render
their messages here, so one conversation is one token sequence whichever way
it arrives. A tokenizer with a chat template renders through it; one without
(a base model) through `FALLBACK_TEMPLATE` ("User: ... / Assistant:"), whose
replies then also end at `FALLBACK_STOP`; with `use_chat_template=False` the
messages' texts are joined by newlines and encoded as plain text.

`PromptRenderer.eos` is the one end-of-sequence set of every driver: the
tokenizer's end-of-sequence ids and the special token the template closes an
assistant turn with (e.g. <|im_end|>, <|eot_id|>), found by rendering a turn.
`wrap_tokenizer` gives a tokenizer built here (GGUF, Meta) the tool-call parser
mlx-lm's loader infers from the template.
"""

from __future__ import annotations

import importlib
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

FALLBACK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant:{{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
FALLBACK_STOP = "\nUser:"
_MARK = "\ue0000\ue001"  # a private-use marker: no template escapes it, no user types it


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (e.g. a system message it does not allow)."""


class PromptRenderer:
    """How `tokenizer` turns messages into prompt tokens (see the module docstring)."""

    def __init__(self, tokenizer: Any, use_chat_template: bool = True):
        self.tokenizer, self.use_chat_template = tokenizer, use_chat_template
        self.template = None if tokenizer.has_chat_template else _fallback(tokenizer)
        self.stops: tuple[str, ...] = (
            (FALLBACK_STOP,) if use_chat_template and self.template else ()
        )
        self.eos = frozenset(tokenizer.eos_token_ids) | self._end_of_turn()

    def apply(
        self,
        messages: list[dict],
        tokenize: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final: bool = False,
    ) -> list[int] | str:
        """`messages` through the chat template (or the fallback): token ids, or text.
        `tools`: OpenAI's tool definitions, for the template to show (transformers' way).
        `continue_final`: the last message is left open for the model to continue (a
        "prefill"), transformers' `continue_final_message`: no end of turn after it."""
        kwargs = {"chat_template": self.template} if self.template else {}
        if tools:
            kwargs["tools"] = tools
        if continue_final:  # transformers refuses it with a generation prompt
            kwargs["continue_final_message"], add_generation_prompt = True, False
        try:
            out = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs
            )
        except Exception as e:  # jinja2's errors, or the template's own raise_exception
            raise ChatTemplateError(f"the chat template failed: {e}") from e
        return list(out) if tokenize else out

    def encode(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        continue_final: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt tokens of `messages`, ending with the assistant's generation prompt
        (or, with `continue_final`, with the last message's text, for the model to go on)."""
        if not self.use_chat_template:  # plain text: nothing closes the last message anyway
            return list(self.tokenizer.encode("\n".join(m["content"] for m in messages)))
        return self.apply(messages, True, add_generation_prompt, tools, continue_final)

    def prompt(self, text: str, system: str | None = None) -> list[int]:
        """The prompt tokens of one user message (after a system message, if any)."""
        messages = [{"role": "system", "content": system}] if system else []
        return self.encode([*messages, {"role": "user", "content": text}])

    def _end_of_turn(self) -> set[int]:
        """The special token the template closes an assistant turn with, if any."""
        try:
            text = self.apply(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}],
                tokenize=False,
                add_generation_prompt=False,
            )
        except ChatTemplateError:  # templates may insist on other conversations; EOS will do
            return set()
        after = text.partition(_MARK)[2]
        ids = list(self.tokenizer.encode(after, add_special_tokens=False)) if after else []
        eos = set(self.tokenizer.eos_token_ids)
        if ids[1:] and eos & set(ids[1:]) and ids[0] not in eos:
            return set()  # an end of sequence closes the turn: what comes first is markup
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {})  # (Kimi K3's <|close|>)
        return {i for i in ids[:1] if i in decoder and decoder[i].special}


def _fallback(tokenizer: Any) -> str:
    """FALLBACK_TEMPLATE, after the BOS token when the tokenizer starts text with one."""
    bos = getattr(tokenizer, "bos_token_id", None)
    starts = bos is not None and list(tokenizer.encode("a"))[:1] == [bos]
    return ("{{ bos_token }}" if starts else "") + FALLBACK_TEMPLATE


_RENDERERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def renderer_for(tokenizer: Any, use_chat_template: bool = True) -> PromptRenderer:
    """The renderer of `tokenizer` (made once per tokenizer and setting)."""
    mine = _RENDERERS.setdefault(tokenizer, {})
    if use_chat_template not in mine:
        mine[use_chat_template] = PromptRenderer(tokenizer, use_chat_template)
    return mine[use_chat_template]


def wrap_tokenizer(hf: Any, detokenizer: Any, eos_token_ids: list[int] | None) -> TokenizerWrapper:
    """mlx-lm's `TokenizerWrapper` for a tokenizer built here (GGUF, Meta), with the
    tool-call parser mlx-lm's own loader infers from the chat template (thinking markers
    the wrapper finds itself): the server's tool calls are mlx-lm's, whatever the format."""
    from mlx_lm import tokenizer_utils
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    infer = getattr(tokenizer_utils, "_infer_tool_parser", lambda t: None)  # private
    kind = infer(hf)
    tools = {}
    if kind is not None:
        module = importlib.import_module(f"mlx_lm.tool_parsers.{kind}")
        tools = dict(
            tool_parser=module.parse_tool_call,
            tool_call_start=module.tool_call_start,
            tool_call_end=module.tool_call_end,
        )
    return TokenizerWrapper(hf, detokenizer, eos_token_ids=eos_token_ids, **tools)
