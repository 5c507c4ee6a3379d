"""The Responses API's answers, from the OpenAI chat route's: a chat completion as a
response object (`respond`), its stream chunks as the Responses event sequence (`Events`),
each event with its `sequence_number`:

    response.created, response.in_progress,
    per output item: response.output_item.added, then
      reasoning: response.content_part.added (reasoning_text), response.reasoning_text.delta
                 ... .done, response.content_part.done (and with `reasoning.summary`
                 the same text as summary: response.reasoning_summary_part.added,
                 response.reasoning_summary_text.delta ... .done, ..._part.done)
      message:   response.content_part.added (output_text), response.output_text.delta
                 ... .done, response.content_part.done
      function call: response.function_call_arguments.delta ... .done
    response.output_item.done,
    response.completed (response.incomplete when max_output_tokens cut the reply short;
    error and response.failed when it failed).

The output items: a `reasoning` item when the reply has `reasoning_content` (its text as
`content` [reasoning_text], the raw reasoning; `summary` [summary_text] holds the same
text when the request asked for a summary: there is no other), a `message` with the
`output_text`, a `function_call` per tool call (`call_id` the call's id). The request's
side is server/responses_request.py.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from .responses_request import Turn

INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_body(
    rid: str,
    created: int,
    turn: Turn,
    model: str | None,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    finish: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A response object (`finish`: the chat finish_reason, for why it is incomplete)."""
    body = {"id": rid, "object": "response", "created_at": created, "status": status}
    if status in ("completed", "incomplete"):
        body["completed_at"] = int(time.time())
    reason = INCOMPLETE.get(finish or "", "max_output_tokens")
    body.update(
        error=error,
        incomplete_details={"reason": reason} if status == "incomplete" else None,
        model=model,
        output=output,
        usage=usage,
        **turn.echo,
    )
    return body


def usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI chat usage -> the Responses API's."""
    if not u:
        return None
    details = u.get("completion_tokens_details") or {}
    return {
        "input_tokens": u.get("prompt_tokens", 0),
        "input_tokens_details": {
            "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        },
        "output_tokens": u.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or 0},
        "total_tokens": u.get("prompt_tokens", 0) + u.get("completion_tokens", 0),
    }


def status_of(finish: str | None) -> str:
    return "incomplete" if finish in INCOMPLETE else "completed"


