"""The worker's *prep* thread: each started Generate turned into prompt ids (chat template,
tokenizer, the engine's checks) off the engine thread, so a large prompt being tokenized never
stalls the running streams' steps.

A prepared job is ``(job, prompt ids, params, KV state or None)`` — the state a saved prefix of
the prompt from the KV cache directory, read and validated here — or ``(job, None, Error, None)``;
the engine thread takes them with :meth:`Prep.take_ready` between two steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Iterator
from typing import Any

from worker.engine import EngineError
from worker.frames import error_frame, internal_error
from worker.inbox import InboxThread
from worker.jobs import Job
from worker.kvops import KVStates

__all__ = ["Prep", "Prepared"]

log = logging.getLogger("modelyard.worker")

#: ``(job, prompt ids, params, KV state or None)``, or ``(job, None, Error, None)``.
Prepared = tuple[Job, list[int] | None, Any, Any]


class Prep(InboxThread[Job]):
    """The prep thread of one loaded engine; ``wake`` wakes the engine thread when a job is ready.
    ``submit(job)``: prepare it (in submission order; before :meth:`start` they wait)."""

    def __init__(self, kv: KVStates, wake: threading.Event) -> None:
        super().__init__("prep")
        self._kv = kv
        self._wake = wake
        self._ready: queue.SimpleQueue[Prepared | None] = queue.SimpleQueue()

    def stop(self) -> None:
        """End the thread; :meth:`take_ready` then yields None (the engine thread's signal to end)."""
        super().stop()
        self._ready.put(None)

    def take_ready(self) -> Iterator[Prepared | None]:
        """The prepared jobs waiting for the engine thread, without blocking."""
        while True:
            try:
                yield self._ready.get_nowait()
            except queue.Empty:
                return

    def _handle(self, job: Job) -> None:
        try:
            item = self._prepare(job)
        except Exception as e:  # noqa: BLE001 - a bug here must still end the job with a frame
            log.error("preparing %s crashed:\n%s", job.id, traceback.format_exc())
            item = (job, None, internal_error(job.id, e), None)
        self._ready.put(item)
        self._wake.set()

    def _prepare(self, job: Job) -> Prepared:
        g = job.msg
        engine = self._engine
        try:
            params = job.params
            prompt: str | list[int]
            if g.messages is not None:
                prompt = engine.tokenize_chat(g.messages, tools=g.tools, template_kwargs=g.template_kwargs,
                                              chat_template=g.chat_template)
            else:
                assert g.prompt is not None
                prompt = g.prompt
            ids, p = engine.prepare(prompt, params)
        except EngineError as e:
            return job, None, error_frame(g.id, e), None
        return job, ids, p, self._kv.disk_state(ids, p)
