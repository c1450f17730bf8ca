"""The router's one record of a generation request, from admission to release.

A :class:`RequestRecord` is the request's place in its model's admission (it *is* the
``router.workers.admission.Ticket``), the inbox the worker connection routes its frames
to by id, and everything the router knows of it: the Generate sent, its state, the
worker it was granted, its timings and token counts, and how it ended. Its one owner
is the model's serving object (``router.serving.server.ModelServer``), which alone
moves its state; the admission grants it a worker (``queued -> running``) through
:meth:`RequestRecord.grant`, the one step it takes on the owner's behalf.

States, in order (each recorded once, with a note, in :attr:`RequestRecord.history`)::

    queued  --granted a worker's job slot-->        running
    queued  --refused / withdrawn (client left)-->  done
    running --Done / Error / worker gone / cancelled and the worker let go--> done
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocol import Accepted, Generate
from router.workers.admission import Ticket
from router.workers.connection import StreamItem

if TYPE_CHECKING:
    from router.workers.process import WorkerProcess


class RecordState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class RequestRecord(Ticket):
    """One generation request (see the module docstring). Times: monotonic seconds."""

    model: str = ""
    msg: Generate | None = None  # the Generate sent (set once it is sent)
    state: RecordState = RecordState.QUEUED
    #: (state, monotonic time, note) for every state it took, in order
    history: list[tuple[RecordState, float, str | None]] = field(default_factory=list)
    #: the worker's frames for this request id (the worker connection routes them here)
    inbox: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    access: dict[str, Any] = field(default_factory=dict)  # the access log's figures (router.http.access_log)
    early: bool = False  # the stream opens before its first token: its reader gets the Accepted frame
    accepted: Accepted | None = None  # the worker's Accepted frame, once it came
    sent: bool = False  # its Generate went to the worker
    queue_time_s: float | None = None  # admission to its reader seeing its turn (the queue-time metric)
    n_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float = 0.0
    ended: bool = False  # its final frame (or the worker's death) has been accounted for (metrics)
    outcome: str | None = None  # how it ended: "stop", "length", ..., "error:<code>", "cancelled", "refused"
    closed: bool = False  # its reader is done with it (ended, or cancelled: the worker may still owe its end)
    released: bool = False  # its job slot is given back (or it never had one)
    released_at: float | None = None

    def __post_init__(self) -> None:
        self.history.append((RecordState.QUEUED, self.admitted_at, None))

    # the owner's steps (router.serving.server.ModelServer), and admission's grant

    def move(self, new: RecordState, note: str | None = None) -> None:
        """Go to ``new`` (only forward: queued -> running -> done; queued -> done)."""
        order = list(RecordState)
        if order.index(new) <= order.index(self.state):
            raise RuntimeError(f"request {self.id}: illegal transition {self.state} -> {new}")
        self.state = new
        self.history.append((new, time.monotonic(), note))

    def grant(self, worker: WorkerProcess) -> None:
        super().grant(worker)
        self.move(RecordState.RUNNING, f"worker {worker.serial}")

    @property
    def states(self) -> list[str]:
        """The states it took, in order (``["queued", "running", "done"]``)."""
        return [s.value for s, _, _ in self.history]

    def describe(self) -> dict[str, Any]:
        """The record as the operator sees it (times in ms since admission)."""
        t0 = self.admitted_at
        return {
            "id": self.id, "model": self.model, "state": self.state.value, "outcome": self.outcome,
            "worker_pid": self.worker.pid if self.worker is not None else None,
            "history": [{"state": s.value, "at_ms": round((t - t0) * 1000, 3), "note": note}
                        for s, t, note in self.history],
            "n_tokens": self.n_tokens,
            "ttft_ms": None if self.first_token_at is None else round((self.first_token_at - t0) * 1000, 3),
        }
