"""One model's admission: the bounded queue of generation requests and the running set.

A request is admitted as a :class:`Ticket` (the serving layer's request record is one,
``router.serving.record``): it waits (FIFO) until a job slot of the ready worker is free,
is then granted that worker, and runs on it until the serving layer releases it (the
worker answered Done/Error, or is gone — never merely because the client left, so a
worker is never handed more generations than its ``Ready.max_jobs``).

Bound: ``jobs`` running plus at most ``max_queue`` waiting, where ``jobs`` is the worker's
job slots (1 before it is ready). While the model loads, the first ``jobs`` waiting
requests — those that get the job slots once it is ready — count as running, so
``jobs + max_queue`` requests are admitted whether the model is loaded or not
(:meth:`Admission.split`).

:class:`Admission` holds these facts and applies what it is told, synchronously; the model's
one owner (``router.workers.slot.ModelSlot``) decides when (its state, its worker).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.http.errors import ApiError

if TYPE_CHECKING:
    from router.workers.process import WorkerProcess
    from router.workers.slot import ModelSlot


@dataclass(eq=False)
class Ticket:
    """One admitted request's place: waiting, then running on one worker (``granted``
    resolves to it, or fails with the ApiError that refused it)."""

    id: str
    admitted_at: float = field(default_factory=time.monotonic)
    granted: asyncio.Future[WorkerProcess] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    worker: WorkerProcess | None = None
    started_at: float = 0.0  # when it was handed its worker (monotonic s)
    # the replica whose queue holds it (``router.workers.replicas``; None: not yet routed, or the
    # model's one slot); moved only while it waits, never once it runs
    replica: ModelSlot | None = None

    @property
    def waiting(self) -> bool:
        return not self.granted.done()

    def grant(self, worker: WorkerProcess) -> None:
        """Its turn: it runs on ``worker`` from now on."""
        self.worker = worker
        self.started_at = time.monotonic()
        self.granted.set_result(worker)

    def refuse(self, err: ApiError) -> None:
        """It will never run (load failed, unloaded, shutting down, ...)."""
        if not self.granted.done():
            self.granted.set_exception(err)
            self.granted.exception()  # retrieved: a withdrawn waiter may never look

    @property
    def refused(self) -> bool:
        g = self.granted
        return g.done() and not g.cancelled() and g.exception() is not None


class Admission:
    """The waiting line (FIFO) and the running set (by request id) of one model."""

    def __init__(self) -> None:
        self._waiting: deque[Ticket] = deque()
        self._running: dict[str, Ticket] = {}

    # ------------------------------------------------------------------ facts

    @property
    def queue_depth(self) -> int:
        """Requests still waiting for their turn."""
        return sum(1 for t in self._waiting if t.waiting)

    @property
    def busy(self) -> bool:
        """A request runs (holds a job slot)."""
        return bool(self._running)

    @property
    def n_running(self) -> int:
        return len(self._running)

    @property
    def running_ids(self) -> list[str]:
        """Running requests' ids, in the order they were granted."""
        return list(self._running)

    def running(self) -> Iterator[Ticket]:
        return iter(list(self._running.values()))

    def running_on(self, worker: WorkerProcess) -> list[str]:
        return [rid for rid, t in self._running.items() if t.worker is worker]

    def latest_start(self) -> float:
        """When the latest running request was granted its worker (monotonic s; 0: none)."""
        return max((t.started_at for t in self._running.values()), default=0.0)

    def split(self, jobs: int) -> tuple[int, int]:
        """(running, waiting) as admission counts them (see the module docstring)."""
        pending = self.queue_depth
        starting = min(pending, max(0, jobs - len(self._running)))
        return len(self._running) + starting, pending - starting

    def full(self, jobs: int, max_queue: int) -> bool:
        running, waiting = self.split(jobs)
        return running + waiting >= jobs + max_queue

    # ------------------------------------------------------------------ changes (the owner's calls)

    def enqueue(self, ticket: Ticket) -> None:
        self._waiting.append(ticket)

    def withdraw(self, ticket: Ticket) -> None:
        """A waiting request leaves. No-op once it runs."""
        if not ticket.granted.done():
            ticket.granted.cancel()
        try:
            self._waiting.remove(ticket)
        except ValueError:
            pass

    def release(self, ticket: Ticket) -> bool:
        """The worker is done with ``ticket``'s request. True if it was running."""
        if self._running.get(ticket.id) is ticket:
            del self._running[ticket.id]
            return True
        return False

    def grant_free(self, worker: WorkerProcess, jobs: int) -> None:
        """Hand ``worker``'s free job slots (``jobs`` in all) to the waiting tickets, FIFO."""
        while self._waiting and not self._waiting[0].waiting:
            self._waiting.popleft()
        while self._waiting and len(self._running) < jobs:
            t = self._waiting.popleft()
            if not t.waiting:
                continue
            self._running[t.id] = t
            t.grant(worker)

    def refuse_waiting(self, err: ApiError) -> None:
        """Every waiting request fails with ``err``."""
        while self._waiting:
            self._waiting.popleft().refuse(err)

    def forget_worker(self, worker: WorkerProcess) -> None:
        """``worker`` is gone: its running requests no longer hold job slots (their
        records hear it from the worker connection)."""
        for rid in self.running_on(worker):
            del self._running[rid]

    def take_waiting(self) -> list[Ticket]:
        """Every request still waiting, removed from this line (FIFO order): another replica takes them."""
        out = [t for t in self._waiting if t.waiting]
        self._waiting.clear()
        return out

    def take_newest_waiting(self) -> Ticket | None:
        """The request that joined this line last and still waits, removed from it (another
        replica takes it; the older ones keep their place), else None."""
        while self._waiting:
            t = self._waiting.pop()
            if t.waiting:
                return t
        return None

    def forget_running(self) -> None:
        self._running.clear()
