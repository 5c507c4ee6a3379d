"""Anthropic's answers, from the OpenAI chat route's: a chat completion as a Message
(`message`), its stream chunks as Anthropic's event sequence (`Events`: message_start,
ping, content_block_start / _delta / _stop for each thinking, text or tool_use block,
message_delta with the stop reason and usage, message_stop), and Anthropic's error body.
The requests' side is `server/anthropic.py`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def message(completion: dict[str, Any], stops: list[str], shown: bool = True) -> dict[str, Any]:
    """An OpenAI chat completion -> Anthropic's Message (`stops`: the request's
    stop_sequences, to tell "stop_sequence" from "end_turn"): its reasoning a thinking
    block first (its text left out unless `shown`)."""
    choice = completion["choices"][0]
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    text = msg.get("content") or ""
    thought = msg.get("reasoning_content") or ""
    content = [thinking_block(thought, shown)] if thought else []
    content += [{"type": "text", "text": text}] if text or not calls else []
    content += [tool_use(c) for c in calls]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), stops)
    return {
        "id": message_id(completion["id"]),
        "type": "message",
        "role": "assistant",
        "model": completion["model"],
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(completion.get("usage")),
    }


def signature(thought: str) -> str:
    """A thinking block's signature: opaque to clients, which hand it back with the
    block; the server renders the text it is given, so it signs nothing (a digest)."""
    return "llama_tp-" + hashlib.sha256(thought.encode()).hexdigest()[:32]


def thinking_block(thought: str, shown: bool = True) -> dict[str, Any]:
    text = thought if shown else ""
    return {"type": "thinking", "thinking": text, "signature": signature(thought)}


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call -> a tool_use block (its JSON arguments as the input object)."""
    f = call["function"]
    try:
        args = json.loads(f.get("arguments") or "{}")
    except ValueError:
        args = None
    args = args if isinstance(args, dict) else {"arguments": f.get("arguments")}
    return {"type": "tool_use", "id": call["id"], "name": f["name"], "input": args}


def stop_reason(finish: str | None, stop: Any, stops: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an OpenAI finish_reason; `stop` is the string that
    ended the reply (vLLM's choice.stop_reason), one of `stops` for "stop_sequence"."""
    if finish == "stop" and isinstance(stop, str) and stop in stops:
        return "stop_sequence", stop
    return STOP_REASONS.get(finish, "end_turn"), None


def usage(u: dict[str, Any] | None) -> dict[str, int]:
    """OpenAI's usage -> Anthropic's, where input_tokens leaves out the tokens read from
    the prompt cache (cache_read_input_tokens)."""
    u = u or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": u.get("prompt_tokens", 0) - cached,
        "output_tokens": u.get("completion_tokens", 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def message_id(rid: str) -> str:
    return "msg_" + rid.split("-", 1)[-1]


class Events:
    """OpenAI chat stream chunks -> Anthropic's server-sent events, chunk by chunk."""

    def __init__(self, stops: list[str], shown: bool = True):
        self.stops, self.shown = stops, shown
        self.thought: list[str] = []  # the open thinking block's text (its signature)
        self.started = False
        self.blocks = 0  # content blocks opened so far
        self.open: Any = None  # the open block: "text", a tool call's index, or None
        self.finish: str | None = None
        self.stop: Any = None
        self.usage: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one OpenAI chunk (an "error" chunk is Anthropic's error event)."""
        if "error" in chunk:
            return [sse("error", error_body(chunk["error"].get("message", ""), 500))]
        out = [] if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.thought.append(delta["reasoning_content"])
                if self.shown:
                    piece = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
                    out.append(self._delta(piece))
            if delta.get("content"):
                out += self._open("text", {"type": "text", "text": ""})
                text_delta = {"type": "text_delta", "text": delta["content"]}
                out.append(self._delta(text_delta))
            for call in delta.get("tool_calls") or []:
                key = ("tool", call.get("index", 0))
                if self.open != key:
                    f = call.get("function") or {}
                    block = {"type": "tool_use", "id": call.get("id"), "name": f.get("name")}
                    out += self._open(key, {**block, "input": {}})
                args = (call.get("function") or {}).get("arguments")
                if args:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
            if choice.get("finish_reason"):
                self.finish, self.stop = choice["finish_reason"], choice.get("stop_reason")
        return out

    def end(self) -> list[str]:
        """The closing events: the last block's stop, message_delta, message_stop."""
        out = [] if self.blocks else self._open("text", {"type": "text", "text": ""})
        out += self._close()
        reason, sequence = stop_reason(self.finish, self.stop, self.stops)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out.append(
            sse(
                "message_delta",
                {"type": "message_delta", "delta": delta, "usage": usage(self.usage)},
            )
        )
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out

    def _start(self, chunk: dict[str, Any]) -> list[str]:
        self.started = True
        msg = {
            "id": message_id(chunk.get("id", "")),
            "type": "message",
            "role": "assistant",
            "model": chunk.get("model"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(None),  # the counts come with message_delta
        }
        start = sse("message_start", {"type": "message_start", "message": msg})
        return [start, sse("ping", {"type": "ping"})]

    def _open(self, key: Any, block: dict[str, Any]) -> list[str]:
        if self.open == key:
            return []
        out = self._close()
        self.open = key
        self.blocks += 1
        start = {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}
        return [*out, sse("content_block_start", start)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # its signature, just before the block's stop
            sig = signature("".join(self.thought))
            out.append(self._delta({"type": "signature_delta", "signature": sig}))
        self.open = None
        stop = {"type": "content_block_stop", "index": self.blocks - 1}
        return [*out, sse("content_block_stop", stop)]

    def _delta(self, delta: dict[str, Any]) -> str:
        body = {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}
        return sse("content_block_delta", body)


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def error_body(message: str, status: int) -> dict[str, Any]:
    """Anthropic's error body for an answer of `status`."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
