"""The serving layer's per-model object: the one owner of every request record of a model.

:class:`ModelServer` takes a generation request in (:meth:`ModelServer.submit`: admitted
into the model's bounded queue, or 503 at once), sends its Generate to the worker it is
granted, hands its frames out one by one, and releases it — moving its
:class:`~router.serving.record.RequestRecord` queued -> running -> done and recording its
metrics, each once. The worker connection only routes frames by request id into the
record's inbox; the dialects hold a :class:`Generation` (the record's handle) and call
nothing below this layer.

A record holds the worker it was granted for its whole life and reads only that worker's
frames for its own id, so nothing ever splices two workers into one answer.
:meth:`ModelServer.cancel` (``Generation.close``) is synchronous and idempotent (safe in
``finally`` blocks and under cancellation): a request that never reached the worker
simply leaves the queue; one that did gets ``Cancel`` and its job slot is released only
once the worker answers (Done/Error) or is gone — a worker that ignores Cancel for
``cancel_timeout_s`` is killed.

Metrics (``router.metrics``), each once: queue time when it gets its worker, time to
first token and inter-token latency per Token, tokens and end-to-end latency per Done
(also the Done a cancelled request's worker answers), and a cancellation with its stage
(queue, prefill, decode) when the request is ended before its Done, or the worker
answers Done(cancelled).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from typing import Any

from protocol import Accepted, Done, Error, Generate, KVAck, KVChunk, PromptProgress, ProtocolError, Ready, Token
from protocol import encode
from router.http.errors import ApiError, BadGateway, QueueFull, ServerShuttingDown, from_worker_error, unsendable
from router.metrics import Metrics
from router.serving.record import RecordState, RequestRecord
from router.serving.routing import Router
from router.workers.pool import ModelSlot
from router.workers.connection import Aborted, WorkerGone, WorkerUnreachable
from router.workers.lifecycle import WorkerState
from router.workers.process import WorkerProcess
from router.workers.tasks import spawn

log = logging.getLogger("modelyard.run")

#: Released records a server keeps for inspection (operators, tests), newest last.
RECENT = 64


class ModelServer:
    """One model's requests: their records, by id, from admission to release."""

    def __init__(self, slot: ModelSlot) -> None:
        self.slot = slot
        self.records: dict[str, RequestRecord] = {}  # live: admitted and not yet released
        self.recent: deque[RequestRecord] = deque(maxlen=RECENT)  # released, newest last
        self.router = Router()  # which replica each request goes to (replicas > 1)

    @property
    def _model(self) -> str:
        return self.slot.model.name

    @property
    def _metrics(self) -> Metrics:
        return self.slot.metrics

    # ------------------------------------------------------------------ the door

    def submit(self, request_id: str, access: dict[str, Any] | None = None, *, early: bool = False) -> Generation:
        """Admit a generation request (its record is ``queued``). Raises QueueFull (503),
        ModelUnloading, ServerShuttingDown, RestartBackoff / ModelFailed at once."""
        access = access if access is not None else {}
        # the request's generations, by id: how the HTTP layer names the slot whose reader stalls
        access.setdefault("generation_ids", []).append(request_id)
        rec = RequestRecord(id=request_id, model=self._model, access=access, early=early)
        if self.slot.replica_set() is None:
            self.slot.admit(rec)  # raises before the record exists for anyone
        else:  # replicas: routed once its Generate is known (:meth:`_route`); refused now if none has room
            self._check_room()
        self.records[rec.id] = rec
        return Generation(self, rec)

    def _slot_of(self, rec: RequestRecord) -> ModelSlot:
        """The replica whose queue holds ``rec`` (the model's slot when it has one worker)."""
        return rec.replica if rec.replica is not None else self.slot

    def _check_room(self) -> None:
        """With replicas: the model is open and some replica may admit one more request now. Raises
        ServerShuttingDown, ModelUnloading, RestartBackoff / ModelFailed (every replica failed), QueueFull."""
        rs = self.slot.replica_set()
        assert rs is not None
        self.slot.check_open()
        refused: ApiError | None = None  # a failed replica's crash backoff
        full = False
        for s in rs.open():
            try:
                s.check_restart(operator=False)
            except ApiError as e:
                refused = refused or e
                continue
            if sum(s.admitted_split()) < s.capacity:
                return
            full = True
        if refused is not None and not full:
            raise refused
        raise QueueFull(f"model '{self._model}' is busy: each of its {len(rs.slots)} replicas has "
                        f"max_queue={self.slot.model.max_queue} waiting beyond its running requests; retry shortly")

    async def _route(self, rec: RequestRecord, msg: Generate | None) -> None:
        """With replicas: admit ``rec`` into the replica the policy picks (``router.serving.routing``),
        or the next that has room. No-op once routed (or with one worker). Raises what the last
        replica tried refused with (QueueFull, ModelUnloading, RestartBackoff, ...)."""
        rs = self.slot.replica_set() if rec.replica is None else None
        if rs is None or rec.closed:
            return
        order = await self.router.order(rs, msg)
        err: ApiError | None = None
        for s in order:
            try:
                s.admit(rec)
            except ApiError as e:
                err = err or e
                continue
            rec.replica = s
            if s.state is not WorkerState.READY or s.queue_depth > 0:
                rs.start_others(s)  # lazy start; a replica unloaded for idleness starts again once requests wait
            return
        raise err or QueueFull(f"model '{self._model}' has no replica to take the request; retry shortly")

    async def wait_worker(self, rec: RequestRecord) -> WorkerProcess:
        """Wait for ``rec``'s turn (and the model's load). Raises ApiError (ModelLoadFailed,
        ModelFailed, ModelUnloading) if it will never come."""
        await self._route(rec, rec.msg)
        worker = await self._slot_of(rec).wait_turn(rec)
        if rec.queue_time_s is None:  # observed once, when its reader first sees its turn
            rec.queue_time_s = time.monotonic() - rec.admitted_at
            self._metrics.queue_time.labels(self._model).observe(rec.queue_time_s)
        return worker

    async def start(self, rec: RequestRecord, msg: Generate) -> None:
        """Send ``msg`` to ``rec``'s worker. Raises BadRequest (400) if the protocol cannot
        carry it — encoded first, so the request is never recorded as sent and never
        cancelled on a worker that did not get it — and BadGateway if the worker is unreachable."""
        try:
            frame = encode(msg)
        except ProtocolError as e:
            raise unsendable(e.reason) from None
        await self._route(rec, msg)
        worker = await self.wait_worker(rec)
        worker.open_stream(rec.id, rec.inbox)
        rec.msg = msg
        rec.sent = True
        try:
            await worker.send(frame)
        except WorkerUnreachable as e:
            self._release(rec, "error:worker_crashed")
            raise BadGateway(f"model '{self._model}' worker is unreachable: {e}", code="worker_crashed") from None

    async def next(self, rec: RequestRecord) -> Token | Done | KVChunk | Accepted | PromptProgress:
        """``rec``'s next Token (or KVChunk, for a Generate with ``stream_state``), or its final
        Done; with ``rec.early``, the worker's Accepted frame as well, and its PromptProgress
        frames when its Generate has ``return_progress`` (a stream's; else they are dropped).
        Raises the mapped ApiError for a worker Error frame, BadGateway(code="worker_crashed") if
        the worker died, ServerShuttingDown if the router ended it (:meth:`cancel` then cancels it)."""
        assert rec.sent, "start() first"
        while True:
            item = await rec.inbox.get()
            if isinstance(item, WorkerGone):
                self._account(rec, None)
                self._release(rec, "error:worker_crashed")
                raise BadGateway(f"model '{self._model}' worker failed during the request: {item.reason}",
                                 code="worker_crashed")
            if isinstance(item, Aborted):
                raise ServerShuttingDown(item.reason)
            if isinstance(item, Error):
                self._account(rec, None)
                self._release(rec, f"error:{item.code}")
                raise from_worker_error(item.code, item.message, n_prompt_tokens=item.n_prompt_tokens,
                                        n_ctx=item.n_ctx)
            if isinstance(item, Done):
                self._account(rec, item)
                if item.finish_reason == "cancelled":  # stopped by the server (unload timeout)
                    self._count_cancel(rec)
                self._release(rec, item.finish_reason)
                return item
            if isinstance(item, Token):
                self._on_token(rec)
                return item
            if isinstance(item, KVChunk):
                return item
            if isinstance(item, Accepted):
                rec.accepted = item
                if rec.early:
                    return item
                continue
            if isinstance(item, PromptProgress):
                if rec.early and rec.msg is not None and rec.msg.return_progress:
                    return item
                continue
            log.warning("unexpected %s frame for request %s", item.TYPE, rec.id)

    def cancel(self, rec: RequestRecord) -> None:
        """End ``rec`` now, whatever its stage (see the module docstring). Idempotent."""
        if rec.closed:
            return
        rec.closed = True
        if rec.worker is None or not rec.sent:
            if not rec.refused:
                self._count_cancel(rec)  # it left the queue (not refused: load failed, crashed, ...)
            if rec.worker is not None:  # granted, but nothing was sent
                rec.worker.close_stream(rec.id)
                self._release(rec, "cancelled")
            else:
                self._slot_of(rec).withdraw(rec)
                self._done(rec, "refused" if rec.refused else "cancelled")
            return
        if rec.released:
            return
        self._count_cancel(rec)
        if not rec.ended:  # the access log's figures: what reached the client (the Done comes later)
            rec.access["completion_tokens"] = rec.n_tokens
        spawn(self._reap(rec, rec.worker))

    # ------------------------------------------------------------------ the record's bookkeeping

    def _on_token(self, rec: RequestRecord) -> None:
        now = time.monotonic()
        if rec.n_tokens == 0:
            rec.first_token_at = now
            self._metrics.ttft.labels(self._model).observe(now - rec.admitted_at)
            rec.access["ttft_ms"] = (now - rec.admitted_at) * 1000
        else:
            self._metrics.itl.labels(self._model).observe(now - rec.last_token_at)
        rec.n_tokens += 1
        rec.last_token_at = now

    def _account(self, rec: RequestRecord, done: Done | None) -> None:
        """Account for the final frame once: its tokens (a Done) and the request's duration."""
        if rec.ended:
            return
        rec.ended = True
        m, name = self._metrics, self._model
        m.e2e.labels(name).observe(time.monotonic() - rec.admitted_at)
        if done is not None:
            rec.access.update(prompt_tokens=done.prompt_tokens, cached_tokens=done.cache_n,
                              completion_tokens=done.completion_tokens)
            m.prompt_tokens.labels(name).inc(done.prompt_tokens)
            m.prompt_tokens_cached.labels(name).inc(done.cache_n)
            m.generation_tokens.labels(name).inc(done.completion_tokens)
            m.count_generation(name, done.prompt_n, done.prompt_ms, done.predicted_n, done.predicted_ms,
                               done.prompt_tokens + done.completion_tokens)

    def _count_cancel(self, rec: RequestRecord) -> None:
        stage = "queue" if not rec.sent else "decode" if rec.n_tokens > 0 else "prefill"
        self._metrics.cancellations.labels(self._model, stage).inc()

    def _release(self, rec: RequestRecord, outcome: str | None) -> None:
        """The worker is done with ``rec``: its job slot goes back, its record is done."""
        rec.closed = True
        if rec.released:
            return
        if rec.worker is not None:
            rec.worker.close_stream(rec.id)
        self._slot_of(rec).release(rec)
        self._done(rec, outcome)

    def _done(self, rec: RequestRecord, outcome: str | None) -> None:
        rec.released = True
        rec.released_at = time.monotonic()
        rec.outcome = outcome
        rec.move(RecordState.DONE, outcome)
        if self.records.get(rec.id) is rec:
            del self.records[rec.id]
        self.recent.append(rec)

    async def _reap(self, rec: RequestRecord, worker: WorkerProcess) -> None:
        """Cancel ``rec`` on its worker and release it once the worker has let it go."""
        timeout = self.slot.model.cancel_timeout_s
        t0 = time.monotonic()
        try:
            worker.cancel(rec.id)
            while True:
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    raise TimeoutError
                item = await asyncio.wait_for(rec.inbox.get(), left)
                if isinstance(item, (Done, Error, WorkerGone)):
                    self._account(rec, item if isinstance(item, Done) else None)
                    break
            log.info("request %s cancelled; worker free after %.1f ms", rec.id, (time.monotonic() - t0) * 1000)
        except TimeoutError:
            worker.kill(f"worker hung: no answer to Cancel within cancel_timeout_s={timeout:g} s; killed")
        finally:
            self._release(rec, "cancelled")


