"""A proxied answer's stream, event by event, in each API's shape.

The front door holds a streamed answer until its first event that carries output (a
token, a finish, an error): everything before that (OpenAI's role chunk, Anthropic's
`message_start` and `content_block_start`) is preamble. A request whose ranks fail
before then has shown its client nothing, so it can be replayed after recovery and
the client sees one answer. After that, a fault ends the stream with an error event in
the API's shape (`fault_event`); an error answer that is not a stream is `error_body`.

    OpenAI (/v1/chat/completions, /v1/completions): server-sent events, `data: {...}`
    Anthropic (/v1/messages): server-sent events, `event: NAME` + `data: {...}`
    Ollama (/api/...): one JSON object per line
"""

from __future__ import annotations

import json
from typing import Any

PREAMBLE, OUTPUT, ERROR = "preamble", "output", "error"
_ANTHROPIC_PREAMBLE = {"message_start", "content_block_start", "ping"}


def api_of(path: str) -> str:
    """'anthropic', 'ollama' or 'openai': whose shapes the route at `path` speaks."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


def is_stream(content_type: str) -> bool:
    return content_type.startswith(("text/event-stream", "application/x-ndjson"))


class Events:
    """Splits a stream's bytes into whole events and classifies them."""

    def __init__(self, api: str, content_type: str):
        self.api = api
        self.lines = content_type.startswith("application/x-ndjson")
        self.sep = b"\n" if self.lines else b"\n\n"
        self._rest = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The whole events `data` completes (each with its separator)."""
        parts = (self._rest + data).split(self.sep)
        self._rest = parts.pop()
        return [p + self.sep for p in parts if p.strip()]

    def rest(self) -> bytes:
        """What is left of an event cut off by the stream's end."""
        rest, self._rest = self._rest, b""
        return rest

    def kind(self, event: bytes) -> str:
        """PREAMBLE, OUTPUT or ERROR (anything not understood counts as output: a request
        that may have shown something is never replayed)."""
        if self.lines:
            return _line_kind(_json(event))
        name, data = None, []
        for line in event.decode(errors="replace").splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        text = "\n".join(data)
        if name == "error":
            return ERROR
        if self.api == "anthropic":
            return PREAMBLE if name in _ANTHROPIC_PREAMBLE else OUTPUT
        if text == "[DONE]":
            return OUTPUT
        return _openai_kind(_json(text.encode()))

    def fault_event(self, message: str) -> bytes:
        """An error event ending the stream, in the API's shape."""
        if self.lines:
            return (json.dumps({"error": message}) + "\n").encode()
        if self.api == "anthropic":
            data = json.dumps(error_body("anthropic", message, 503))
            return f"event: error\ndata: {data}\n\n".encode()
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": 503}}
        return f"data: {json.dumps(body)}\n\n".encode()  # as the server's own (app.py)


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _openai_kind(obj: Any) -> str:
    if not isinstance(obj, dict):
        return OUTPUT
    if "error" in obj:
        return ERROR
    choices = obj.get("choices")
    if not choices:
        return OUTPUT  # a usage chunk, or something new
    for c in choices:
        delta = c.get("delta") or {}
        if c.get("finish_reason") or c.get("logprobs") or c.get("text"):
            return OUTPUT
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
            return OUTPUT
    return PREAMBLE


def _line_kind(obj: Any) -> str:
    if not isinstance(obj, dict):
        return OUTPUT
    if "error" in obj:
        return ERROR
    message = obj.get("message") or {}
    if obj.get("done") or obj.get("response") or message.get("content"):
        return OUTPUT
    if message.get("tool_calls") or message.get("thinking") or obj.get("thinking"):
        return OUTPUT
    return PREAMBLE


def error_body(api: str, message: str, status: int) -> dict:
    """An error answer's body in the API's shape (the server's own shapes)."""
    if api == "anthropic":
        kind = "rate_limit_error" if status == 429 else "api_error"
        return {"type": "error", "error": {"type": kind, "message": message}}
    if api == "ollama":
        return {"error": message}
    kind = "rate_limit_error" if status == 429 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": "unavailable"}}
