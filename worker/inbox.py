"""A helper thread of one loaded engine with an inbox (:class:`InboxThread`): the prep thread
(``worker.prep``: a started Generate's prompt ids) and the text thread (``worker.textops``:
Tokenize / Detokenize / ApplyTemplate) are two, each off the engine thread."""

from __future__ import annotations

import queue
import threading
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class InboxThread(Generic[T]):
    """A daemon thread named ``name`` that handles each submitted item with :meth:`_handle`, one at a
    time in submission order, once :meth:`start` has given it the engine (items submitted before
    wait); :meth:`stop` ends it after the items submitted before."""

    def __init__(self, name: str) -> None:
        self._engine: Any = None
        self._inbox: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self, engine: Any) -> None:
        self._engine = engine
        self._thread.start()

    def submit(self, item: T) -> None:
        """Handle ``item`` after the ones submitted before."""
        self._inbox.put(item)

    def stop(self) -> None:
        self._inbox.put(None)

    def _main(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            self._handle(item)

    def _handle(self, item: T) -> None:
        raise NotImplementedError
