"""The Responses API's stored responses: bounded, in memory, forgotten after a TTL.

A stored entry is the response object as answered (for ``GET /v1/responses/{id}``)
and the conversation it ends (for ``previous_response_id``): every turn of its
input, the earlier chain's included, and its own output — but not its
``instructions``, which (as OpenAI documents) are not carried over.

Bounds (``[server]`` keys): at most ``responses_store_max`` entries (the oldest is
dropped first; 0 stores nothing), each kept ``responses_store_ttl_s`` seconds
after it was stored (0: no expiry). Lost on restart. Single-threaded (the
router's event loop), so no lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from router.dialects.tools import ChatTurn


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    turns: list[ChatTurn]  # the conversation up to and including its output
    stored_at: float  # monotonic seconds


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def _expire(self) -> None:
        if self.ttl_s <= 0:
            return
        limit = self._clock() - self.ttl_s
        while self._items:
            key, first = next(iter(self._items.items()))
            if first.stored_at > limit:
                break
            del self._items[key]

    def put(self, rid: str, response: dict[str, Any], turns: list[ChatTurn]) -> None:
        if self.max_entries <= 0:
            return
        self._expire()
        self._items[rid] = StoredResponse(response, list(turns), self._clock())
        self._items.move_to_end(rid)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        self._expire()
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        self._expire()
        return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._items)


def store_of(request: Request) -> ResponseStore:
    """The app's one store (made by ``router.app.create_app`` from the ``[server]`` keys)."""
    st: ResponseStore = request.app.state.responses
    return st
