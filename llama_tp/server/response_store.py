"""The responses the Responses API keeps (`store`, on by default as in OpenAI's): each one's
response object, for `GET /v1/responses/{id}`, and its whole conversation (the input items
of every turn up to it and its output items), which a request naming it as
`previous_response_id` continues.

The store is bounded in count and in bytes (`--responses-store-size`,
`--responses-store-bytes`), the oldest evicted first. A response counts the bytes of its
whole conversation (its predecessor's, this request's body, its answer), although turns
share their items in memory: a bound on the sum always holds, and a long chain gives up
its earlier responses first, while its latest (the one a client continues) stays. A
response larger than the byte bound alone is not kept. One lock guards it: requests are
prepared on worker threads and answered on the event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

COUNT = 256  # responses kept, by default
BYTES = 64 << 20  # bytes of their conversations, by default


@dataclass(frozen=True)
class Stored:
    """A kept response: its object, its conversation (input and output items, oldest
    first; tuples shared with the turns after it) and the bytes it counts."""

    response: dict[str, Any]
    items: tuple[dict[str, Any], ...]
    size: int


class ResponseStore:
    """At most `count` responses of at most `size` bytes in all, oldest evicted first
    (count 0: none is kept)."""

    def __init__(self, count: int = COUNT, size: int = BYTES):
        if count < 0 or size < 0:
            raise ValueError(f"a store of {count} responses and {size} bytes: both must be >= 0")
        self.count, self.size = count, size
        self._held: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, rid: str, stored: Stored) -> bool:
        """Keep `stored` as `rid`, evicting the oldest until it fits; False when it cannot
        be kept (larger than the byte bound, or a count of 0)."""
        if self.count == 0 or stored.size > self.size:
            return False
        with self._lock:
            self._drop(rid)
            while self._held and (
                len(self._held) >= self.count or self._bytes + stored.size > self.size
            ):
                self._drop(next(iter(self._held)))
            self._held[rid] = stored
            self._bytes += stored.size
        return True

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            return self._held.get(rid)

    def delete(self, rid: str) -> bool:
        """Forget `rid`; False when it is not held."""
        with self._lock:
            return self._drop(rid)

    def usage(self) -> tuple[int, int]:
        """(responses held, bytes they count)."""
        with self._lock:
            return len(self._held), self._bytes

    def _drop(self, rid: str) -> bool:
        gone = self._held.pop(rid, None)
        if gone is None:
            return False
        self._bytes -= gone.size
        return True
