"""The worker state machine of one model: its states, the allowed transitions, and the
one object that applies them.

States of a model's worker::

    unloaded --first request / admin load / a place freed (max_loaded, memory)--> loading
    loading  --Ready--> ready
    loading  --Error(load_failed) / exit / load_timeout_s--> failed
    loading  --admin unload / router shutdown--> unloaded
    ready    --admin unload / idle_ttl_s / evicted / router shutdown--> draining
    ready    --process exit / killed as hung--> failed
    ready    --a frame owed (running job, Ping) not seen for unresponsive_after_s--> unresponsive
    unresponsive --any frame (Token, Pong) arrives--> ready
    unresponsive --no Pong within ping_timeout_s: killed as hung / process exit--> failed
    unresponsive --admin unload / router shutdown (no drain: it cannot finish)--> draining
    draining --running requests done, worker stopped--> unloaded
    failed   --next request after the crash backoff / admin load--> loading
    failed   --admin unload--> unloaded

``unresponsive`` is a ready worker that has gone silent (SIGSTOPped, a stuck
thread): it keeps its running requests (they fail with the SSE error event if it
is killed) but no new job is handed to it; requests wait in the model's queue
and run on it when it answers again, or on the restarted worker once it has
been killed. The judge is the slot's ping loop (``router.workers.liveness``, the one task
that watches a ready worker's liveness).

``failed`` keeps the reason and the exit code; it is distinct from ``unloaded``
(the operator's choice, idleness or eviction). :class:`Lifecycle` holds the state;
``router.workers.slot.ModelSlot`` owns one and is the only caller of :meth:`Lifecycle.move`
(its :meth:`~router.workers.slot.ModelSlot.move`, called by the slot and the parts it makes:
``router.workers.loading``, ``router.workers.unloading``).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

log = logging.getLogger("modelyard.pool")


class WorkerState(enum.StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    UNRESPONSIVE = "unresponsive"
    DRAINING = "draining"
    FAILED = "failed"


#: Allowed transitions (see the module docstring).
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.UNLOADED: frozenset({WorkerState.LOADING}),
    WorkerState.LOADING: frozenset({WorkerState.READY, WorkerState.FAILED, WorkerState.UNLOADED}),
    WorkerState.READY: frozenset({WorkerState.DRAINING, WorkerState.FAILED, WorkerState.UNRESPONSIVE}),
    WorkerState.UNRESPONSIVE: frozenset({WorkerState.READY, WorkerState.FAILED, WorkerState.DRAINING}),
    WorkerState.DRAINING: frozenset({WorkerState.UNLOADED}),
    WorkerState.FAILED: frozenset({WorkerState.LOADING, WorkerState.UNLOADED}),
}


#: States in which the model holds a live, loaded worker (it may run requests).
LOADED = frozenset({WorkerState.READY, WorkerState.UNRESPONSIVE})


class Lifecycle:
    """One model's state. :meth:`move` checks the table, logs, and tells the listener."""

    def __init__(self, model: str, on_change: Callable[[WorkerState, WorkerState, str | None], None]) -> None:
        self.model = model
        self.state = WorkerState.UNLOADED
        self._on_change = on_change

    def move(self, new: WorkerState, note: str | None = None) -> None:
        """Go to ``new``; RuntimeError if the table does not allow it."""
        old = self.state
        if new not in TRANSITIONS[old]:
            raise RuntimeError(f"{self.model}: illegal transition {old} -> {new}")
        log.info("model %s: %s -> %s%s", self.model, old, new, f" ({note})" if note else "")
        self.state = new
        self._on_change(old, new, note)
