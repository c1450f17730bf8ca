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

from protocol import Error
from worker.engine import EngineError
from worker.frames import INTERNAL_ERROR, error_frame
from worker.jobs import Job
from worker.kvops import KVStates

__all__ = ["Prep", "Prepared"]

log = logging.getLogger("modelyard.worker")

#: ``(job, prompt ids, params, KV state or None)``, or ``(job, None, Error, None)``.
Prepared = tuple[Job, list[int] | None, Any, Any]


class Prep:
    """The prep thread of one loaded engine; ``wake`` wakes the engine thread when a job is ready."""

    def __init__(self, kv: KVStates, wake: threading.Event) -> None:
        self._kv = kv
        self._wake = wake
        self._engine: Any = None
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[Prepared | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="prep", daemon=True)

    def start(self, engine: Any) -> None:
        self._engine = engine
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Prepare ``job`` (in submission order; before :meth:`start` they wait)."""
        self._inbox.put(job)

    def stop(self) -> None:
        """End the thread; :meth:`take_ready` then yields None (the engine thread's signal to end)."""
        self._inbox.put(None)
        self._ready.put(None)

    def take_ready(self) -> Iterator[Prepared | None]:
        """The prepared jobs waiting for the engine thread, without blocking."""
        while True:
            try:
                yield self._ready.get_nowait()
            except queue.Empty:
                return

    def _main(self) -> None:
        while True:
            job = self._inbox.get()
            if job is None:
                return
            try:
                item = self._prepare(job)
            except Exception as e:  # noqa: BLE001 - a bug here must still end the job with a frame
                log.error("preparing %s crashed:\n%s", job.id, traceback.format_exc())
                item = (job, None, Error(id=job.id, code=INTERNAL_ERROR, message=f"{type(e).__name__}: {e}"[:1000]),
                        None)
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
