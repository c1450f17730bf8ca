"""One generation request's passage through a model: admitted, run on ONE worker, released.

A :class:`Run` holds the worker it was granted for its whole life, and reads
frames only from that worker's queue for its own request id, so nothing ever
splices two workers into one answer. :meth:`Run.close` is synchronous and
idempotent (safe in ``finally`` blocks and under cancellation): a request that
never reached the worker simply leaves the queue; one that did gets ``Cancel``
and its job slot is released only once the worker answers (Done/Error) or is
gone — a worker that ignores Cancel for ``cancel_timeout_s`` is killed.

Metrics of a run (``router.metrics``) are recorded here, each once: queue time
when it gets its worker, time to first token and inter-token latency per Token,
tokens and end-to-end latency per Done (also the Done a cancelled run's worker
answers), and a cancellation with its stage (queue, prefill, decode) when the
run is ended before its Done, or the worker answers Done(cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from protocol import Accepted, Done, Error, Generate, KVChunk, ProtocolError, Token, encode
from router.http.errors import ApiError, BadGateway, ServerShuttingDown, from_worker_error, unsendable
from router.workers.pool import ModelSlot, Ticket
from router.workers.process import Aborted, StreamItem, WorkerGone, WorkerProcess, WorkerUnreachable
from router.workers.tasks import spawn

log = logging.getLogger("modelyard.run")


class Run:
    """Create (admits; raises QueueFull / ModelUnloading), ``await start(msg)``,
    ``await next()`` until a Done, ``close()`` always."""

    def __init__(self, slot: ModelSlot, request_id: str, access: dict[str, Any] | None = None) -> None:
        self.slot = slot
        self._access = access if access is not None else {}  # the access-log figures (router.http.access_log)
        # the request's generations, by id: how the HTTP layer names the slot whose reader stalls
        self._access.setdefault("generation_ids", []).append(request_id)
        self.id = request_id
        self.ticket: Ticket = slot.admit(request_id)
        self.worker: WorkerProcess | None = None
        self._q: asyncio.Queue[StreamItem] | None = None
        self._sent = False
        self.finished = False
        self.started_at = time.monotonic()
        self._n_tokens = 0
        self._last_token_at = 0.0
        self._ended = False  # its final frame (or the worker's death) has been accounted for
        self.accepted: Accepted | None = None  # the worker's Accepted frame, once it came
        self.early = False  # next() returns the Accepted frame too (a stream opened before its first token)

    @property
    def _model(self) -> str:
        return self.slot.model.name

    async def wait_worker(self) -> WorkerProcess:
        """Wait for this request's turn (and the model's load). Raises ApiError
        (ModelLoadFailed, ModelFailed, ModelUnloading) if it will never come."""
        self.worker = await self.slot.wait_turn(self.ticket)
        self.slot.metrics.queue_time.labels(self._model).observe(time.monotonic() - self.started_at)
        return self.worker

    async def start(self, msg: Generate) -> None:
        """Send the Generate to this run's worker. Raises BadRequest (400) if the
        protocol cannot carry it — encoded first, so the request is never recorded as
        sent and never cancelled on a worker that did not get it — and BadGateway if
        the worker is unreachable."""
        try:
            frame = encode(msg)
        except ProtocolError as e:
            raise unsendable(e.reason) from None
        worker = self.worker or await self.wait_worker()
        self._q = worker.open_stream(self.id)
        self._sent = True
        try:
            await worker.send(frame)
        except WorkerUnreachable as e:
            self._finish()
            raise BadGateway(f"model '{self.slot.model.name}' worker is unreachable: {e}",
                             code="worker_crashed") from None

    async def next(self) -> Token | Done | KVChunk | Accepted:
        """The next Token (or, for a Generate with ``stream_state``, KVChunk), or the final Done;
        with ``early`` set, the worker's Accepted frame as well (else it is only kept in
        ``accepted``). Raises the mapped ApiError for a
        worker Error frame, BadGateway(code="worker_crashed") if the worker died,
        ServerShuttingDown if the router ended it (``close()`` then cancels it)."""
        assert self._q is not None, "start() first"
        while True:
            item = await self._q.get()
            if isinstance(item, WorkerGone):
                self._end(None)
                self._finish()
                raise BadGateway(f"model '{self.slot.model.name}' worker failed during the request: "
                                 f"{item.reason}", code="worker_crashed")
            if isinstance(item, Aborted):
                raise ServerShuttingDown(item.reason)
            if isinstance(item, Error):
                self._end(None)
                self._finish()
                raise from_worker_error(item.code, item.message, n_prompt_tokens=item.n_prompt_tokens,
                                        n_ctx=item.n_ctx)
            if isinstance(item, Done):
                self._end(item)
                if item.finish_reason == "cancelled":  # stopped by the server (unload timeout)
                    self._count_cancel()
                self._finish()
                return item
            if isinstance(item, Token):
                self._on_token()
                return item
            if isinstance(item, KVChunk):
                return item
            if isinstance(item, Accepted):
                self.accepted = item
                if self.early:
                    return item
                continue
            log.warning("unexpected %s frame for request %s", item.TYPE, self.id)

    def _on_token(self) -> None:
        now = time.monotonic()
        m = self.slot.metrics
        if self._n_tokens == 0:
            m.ttft.labels(self._model).observe(now - self.started_at)
            self._access["ttft_ms"] = (now - self.started_at) * 1000
        else:
            m.itl.labels(self._model).observe(now - self._last_token_at)
        self._n_tokens += 1
        self._last_token_at = now

    def _end(self, done: Done | None) -> None:
        """Account for the run's final frame once: its tokens (a Done) and its duration."""
        if self._ended:
            return
        self._ended = True
        m = self.slot.metrics
        m.e2e.labels(self._model).observe(time.monotonic() - self.started_at)
        if done is not None:
            self._access.update(prompt_tokens=done.prompt_tokens, cached_tokens=done.cache_n,
                                completion_tokens=done.completion_tokens)
            m.prompt_tokens.labels(self._model).inc(done.prompt_tokens)
            m.prompt_tokens_cached.labels(self._model).inc(done.cache_n)
            m.generation_tokens.labels(self._model).inc(done.completion_tokens)
            m.count_generation(self._model, done.prompt_n, done.prompt_ms, done.predicted_n, done.predicted_ms,
                               done.prompt_tokens + done.completion_tokens)

    def _count_cancel(self) -> None:
        if not self._sent:
            stage = "queue"
        else:
            stage = "decode" if self._n_tokens > 0 else "prefill"
        self.slot.metrics.cancellations.labels(self._model, stage).inc()

    def _finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self.worker is not None:
            self.worker.close_stream(self.id)
        self.slot.release(self.ticket)

    def close(self) -> None:
        """End this run now, whatever its stage (see the module docstring)."""
        if self.finished:
            return
        if self.worker is None or not self._sent:
            self.finished = True
            g = self.ticket.granted
            if not (g.done() and not g.cancelled() and g.exception() is not None):
                self._count_cancel()  # it left the queue (not refused: load failed, crashed, ...)
            if self.ticket.worker is not None:  # granted, but nothing was sent
                if self.worker is not None:
                    self.worker.close_stream(self.id)
                self.slot.release(self.ticket)
            else:
                self.slot.withdraw(self.ticket)
            return
        self.finished = True
        self._count_cancel()
        if not self._ended:  # the access log's figures: what reached the client (the Done comes later)
            self._access["completion_tokens"] = self._n_tokens
        spawn(self._reap(self.worker, self._q))

    async def _reap(self, worker: WorkerProcess, q: asyncio.Queue[StreamItem] | None) -> None:
        timeout = self.slot.model.cancel_timeout_s
        t0 = time.monotonic()
        try:
            worker.cancel(self.id)
            if q is None:
                return
            while True:
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    raise TimeoutError
                item = await asyncio.wait_for(q.get(), left)
                if isinstance(item, (Done, Error, WorkerGone)):
                    self._end(item if isinstance(item, Done) else None)
                    break
            log.info("request %s cancelled; worker free after %.1f ms", self.id, (time.monotonic() - t0) * 1000)
        except TimeoutError:
            worker.kill(f"worker hung: no answer to Cancel within cancel_timeout_s={timeout:g} s; killed")
        finally:
            worker.close_stream(self.id)
            self.slot.release(self.ticket)


__all__ = ["Run", "ApiError"]
