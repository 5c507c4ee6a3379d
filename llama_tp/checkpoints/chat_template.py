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
import re
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
_THINKING = re.compile(r"""(\.thinking\b|['"]thinking['"]\s+in\s+message)""")


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (e.g. a system message it does not allow)."""


def _thinking_as_read(messages: list[dict]) -> list[dict]:
    """`messages` with each earlier reply's reasoning (`reasoning_content`) also as
    `thinking`, the name gpt-oss's template reads it by."""
    return [
        {**m, "thinking": m["reasoning_content"]}
        if m.get("reasoning_content") and "thinking" not in m
        else m
        for m in messages
    ]


class PromptRenderer:
    """How `tokenizer` turns messages into prompt tokens (see the module docstring)."""

    def __init__(self, tokenizer: Any, use_chat_template: bool = True):
        self.tokenizer, self.use_chat_template = tokenizer, use_chat_template
        self.template = None if tokenizer.has_chat_template else _fallback(tokenizer)
        self.stops: tuple[str, ...] = (
            (FALLBACK_STOP,) if use_chat_template and self.template else ()
        )
        template = getattr(tokenizer, "chat_template", None)
        # an earlier reply's reasoning: most templates read `reasoning_content` (or drop
        # it); gpt-oss's reads `thinking`
        self.reads_thinking = isinstance(template, str) and bool(_THINKING.search(template))
        self.eos = frozenset(tokenizer.eos_token_ids) | self._end_of_turn()

    def apply(
        self,
        messages: list[dict],
        tokenize: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final: bool = False,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """`messages` through the chat template (or the fallback): token ids, or text.
        `tools`: OpenAI's tool definitions, for the template to show (transformers' way).
        `continue_final`: the last message is left open for the model to continue (a
        "prefill"), transformers' `continue_final_message`: no end of turn after it.
        `template_kwargs`: the template's own variables (`enable_thinking`, ...)."""
        if self.reads_thinking:
            messages = _thinking_as_read(messages)
        kwargs = {**template_kwargs}
        if self.template:
            kwargs["chat_template"] = self.template
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
        **template_kwargs: Any,
    ) -> list[int]:
        """The prompt tokens of `messages`, ending with the assistant's generation prompt
        (or, with `continue_final`, with the last message's text, for the model to go on);
        `template_kwargs`: the template's own variables."""
        if not self.use_chat_template:  # plain text: nothing closes the last message anyway
            return list(self.tokenizer.encode("\n".join(m["content"] for m in messages)))
        return self.apply(
            messages, True, add_generation_prompt, tools, continue_final, **template_kwargs
        )

    def prompt(self, text: str, system: str | None = None) -> list[int]:
        """The prompt tokens of one user message (after a system message, if any)."""
        messages = [{"role": "system", "content": system}] if system else []
        return self.encode([*messages, {"role": "user", "content": text}])

    def _end_of_turn(self) -> set[int]:
        """The special token the template closes an assistant turn with, if any: the first
        after the reply, past whitespace and past tags (a special token with a name after
        it, to the next special token: Kimi K3's `<|close|>message<|sep|>` before its
        `<|end_of_msg|>`; its `<|close|>` also closes a think block)."""
        try:
            text = self.apply(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}],
                tokenize=False,
                add_generation_prompt=False,
            )
        except ChatTemplateError:  # templates may insist on other conversations; EOS will do
            return set()
        after = text.partition(_MARK)[2]
        ids = list(self.tokenizer.encode(after, add_special_tokens=False))[:16] if after else []
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {})

        def special(i: int) -> bool:
            return i in decoder and decoder[i].special

        def text_at(k: int) -> bool:  # a token of text, not whitespace
            return (
                k < len(ids)
                and not special(ids[k])
                and bool(self.tokenizer.decode([ids[k]]).strip())
            )

        k = 0
        while k < len(ids):
            if not special(ids[k]):
                if text_at(k):
                    return set()  # text after the reply: no token of its own ends it
                k += 1
            elif text_at(k + 1):  # a tag: past its name and the special token closing it
                k += 1
                while k < len(ids) and not special(ids[k]):
                    k += 1
                k += 1
            else:
                return {ids[k]}
        return set()


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
