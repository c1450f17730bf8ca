"""The worker's one record of its Generate requests: :class:`Job`, and :class:`JobTable`, the one
place that knows which are waiting and which run.

A job is *waiting* (arrived, in arrival order, at most ``max_queue`` of them) until a KV slot is
free, then *running* (``capacity`` at most: being prepared, in the engine's batch, or streaming
its KV state) until the socket thread has sent its last frame (Done or Error) and
:meth:`JobTable.release`\\ s it. Nothing else keeps a list of jobs: the socket loop
(``worker.server``) asks the table, the runner's threads (``worker.runner``) hold a job only
while working on it. Thread-safe: every method takes the table's lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from protocol import Error, Generate
from protocol.errors import ErrorCode
from worker.engine import SamplingParams

__all__ = ["Job", "JobTable"]


@dataclass
class Job:
    """One Generate request, waiting or running.

    ``cancel`` is set by the socket thread (Cancel, Shutdown, parent gone) and
    read by the engine thread. ``tokens_sent`` counts Token frames posted
    (engine thread writes, socket thread reads only after the job finished or
    gave up on it). ``received`` is ``time.monotonic()`` at arrival (s). ``params``: the
    request's sampling parameters as checked on arrival (``worker.frames.check_generate``).
    """

    msg: Generate
    params: SamplingParams
    received: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    tokens_sent: int = 0
    cancel_at: float | None = None  # monotonic time the socket thread asked to cancel (s), for its log

    @property
    def id(self) -> str:
        return self.msg.id


class JobTable:
    """Waiting and running jobs by id. ``capacity``: jobs that run at once (the engine's KV
    slots; set once the model is loaded); ``max_queue``: jobs that may wait beyond them."""

    def __init__(self, max_queue: int, capacity: int = 1) -> None:
        self.max_queue = max_queue
        self.capacity = capacity
        self._lock = threading.Lock()
        self._waiting: deque[Job] = deque()
        self._running: dict[str, Job] = {}

    def admit(self, g: Generate, params: SamplingParams, can_start: bool) -> Error | None:
        """Queue ``g`` (with its checked ``params``) as a waiting job, or the Error refusing it: its id in use
        ("invalid_request"), or the line full ("busy": ``max_queue`` waiting, and it could not
        start at once). ``can_start``: a job may start now (the model is loaded)."""
        with self._lock:
            if self._in_use(g.id):
                return _id_in_use(g)
            start_now = can_start and not self._waiting and len(self._running) < self.capacity
            if not start_now and len(self._waiting) >= self.max_queue:
                return Error(id=g.id, code=ErrorCode.BUSY, message=(
                    f"the worker is busy: {len(self._running)} running, {len(self._waiting)} waiting "
                    f"(max_queue={self.max_queue})"))
            self._waiting.append(Job(g, params))
            return None

    def start_next(self) -> Job | None:
        """The oldest waiting job, now running, if a slot is free; else None."""
        with self._lock:
            if not self._waiting or len(self._running) >= self.capacity:
                return None
            job = self._waiting.popleft()
            self._running[job.id] = job
            return job

    def id_in_use(self, g: Generate) -> Error | None:
        """The Error refusing ``g`` when a waiting or running job has its id, else None."""
        with self._lock:
            if not self._in_use(g.id):
                return None
        return _id_in_use(g)

    def _in_use(self, job_id: str) -> bool:
        return job_id in self._running or any(j.id == job_id for j in self._waiting)

    def running(self, job_id: str) -> Job | None:
        with self._lock:
            return self._running.get(job_id)

    def running_jobs(self) -> list[Job]:
        with self._lock:
            return list(self._running.values())

    def drop_waiting(self, job_id: str) -> bool:
        """Remove waiting job ``job_id``; False if it is not waiting."""
        with self._lock:
            for job in self._waiting:
                if job.id == job_id:
                    self._waiting.remove(job)
                    return True
            return False

    def take_waiting(self) -> list[Job]:
        """Every waiting job, removed (in arrival order)."""
        with self._lock:
            jobs = list(self._waiting)
            self._waiting.clear()
            return jobs

    def release(self, job_id: str) -> Job | None:
        """Job ``job_id`` sent its last frame: no longer running (None if it was not)."""
        with self._lock:
            return self._running.pop(job_id, None)

    def release_all(self) -> list[Job]:
        """Every running job, released (exit: given up on)."""
        with self._lock:
            jobs = list(self._running.values())
            self._running.clear()
            return jobs

    def counts(self) -> tuple[list[str], int]:
        """``(running ids, waiting count)``, read together."""
        with self._lock:
            return list(self._running), len(self._waiting)


def _id_in_use(g: Generate) -> Error:
    return Error(id=g.id, code=ErrorCode.INVALID_REQUEST, message=f"request id {g.id!r} is already in use")
