"""What the hostile-input tests share: raw HTTP with any header or body, a server's
resident memory, the timing of a normal request beside hostile ones, and generated
malformed bodies (tests/test_hostile_input.py, tests/test_hostile_input_ranks.py)."""

from __future__ import annotations

import http.client
import json
import random
import socket
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from serve_client import KEY, Server, chat

AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}
QUESTION = "What is the capital of France?"
ATTEMPTS = 3
# Every route that reads a body, and how a minimal valid body looks on it.
ROUTES = {
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False},
        "reasoning_effort": "low",
        "reasoning_budget_tokens": 1,
    },
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/messages": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "thinking": {"type": "enabled", "budget_tokens": 1},
    },
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2},
    "/v1/responses/input_tokens": {"input": "hi"},
    "/api/chat": {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": False,
        "options": {"num_predict": 2},
        "think": True,
    },
    "/api/generate": {"prompt": "hi", "stream": False, "options": {"num_predict": 2}},
    "/api/show": {"model": "m"},
    "/v1/embeddings": {"input": ["hi", "there"]},
    "/api/embed": {"input": "hi"},
    "/api/embeddings": {"prompt": "hi"},
}
GETS = (
    "/health",
    "/",
    "/v1/models",
    "/v1/status",
    "/metrics",
    "/openapi.json",
    "/api/tags",
    "/api/ps",
    "/api/version",
)


def raw(
    s: Server, method: str, path: str, body: bytes | None = None, headers=None, timeout: float = 60
) -> tuple[int, dict, str]:
    """(status, headers, text) of one request with exactly these headers (none added but
    Host and Content-Length)."""
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


def post(s: Server, path: str, body, headers=None, timeout: float = 60) -> tuple[int, str]:
    """(status, text) of a JSON POST with the key (`body`: bytes, or a value to encode)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, text = raw(s, "POST", path, data, {**AUTH, **JSON, **(headers or {})}, timeout)
    return status, text


def message(text: str) -> str:
    """An error body's message, in any of the three APIs' shapes."""
    body = json.loads(text)
    err = body.get("error")
    return err if isinstance(err, str) else err["message"]


def token_ids(model: Path, text: str) -> list[int]:
    """The token ids of `text` in the tokenizer of the checkpoint at `model`."""
    from llama_tp.checkpoints import open_checkpoint
    from llama_tp.checkpoints.tokenizer import load_tokenizer

    return load_tokenizer(open_checkpoint(model)).encode(text)


def resident(pid: int) -> int:
    """A process's resident memory, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def declared_only(s: Server, path: str, size: int, key: bool) -> tuple[int, float]:
    """(status, seconds) of a POST that declares a `size`-byte body and sends 64 KiB of
    it: the answer must come without the rest."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        head += f"Authorization: Bearer {KEY}\r\n" if key else ""
        head += f"Content-Length: {size}\r\n\r\n"
        sock.sendall(head.encode() + b"[" * 65536)
        reply = b""
        while b"\r\n" not in reply:
            got = sock.recv(4096)
            if not got:
                break
            reply += got
    return int(reply.split()[1]), time.monotonic() - t0


class Normal:
    """The normal request beside the hostile ones: its greedy text and its time alone."""

    def __init__(self, s: Server):
        self.s = s
        self.client = s.client(timeout=300)
        self.text = self.ask()[1]
        self.alone = statistics.median(self.ask()[0] for _ in range(3))

    def ask(self) -> tuple[float, str]:
        t0 = time.monotonic()
        text = chat(self.client, QUESTION, max_tokens=8)[0]
        return time.monotonic() - t0, text

    def beside(
        self, hostile: Callable[[], object], n: int = 1, like: Callable[[], object] | None = None
    ) -> list:
        """Run `n` copies of `hostile` and, a moment after they start, the normal request:
        it must give its own text, within 1 s (and twice its time, for a loaded machine)
        of its time alone, or of its time beside `n` copies of `like` (the same load
        without what makes it hostile: requests that share the batch slow it anyway).
        A busy machine's noise gets up to ATTEMPTS tries. The hostile calls' results."""
        seen = []
        for _ in range(ATTEMPTS):
            reference = self.alone if like is None else self._beside(like, n)[0]
            took, results = self._beside(hostile, n)
            seen.append((round(took, 2), round(reference, 2)))
            print(f"beside: {took:.2f} s, without: {reference:.2f} s")  # shown by pytest -s
            if took < 2 * reference + 1.0:
                return results
        raise AssertionError(f"(seconds beside, seconds without) in each try: {seen}")

    def _beside(self, calls: Callable[[], object], n: int) -> tuple[float, list]:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(calls) for _ in range(n)]
            time.sleep(0.05)
            took, text = self.ask()
            results = [f.result() for f in futures]
        assert text == self.text, (text, self.text)
        return took, results


# -- generated malformed bodies -----------------------------------------------------------

_ODD = [
    None,
    True,
    -1,
    0,
    2**64,
    -(2**63) - 1,
    1e308,
    -1e-300,
    3.5,
    "",
    "x" * 300,
    "\ud800",
    [],
    {},
    [[]],
    {"": {}},
    "NaN",
    [None] * 3,
]
_FIELDS = [
    "messages",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "n",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "repetition_context_size",
    "response_format",
    "tools",
    "tool_choice",
    "num_draft_tokens",
    "options",
    "format",
    "system",
    "stop_sequences",
    "raw",
    "continue_final_message",
    "max_completion_tokens",
    "stream_options",
    "input",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "text",
    "reasoning",
    "store",
]


def _odd(rng: random.Random, depth: int = 0):
    pick = rng.random()
    if pick < 0.6 or depth > 3:
        return rng.choice(_ODD)
    if pick < 0.8:
        return [_odd(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        rng.choice(_FIELDS + ["role", "content", "type"]): _odd(rng, depth + 1)
        for _ in range(rng.randint(0, 3))
    }


def _mutate(rng: random.Random, value, depth: int = 0):
    """`value` with one random change somewhere inside."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        return {**value, key: _mutate(rng, value[key], depth + 1)}
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = rng.randrange(len(value))
        return [*value[:i], _mutate(rng, value[i], depth + 1), *value[i + 1 :]]
    if isinstance(value, dict) and rng.random() < 0.5:
        return {**value, rng.choice(_FIELDS): _odd(rng)}
    return _odd(rng)


def malformed(rng: random.Random, valid: dict) -> tuple[bytes, dict]:
    """A malformed body for a route whose minimal valid body is `valid`, and the headers
    to send it with."""
    kind = rng.random()
    headers = {**AUTH, **JSON}
    if kind < 0.55:  # a valid body with a few values changed
        body = valid
        for _ in range(rng.randint(1, 3)):
            body = _mutate(rng, body)
        data = json.dumps(body).encode()
    elif kind < 0.65:  # cut short
        text = json.dumps(valid).encode()
        data = text[: rng.randrange(len(text))]
    elif kind < 0.75:  # bytes
        data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    elif kind < 0.85:  # deep
        depth = rng.choice([70, 1000, 100_000])
        data = (b"[" * depth + b"]" * depth) if rng.random() < 0.5 else b'{"a":' * depth
    elif kind < 0.92:  # literals Python's json reads and JSON has not
        data = json.dumps(valid).encode()[:-1] + rng.choice([b', "x": NaN}', b', "x": -Infinity}'])
    else:  # another content type
        data = json.dumps(valid).encode()
        headers["Content-Type"] = rng.choice(
            ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""]
        )
    return data, headers