def reasoning_item(iid: str, text: str, summary: bool, status: str) -> dict[str, Any]:
    return {
        "id": iid,
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": text}] if summary else [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def message_item(iid: str, text: str, logprobs: list | None, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"id": iid, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    f = call.get("function") or {}
    return {
        "id": "fc_" + call["id"].removeprefix("call_"),
        "type": "function_call",
        "call_id": call["id"],
        "name": f.get("name", ""),
        "arguments": f.get("arguments") or "",
        "status": status,
    }


def reasoning_of(m: dict[str, Any]) -> str:
    """The reasoning of a chat message or delta (`reasoning_content`, or mlx-lm's name)."""
    text = m.get("reasoning_content")
    return (m.get("reasoning") if text is None else text) or ""


def respond(completion: dict[str, Any], rid: str, created: int, turn: Turn) -> dict[str, Any]:
    """An OpenAI chat completion -> the response object."""
    choice = completion["choices"][0]
    msg, finish = choice["message"], choice.get("finish_reason")
    status = status_of(finish)
    reasoning, text, calls = reasoning_of(msg), msg.get("content") or "", msg.get("tool_calls")
    output = []
    if reasoning:
        output.append(reasoning_item(new_id("rs"), reasoning, turn.summary, "completed"))
    if text or not (reasoning or calls):
        logprobs = (choice.get("logprobs") or {}).get("content")
        output.append(message_item(new_id("msg"), text, logprobs, "completed"))
    output += [call_item(c, "completed") for c in calls or []]
    output[-1]["status"] = status  # the item the reply ended in
    u = usage(completion.get("usage"))
    return response_body(rid, created, turn, completion.get("model"), status, output, u, finish)


class Events:
    """OpenAI chat stream chunks -> the Responses API's server-sent events, chunk by
    chunk; `response` is the final response object once `end` (or a failure) has run."""

    def __init__(self, rid: str, created: int, turn: Turn):
        self.rid, self.created, self.turn = rid, created, turn
        self.seq = 0  # the next event's sequence_number
        self.started = False
        self.model: str | None = None
        self.items: list[dict[str, Any]] = []  # the output so far
        self.kind: str | None = None  # what the open items are: reasoning, message, calls
        self.open: list[int] = []  # the open items' output indexes
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its output index
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.response: dict[str, Any] | None = None

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """The events of one chat chunk (an "error" chunk fails the response)."""
        out = [] if self.started else self._start(chunk)
        if "error" in chunk:
            return out + self._failed(chunk["error"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if reasoning := reasoning_of(delta):
                out += self._reasoning(reasoning)
            if delta.get("content"):
                out += self._text(delta["content"], (choice.get("logprobs") or {}).get("content"))
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def end(self) -> list[str]:
        """The closing events: the open items' done events, then response.completed (or
        response.incomplete); none after a failure."""
        if self.response is not None:
            return []
        out = [] if self.started else self._start({})
        if not self.items:  # an empty reply is an empty message, as when not streamed
            out += self._text("", None)
        status = status_of(self.finish)
        out += self._close(status)
        self.response = self._body(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self.response)]

    def _start(self, chunk: dict[str, Any]) -> list[str]:
        self.started, self.model = True, chunk.get("model")
        body = self._body("in_progress")
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def _failed(self, error: dict[str, Any]) -> list[str]:
        """An error event and response.failed (the request's own failure, a 4xx status as
        its code, is an invalid prompt; any other the server's)."""
        message, status = error.get("message") or "the response failed", error.get("code")
        code = "invalid_prompt" if isinstance(status, int) and status < 500 else "server_error"
        out = self._close("incomplete")
        out.append(self._event("error", code=code, message=message, param=error.get("param")))
        self.response = self._body("failed", {"code": code, "message": message})
        return out + [self._event("response.failed", response=self.response)]

    def _body(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        output = [] if status == "in_progress" else self.items
        u = None if status == "in_progress" else usage(self.usage)
        return response_body(
            self.rid, self.created, self.turn, self.model, status, output, u, self.finish, error
        )

    # -- the output items ---------------------------------------------------------------

    def _reasoning(self, text: str) -> list[str]:
        out = []
        if self.kind != "reasoning":
            item = reasoning_item(new_id("rs"), "", self.turn.summary, "in_progress")
            out = self._open("reasoning", item)
        i = self.open[-1]
        item = self.items[i]
        item["content"][0]["text"] += text
        out.append(self._delta("response.reasoning_text.delta", i, content_index=0, delta=text))
        if self.turn.summary:
            item["summary"][0]["text"] += text
            kind = "response.reasoning_summary_text.delta"
            out.append(self._delta(kind, i, summary_index=0, delta=text))
        return out

    def _text(self, text: str, logprobs: list | None) -> list[str]:
        out = []
        if self.kind != "message":
            out = self._open("message", message_item(new_id("msg"), "", None, "in_progress"))
        i = self.open[-1]
        part = self.items[i]["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs or []
        if text:
            out.append(
                self._delta(
                    "response.output_text.delta",
                    i,
                    content_index=0,
                    delta=text,
                    logprobs=logprobs or [],
                )
            )
        return out

    def _call(self, call: dict[str, Any]) -> list[str]:
        """A tool call's delta: its first opens a function_call item (the calls of a
        reply stay open together until another kind of item or the end)."""
        out, index = [], call.get("index", 0)
        fragment = (call.get("function") or {}).get("arguments") or ""
        if index not in self.calls:
            first = {**call, "id": call.get("id") or new_id("call")}
            first["function"] = {**(call.get("function") or {}), "arguments": ""}
            out = self._open("calls", call_item(first, "in_progress"))
            self.calls[index] = self.open[-1]
        i = self.calls[index]
        self.items[i]["arguments"] += fragment
        if fragment:
            out.append(self._delta("response.function_call_arguments.delta", i, delta=fragment))
        return out

    def _open(self, kind: str, item: dict[str, Any]) -> list[str]:
        """Open `item` (closing the open items of another kind): output_item.added, and
        the content part (or summary part) its text streams into."""
        out = self._close("completed") if self.kind != kind else []
        self.kind = kind
        i = len(self.items)
        self.items.append(item)
        self.open.append(i)
        added = {**item, **{k: [] for k in ("content", "summary") if k in item}}
        out.append(self._event("response.output_item.added", output_index=i, item=added))
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            out.append(self._delta("response.content_part.added", i, content_index=0, part=part))
            if self.turn.summary:
                part = {"type": "summary_text", "text": ""}
                kind = "response.reasoning_summary_part.added"
                out.append(self._delta(kind, i, summary_index=0, part=part))
        elif kind == "message":
            part = {**item["content"][0], "text": "", "logprobs": []}
            out.append(self._delta("response.content_part.added", i, content_index=0, part=part))
        return out

    def _close(self, status: str) -> list[str]:
        """The open items' done events, the last one ending with `status`."""
        out = []
        for n, i in enumerate(self.open):
            item = self.items[i]
            item["status"] = status if n == len(self.open) - 1 else "completed"
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                part = {"type": "reasoning_text", "text": text}
                out.append(
                    self._delta("response.reasoning_text.done", i, content_index=0, text=text)
                )
                out.append(self._delta("response.content_part.done", i, content_index=0, part=part))
                if self.turn.summary:
                    part = {"type": "summary_text", "text": text}
                    out.append(
                        self._delta(
                            "response.reasoning_summary_text.done", i, summary_index=0, text=text
                        )
                    )
                    out.append(
                        self._delta(
                            "response.reasoning_summary_part.done", i, summary_index=0, part=part
                        )
                    )
            elif item["type"] == "message":
                part = item["content"][0]
                out.append(
                    self._delta(
                        "response.output_text.done",
                        i,
                        content_index=0,
                        text=part["text"],
                        logprobs=part["logprobs"],
                    )
                )
                out.append(self._delta("response.content_part.done", i, content_index=0, part=part))
            else:
                out.append(
                    self._delta(
                        "response.function_call_arguments.done",
                        i,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            out.append(self._event("response.output_item.done", output_index=i, item=item))
        self.kind, self.open = None, []
        return out

    def _delta(self, kind: str, i: int, **fields: Any) -> str:
        """An event about output item `i` (its id and index with `fields`)."""
        return self._event(kind, item_id=self.items[i]["id"], output_index=i, **fields)

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
