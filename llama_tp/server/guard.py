"""What every request meets before a route sees it, in one ASGI middleware (nothing of
the body is read before the checks that do not need it):

1. the Host it names must be one this server answers to (`Hosts`): a browser page that
   rebinds its own domain name to this machine's address (DNS rebinding) names that
   domain, and is refused;
2. the API key, on every route but `/health` and the chat page (`/`), compared in
   constant time: `Authorization: Bearer KEY` (the scheme in any case) or `x-api-key`;
3. a JSON content type on every POST (a cross-site form or `text/plain` body cannot be
   sent without the browser's preflight, which CORS then refuses);
4. the body's size: a declared length over the limit is refused before a byte is kept,
   a body that grows past it (chunked) when it does, and one that takes longer than
   BODY_SECONDS to arrive too; the body read is then handed to the route. The rest of
   a body refused as too large is read and dropped (up to DRAIN_BYTES, within
   DRAIN_SECONDS), so that a client still sending it reads the 413 rather than a reset.

Every response also carries `X-Content-Type-Options: nosniff`. The refusals are in the
error shape of the API the path belongs to (`error(path, RequestError)`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
from collections.abc import Callable

from .errors import RequestError

OPEN = ("/health", "/")  # paths served without the key (no data: probes and the page)
BODY_SECONDS = 60.0  # the longest a request body may take to arrive
DRAIN_BYTES = 64 << 20  # of a body refused as too large, read and dropped at most
DRAIN_SECONDS = 10.0
LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


class Hosts:
    """The names a request's Host may give: any IP address (a rebinding page names a
    domain, never an address), the local names, the bound host's own name, and `extra`
    (`--allowed-hosts`: names, `*.example.com` suffixes, or `*` for any). Bound to every
    interface (0.0.0.0, ::), the machine's own names are allowed too."""

    def __init__(self, bind_host: str = "127.0.0.1", extra: list[str] | None = None):
        names = {*LOCAL_NAMES, bind_host.lower().strip("[]")}
        if bind_host in ("0.0.0.0", "::", ""):
            hostname = socket.gethostname().lower()
            names |= {hostname, socket.getfqdn().lower(), f"{hostname}.local"}
        self.any = False
        self.suffixes: list[str] = []
        for h in extra or []:
            h = h.strip().lower()
            if h == "*":
                self.any = True
            elif h.startswith("*."):
                self.suffixes.append(h[1:])
            elif h:
                names.add(h)
        self.names = frozenset(names)

    def allows(self, host: str) -> bool:
        """Whether a Host header (`name`, `name:port`, `[v6]:port`) is one of ours."""
        if self.any:
            return True
        name = _hostname(host)
        if not name:
            return False
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        return name in self.names or any(name.endswith(s) for s in self.suffixes)


def _hostname(host: str) -> str:
    host = host.strip().lower().rstrip(".")
    if host.startswith("["):  # [v6]:port
        return host[1 : host.find("]")] if "]" in host else ""
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def key_matches(headers: dict[str, str], api_key: str) -> bool:
    """The key in `Authorization: Bearer KEY` (any case of the scheme) or `x-api-key`."""
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    bearer = secrets.compare_digest(token.strip().encode(), api_key.encode())
    bearer = bearer and scheme.lower() == "bearer"
    other = secrets.compare_digest(headers.get("x-api-key", "").encode(), api_key.encode())
    return bearer or other


def is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (
        kind.startswith("application/") and kind.endswith("+json")
    )


class Guard:
    """The ASGI middleware (see the module's docstring). `max_body()`: the body limit
    now (it follows the model once loaded); `error(path, e)`: the API's error body."""

    def __init__(
        self,
        app,
        *,
        hosts: Hosts,
        api_key: str | None,
        max_body: Callable[[], int],
        error: Callable[[str, RequestError], dict],
    ):
        self.app, self.hosts, self.api_key = app, hosts, api_key
        self.max_body, self.error = max_body, error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def secured(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-content-type-options", b"nosniff"),
                ]
            await send(message)

        try:
            body = await self._check(scope, receive)
        except RequestError as e:
            if e.status == 499:  # the client has gone: nobody to answer
                return None
            return await self._refuse(scope, secured, e)
        if body is None:
            return await self.app(scope, receive, secured)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then: the client's disconnect

        await self.app(scope, replay, secured)

    async def _check(self, scope, receive) -> bytes | None:
        """RequestError for a request refused here; else its body (None: not read, for
        requests that have none)."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not self.hosts.allows(host):
            raise RequestError(
                f"the Host {host[:100]!r} is not one this server answers to (a page "
                "rebinding its name to this address?); allow it with --allowed-hosts",
                None,
                403,
                "host_not_allowed",
            )
        path, method = scope["path"], scope["method"]
        if self.api_key is not None and path not in OPEN and not key_matches(headers, self.api_key):
            raise RequestError(
                "invalid or missing API key (Authorization: Bearer ... or x-api-key: ...)",
                None,
                401,
                "invalid_api_key",
            )
        if method not in ("POST", "PUT", "PATCH"):
            return None
        if not is_json(headers.get("content-type", "")):
            got = headers.get("content-type", "none")[:100]
            raise RequestError(
                f"the body must be JSON (Content-Type: application/json), got {got!r}",
                None,
                415,
                "unsupported_media_type",
            )
        limit = self.max_body()
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _drain(receive, int(declared))
            raise _too_large(int(declared), limit)
        return await _read(receive, limit)

    async def _refuse(self, scope, send, e: RequestError) -> None:
        from starlette.responses import JSONResponse

        # A refused body is not read: the connection closes after the answer.
        headers = {"connection": "close"} if e.status in (401, 403, 413, 415) else None
        response = JSONResponse(self.error(scope["path"], e), e.status, headers=headers)
        await response(scope, _nothing, send)


async def _nothing():
    return {"type": "http.disconnect"}


def _too_large(size: int, limit: int) -> RequestError:
    return RequestError(
        f"the body is {size} bytes; at most {limit} are read", None, 413, "body_too_large"
    )


async def _read(receive, limit: int) -> bytes:
    """The body, within `limit` bytes and BODY_SECONDS (RequestError 413 / 408)."""
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BODY_SECONDS
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise RequestError(
                f"the body did not arrive within {BODY_SECONDS:.0f} s", None, 408, "timeout"
            ) from None
        if message["type"] == "http.disconnect":
            raise RequestError("client closed the request", None, 499, None)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            if message.get("more_body", False):
                await _drain(receive, DRAIN_BYTES)
            raise _too_large(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _drain(receive, size: int) -> None:
    """Read and drop the rest of a refused body, when it is at most DRAIN_BYTES and
    arrives within DRAIN_SECONDS (else the connection closes on it)."""
    if size > DRAIN_BYTES:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DRAIN_SECONDS
    while loop.time() < deadline:
        try:
            message = await asyncio.wait_for(receive(), deadline - loop.time())
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
