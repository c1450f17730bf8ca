"""Model events: every state change of every model, for ``GET /admin/events`` (SSE) and
the console.

The pool's slots :meth:`EventHub.emit` as things happen (in the event loop, never
awaiting); each subscriber has its own bounded queue — a reader that falls behind
loses the oldest events (and is told how many), it never slows the pool down.

An event is a map: ``seq`` (1, 2, ... per router), ``at`` (unix time), ``model``,
``event`` and the event's own fields:

* ``state`` — every transition: ``from``, ``to``, ``reason`` (may be null), ``condition``
* ``loading`` — a load's progress: ``stage`` ``spawned`` (``pid``), ``connected``
  (the worker is loading), then the worker's own steps (``protocol.LoadProgress``,
  with ``done`` and ``total``): ``reading_gguf`` (0/1, 1/1), ``building_tokenizer`` (0/1, 1/1), ``preparing_tensors``
  (n/N GGUF tensors dequantized; none when the weight cache has them); ``still_loading``
  (``elapsed_s``, ``last``: the last step, e.g. ``"preparing_tensors 120/272"``, every
  5 s of a slow load), ``ready`` (``load_ms``, ``rss_bytes``)
* ``waiting`` — a wanted load waits for room (``why``); ``refused`` (``code``, ``why``)
* ``evicted`` (``for``: the model that needs the room), ``unloading`` (``reason``)
* ``unresponsive`` (``pid``, ``silent_s``: a ready worker owes a frame and sent none for
  ``unresponsive_after_s``), ``responsive`` (``pid``: it answers again)
* ``crashed`` (``reason``, ``exit_code``, ``signal``, ``restart_in_s``), ``load_failed``
  (``reason``, ``exit_code``), ``failed`` (``max_crashes`` reached: until an operator loads it)
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

#: Events a subscriber may fall behind by before the oldest are dropped.
QUEUE_LIMIT = 1000
#: Past events kept for a reader that asks to see the recent ones (``/admin/events?recent=N``).
HISTORY = 200

Event = dict[str, Any]


class EventHub:
    def __init__(self) -> None:
        self._seq = 0
        self._subs: set[asyncio.Queue[Event | None]] = set()
        self._history: collections.deque[Event] = collections.deque(maxlen=HISTORY)
        self.closed = False

    def emit(self, model: str, event: str, **fields: Any) -> Event:
        self._seq += 1
        ev: Event = {"seq": self._seq, "at": time.time(), "model": model, "event": event, **fields}
        self._history.append(ev)
        for q in self._subs:
            if q.full():
                q.get_nowait()  # this reader is behind: it loses the oldest
            q.put_nowait(ev)
        return ev

    @property
    def seq(self) -> int:
        """The last event's ``seq`` (0 before the first)."""
        return self._seq

    def recent(self, n: int) -> list[Event]:
        """The last ``n`` events (oldest first; at most :data:`HISTORY`)."""
        return list(self._history)[-n:] if n > 0 else []

    def subscribe(self) -> asyncio.Queue[Event | None]:
        q: asyncio.Queue[Event | None] = asyncio.Queue(QUEUE_LIMIT)
        if self.closed:
            q.put_nowait(None)
        self._subs.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[Event | None]) -> None:
        self._subs.discard(q)

    def close(self) -> None:
        """The router stops: every stream ends (None)."""
        self.closed = True
        for q in self._subs:
            if q.full():
                q.get_nowait()
            q.put_nowait(None)