class Generation:
    """A dialect's handle on one generation request (its record, through its owner).

    ``await start(msg)``, ``await next()`` until a Done, ``close()`` always. What a dialect reads
    of it: its id, its model's name, the granted worker's Ready and pid, the Accepted frame."""

    def __init__(self, server: ModelServer, record: RequestRecord) -> None:
        self._server = server  # the record's owner; a dialect reads the record only through this handle
        self._record = record

    @property
    def id(self) -> str:
        return self._record.id

    @property
    def model_name(self) -> str:
        """The model's name (a preset's request: its model's)."""
        return self._server.slot.model.name

    @property
    def sse_keepalive_s(self) -> float:
        """How long its stream may be silent before it sends a keep-alive, s."""
        return self._server.slot.sse_keepalive_s

    @property
    def waited_s(self) -> float:
        """From its admission to its worker granted (its wait in the queue and for the model's
        load), s; 0 while it waits."""
        r = self._record
        return r.started_at - r.admitted_at if r.worker is not None else 0.0

    @property
    def granted(self) -> bool:
        """It has its worker (its turn came); False while it waits."""
        return self._record.worker is not None

    @property
    def worker_pid(self) -> int | None:
        """The granted worker's process id (None while it waits)."""
        return self._record.worker.pid if self._record.worker is not None else None

    @property
    def ready(self) -> Ready | None:
        """The granted worker's Ready (its model identity: fingerprint, n_ctx, ...); None while it waits."""
        return self._record.worker.ready if self._record.worker is not None else None

    @property
    def accepted(self) -> Accepted | None:
        return self._record.accepted

    @property
    def finished(self) -> bool:
        return self._record.closed

    async def wait_worker(self) -> None:
        """Wait for its turn (and the model's load). Raises ApiError if it will never come."""
        await self._server.wait_worker(self._record)

    async def start(self, msg: Generate) -> None:
        await self._server.start(self._record, msg)

    async def next(self) -> Token | Done | KVChunk | Accepted | PromptProgress:
        return await self._server.next(self._record)

    async def ack_state(self, seq: int) -> None:
        """Credit its worker's state stream (a Generate with ``stream_state``): the chunks up to
        ``seq`` were taken (``KVAck``). No-op while it waits. Raises WorkerUnreachable."""
        if self._record.worker is not None:
            await self._record.worker.send(KVAck(id=self._record.id, seq=seq))

    def close(self) -> None:
        self._server.cancel(self._record)


_servers: weakref.WeakKeyDictionary[ModelSlot, ModelServer] = weakref.WeakKeyDictionary()


def server_of(slot: Any) -> ModelServer:
    """The serving object of ``slot``'s model (a preset's view: its model's one), made on first use."""
    base: ModelSlot = getattr(slot, "base", slot)
    server = _servers.get(base)
    if server is None:
        server = _servers[base] = ModelServer(base)
    return server


def submit(slot: Any, request_id: str, access: dict[str, Any] | None = None, *, early: bool = False) -> Generation:
    """Admit a generation request on ``slot``'s model (:meth:`ModelServer.submit`)."""
    return server_of(slot).submit(request_id, access, early=early)
