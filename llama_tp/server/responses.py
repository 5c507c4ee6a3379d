"""The OpenAI response formats: the JSON bodies and stream chunks of chat and text
completions, their usage and log-probabilities (for a `protocol.Request`)."""

from __future__ import annotations

import time
from typing import Any

from ..conversation.reply import ReplyDelta
from ..engine.batch import Event
from .protocol import Request


def usage(e: Event, drafts: bool = False) -> dict[str, Any]:
    """OpenAI's usage; for a request that asked for drafts, `completion_tokens_details`
    says how many drafted tokens were accepted (each one generated without a forward of
    its own, so completion_tokens - accepted is the number of decode forwards) and
    rejected."""
    u = {
        "prompt_tokens": e.prompt_tokens,
        "completion_tokens": e.completion_tokens,
        "total_tokens": e.prompt_tokens + e.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": e.cached_tokens},
    }
    if drafts or e.drafted:
        u["completion_tokens_details"] = {
            "accepted_prediction_tokens": e.accepted,
            "rejected_prediction_tokens": e.drafted - e.accepted,
        }
    return u


class Logprobs:
    """Collects a request's per-token log-probabilities in the endpoint's format."""

    def __init__(self, chat: bool, decode):
        self.chat, self.decode = chat, decode
        self.content: list[dict] = []
        self.legacy: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}

    def add(self, e: Event) -> dict | None:
        """Record `e`'s token; returns just this token's entry (for a stream chunk)."""
        tok = self.decode(e.token)
        tops = e.top_logprobs or []
        if self.chat:
            entry = {
                "token": tok,
                "logprob": e.logprob,
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": self.decode(i), "logprob": v, "bytes": list(self.decode(i).encode())}
                    for i, v in tops
                ],
            }
            self.content.append(entry)
            return {"content": [entry]}
        top = {self.decode(i): v for i, v in tops} if e.top_logprobs is not None else None
        self.legacy["tokens"].append(tok)
        self.legacy["token_logprobs"].append(e.logprob)
        self.legacy["top_logprobs"].append(top)
        return {"tokens": [tok], "token_logprobs": [e.logprob], "top_logprobs": [top]}

    def body(self) -> dict:
        return {"content": self.content} if self.chat else self.legacy


def completion_body(
    req: Request,
    rid: str,
    model: str,
    reply: ReplyDelta,
    finish: str,
    e: Event,
    lp: Logprobs | None,
    tool_calls: list[dict] | None = None,
) -> dict[str, Any]:
    """The non-streaming answer of either endpoint: the reply's content, its reasoning
    (`reasoning_content`, and `reasoning` as mlx-lm names it) and, for a chat, its tool
    calls (finish_reason "tool_calls")."""
    if req.chat:
        message = {"role": "assistant", "content": reply.content}
        choice = {"index": 0, "message": message}
        if tool_calls:
            message.update(content=reply.content or None, tool_calls=tool_calls)
            finish = "tool_calls"
    else:
        choice = message = {"index": 0, "text": reply.content}
    if reply.reasoning:
        message["reasoning_content"] = message["reasoning"] = reply.reasoning
    choice["logprobs"] = lp.body() if lp is not None else None
    choice["finish_reason"] = finish
    choice["stop_reason"] = e.stop_string  # vLLM's: the stop string that ended the reply
    return _envelope(req, rid, model, [choice], "chat.completion", e)


def chunk(
    req: Request,
    rid: str,
    model: str,
    piece: ReplyDelta | None,
    finish: str | None = None,
    logprobs: dict | None = None,
    role: bool = False,
    stop_reason: str | None = None,
) -> dict[str, Any]:
    """One streamed chunk of a reply's `piece`: chat deltas carry the role first, then
    pieces of reasoning (`reasoning_content`, and mlx-lm's `reasoning`), of content, or
    the calls' deltas (each with its index), one kind a chunk. The last one carries the
    finish_reason and (vLLM's) stop_reason: the stop string that ended the reply, if one
    did."""
    piece = piece or ReplyDelta()
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if piece.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = piece.reasoning
        if piece.content or (not piece and (role or logprobs is not None)):
            delta["content"] = piece.content
        if piece.calls:
            delta["tool_calls"] = piece.calls
        choice = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": piece.content}
        if piece.reasoning:
            choice["reasoning_content"] = choice["reasoning"] = piece.reasoning
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish
    if finish is not None:
        choice["stop_reason"] = stop_reason
    return _envelope(req, rid, model, [choice], "chat.completion.chunk")


def usage_chunk(req: Request, rid: str, model: str, e: Event) -> dict[str, Any]:
    """The stream's last chunk with `stream_options.include_usage`: no choices, the usage."""
    return _envelope(req, rid, model, [], "chat.completion.chunk", e)


def _envelope(
    req: Request, rid: str, model: str, choices: list, chat_object: str, e: Event | None = None
) -> dict[str, Any]:
    """What every answer and chunk carries around its choices (and the usage, given `e`)."""
    body = {
        "id": rid,
        "object": chat_object if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if e is not None:
        body["usage"] = usage(e, req.params.num_draft_tokens > 0)
    return body
