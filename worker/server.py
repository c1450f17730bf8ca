"""The worker's socket loop: one DEALER socket, the job queue, cancel, health, exit.

One process serves one model. The main thread owns the ZeroMQ DEALER socket
(connected to the router's ROUTER endpoint) and nothing else touches it. The
engine lives in the runner's thread (``worker.runner``), which loads the model
and runs generations; Token / Done / Error frames it produces come back to the
main thread through a queue (woken by a pipe) and are sent from here. So the
main thread answers Ping, Tokenize, Detokenize, ApplyTemplate, queues and
cancels requests at any time, even while a long prefill chunk is being
computed, and notices within ~0.2 s that its parent process is gone.

Sequence: connect, send Hello(id=worker id), load (in the runner thread),
send LoadProgress frames while loading, then Ready (or Error(code="load_failed") and exit status 1), then serve.

Jobs: the runner owns them (``worker.runner``, its ``jobs`` table); this loop hands each
Generate to it and sends what it answers. ``runner.capacity`` generations run at once (1: the
depth-one queue); further Generates wait in arrival order, at most ``max_queue`` of them;
beyond that the worker answers Error(code="busy"). Cancel of a waiting request
removes it and answers Done(finish_reason="cancelled") with zero tokens; of the
running one, it sets the job's cancel flag, which the engine polls before each
step and between the layers of each forward pass (a long prefill chunk is
abandoned mid-pass); the runner then answers Done(finish_reason="cancelled").
Cancel of an unknown id is ignored.

KV-state streams (``worker.kvstream``): a Generate with ``stream_state`` ends
with its KV entry streamed as KVChunk frames (at most ``KV_WINDOW`` beyond the
last KVAck) before its Done; a Cancel meanwhile drops the stream and answers
Done cancelled. Incoming KVChunk streams (a decode worker's side) are validated
chunk by chunk on this thread, acknowledged, and the state handed to the engine
thread only once complete and valid; a Cancel, an error or ``KV_STREAM_IDLE_S``
without a chunk drops a partial one (nothing is installed).

KV events (``worker.kvevents``, off by default): the runner posts each step's as a KvBatch; this
loop numbers them and sends them on the PUB socket it bound and / or to the router, and at exit
tells AllBlocksCleared.

Exit: on Shutdown (or SIGTERM via :meth:`WorkerServer.request_stop`) every
waiting request is answered Done cancelled, the running one is cancelled and its
Done awaited for up to ``shutdown_grace_s``; then ``serve`` returns 0. When the
parent process is gone the same happens with ``parent_gone_grace_s`` and no
linger (nobody is listening).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import zmq

from protocol import (
    ApplyTemplate, Cancel, Detokenize, Error, Generate, Hello, KVAck, KVChunk, LoadProgress, Message, Ping,
    Pong, Ready, Shutdown, SlotAction, Tokenize,
)
from protocol.errors import ErrorCode
from worker.channel import Channel
from worker.config import ParentWatch, WorkerConfig, default_loader
from worker.events import (FrameOut, JobFinished, KvBatch, LoadFailed, LoadStep, Loaded, Persisted, RunnerEvent,
                           StateOut)
from worker.frames import cancelled_done, internal_error
from worker.jobs import Job
from worker.kvevents import KvEventSinks
from worker.kvstream import KVStreams
from worker.runner import BatchRunner

log = logging.getLogger("modelyard.worker")

__all__ = ["WorkerServer"]



class WorkerServer:
    """Serve one model over one DEALER socket. ``serve()`` returns the exit status.

    Args:
        cfg: the worker's configuration.
        loader: ``(gguf_path, n_ctx, chat_template) -> engine`` following
            docs/ENGINE-API.md; default :func:`worker.config.default_loader`.
        runner_factory: builds the token path (``BatchRunner`` signature).
    """

    def __init__(self, cfg: WorkerConfig, loader: Callable[..., Any] | None = None,
                 runner_factory: Callable[..., Any] = BatchRunner) -> None:
        self.cfg = cfg
        self.pid = os.getpid()
        self.worker_id = f"worker-{self.pid}"
        self._events: queue.SimpleQueue[RunnerEvent] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.runner = runner_factory(loader or default_loader, cfg.gguf, cfg.n_ctx, cfg.chat_template, self._post,
                                     parallel=cfg.parallel, kv_budget_mib=cfg.kv_budget_mib, weights=cfg.weights,
                                     n_ubatch=cfg.n_ubatch, slot_save_path=cfg.slot_save_path, kv_cache_dir=cfg.kv_cache_dir,
                                     kv_cache_mib=cfg.kv_cache_mib, max_queue=cfg.max_queue,
                                     **({"kv_events_block_size": cfg.kv_events_block_size} if cfg.kv_events else {}))
        self.engine: Any = None
        self._channel: Channel | None = None
        self._exit_code: int | None = None
        self._stopping = False
        self._stop_deadline = 0.0
        self._stop_reason = ""
        self._stop_requested = threading.Event()
        self._persisting = False  # stopping: the idle KV entries are being saved (Persisted ends it)
        self._linger_ms = cfg.linger_ms
        self._watch = ParentWatch(cfg.parent_pid) if cfg.parent_pid is not None else None
        self._streams = KVStreams(self._send, self.runner)  # KV states going out and coming in
        self._kv_events = KvEventSinks(cfg.model, cfg.kv_events_endpoint, self.worker_id,
                                       self._send if cfg.kv_events_to_router else None)

    def request_stop(self) -> None:
        """Ask for a Shutdown-like exit (thread- and signal-safe)."""
        self._stop_requested.set()
        self._wake()

    def serve(self, connected: tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]] | None = None) -> int:
        """Connect, load, serve until Shutdown / parent gone / load failure. Returns the exit status:
        0 after Shutdown or parent gone, 1 after a load failure or a bad endpoint.
        ``connected``: a context and DEALER socket already connected to the router, Hello
        already sent on it (a warm spare given its model: ``worker.spare``)."""
        creds = self.cfg.credentials
        channel = self._channel = open_channel(self.cfg, connected)
        if channel is None:  # a bad endpoint
            self._exit_code = 1
            self._close()
            return 1
        try:
            if connected is None:
                self._send(Hello(id=self.worker_id, model=self.cfg.model, pid=self.pid,
                                 auth=creds.secret if creds is not None else ""))
            if self._watch is not None and self._watch.gone():
                self._begin_stop(f"parent process {self.cfg.parent_pid} is gone", 0.0, linger_ms=0)
            else:
                self.runner.start()
            poller = zmq.Poller()
            poller.register(channel.sock, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            next_check = 0.0
            while self._exit_code is None:
                ready = dict(poller.poll(self.cfg.poll_ms))
                if self._wake_r in ready:
                    self._drain_wake()
                self._drain_events()
                if channel.sock in ready:
                    channel.receive(self._on_message, lambda: self._exit_code is not None)
                now = time.monotonic()
                if self._stop_requested.is_set() and not self._stopping:
                    self._begin_stop("stop requested (signal)", self.cfg.shutdown_grace_s)
                if self._watch is not None and now >= next_check:
                    next_check = now + self.cfg.parent_check_s
                    if not self._stopping or self._linger_ms > 0:
                        if self._watch.gone():
                            self._begin_stop(f"parent process {self.cfg.parent_pid} is gone",
                                             self.cfg.parent_gone_grace_s, linger_ms=0)
                if self._streams.active:
                    self._streams.expire(now)
                if self._stopping:
                    self._check_stopped(now)
        except Exception:  # a bug in the loop itself: say so, exit non-zero rather than hang
            log.critical("worker loop crashed:\n%s", traceback.format_exc())
            self._exit_code = 2
        finally:
            self._close()
        log.info("worker %s for %s exits with status %d%s", self.pid, self.cfg.model, self._exit_code,
                 f" ({self._stop_reason})" if self._stop_reason else "")
        return self._exit_code

    # ------------------------------------------------------------------ runner events

    def _post(self, ev: RunnerEvent) -> None:  # runner thread
        self._events.put(ev)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # pipe full: the loop is awake anyway
            pass

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _drain_events(self) -> None:
        while True:
            try:
                ev = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(ev, FrameOut):
                self._send(ev.msg)
            elif isinstance(ev, JobFinished):
                job = self.runner.release(ev.job_id)
                if job is not None:  # None only after giving up on it at exit (answered already)
                    self._send(ev.final)
                if job is not None and job.cancel_at is not None:
                    log.debug("request %s: Cancel -> Done in %.1f ms", job.id,
                              (time.monotonic() - job.cancel_at) * 1e3)
            elif isinstance(ev, StateOut):
                self._streams.state_out(ev.job_id, ev.state, ev.final)
            elif isinstance(ev, KvBatch):
                self._kv_events.publish(ev.ts, ev.events)
            elif isinstance(ev, LoadStep):
                self._send(LoadProgress(id=self.worker_id, stage=ev.stage, done=ev.done, total=ev.total))
            elif isinstance(ev, Persisted):
                self._persisting = False
            elif isinstance(ev, Loaded):
                self._on_loaded(ev)
            elif isinstance(ev, LoadFailed):
                log.error("cannot load %s (%s): %s", self.cfg.model, self.cfg.gguf, ev.reason)
                self._send(Error(id=self.worker_id, code=ErrorCode.LOAD_FAILED, message=ev.reason[:4000]))
                for job in self.runner.jobs.take_waiting():  # requests that arrived while loading
                    self._send(Error(id=job.id, code=ErrorCode.LOAD_FAILED, message=ev.reason[:4000]))
                self._stop_reason = "load failed"
                self._exit_code = 1

    def _on_loaded(self, ev: Loaded) -> None:
        self.engine = ev.engine
        info = ev.engine.info
        ready = ready_frame(self.cfg, self.worker_id, ev, int(self.runner.capacity))
        self._send(ready)
        if not ready.fingerprint and hasattr(ev.engine, "on_fingerprint"):
            # a file never seen before is still being hashed (gguf_loader): serve now, and send
            # Ready again with the fingerprint once known (the router takes it from there)
            ev.engine.on_fingerprint(lambda fp: self._post(FrameOut(replace(ready, fingerprint=fp))))
        log.info("worker %s loaded %s (%s, n_ctx=%d) in %.0f ms", self.pid, self.cfg.model, info.architecture,
                 info.n_ctx, ev.load_ms)
        if self._stopping:  # Shutdown arrived while loading: nothing runs, leave now
            self._exit_code = 0
            return
        self.runner.begin_serving()

    # ------------------------------------------------------------------ socket

    def _send(self, msg: Message) -> None:
        assert self._channel is not None
        self._channel.send(msg)

    def _on_message(self, msg: Message) -> None:
        try:
            self._dispatch(msg)
        except Exception as e:  # noqa: BLE001 - no request kills the worker
            log.error("handling %s %s failed:\n%s", msg.TYPE, msg.id, traceback.format_exc())
            self._send(internal_error(msg.id, e))

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Ping):
            self.runner.request_threads(msg.threads)
            snap = self.runner.snapshot
            running, waiting = self.runner.jobs.counts()
            self._send(Pong(id=msg.id, busy=bool(running), queue_len=waiting,
                            running_ids=running, slots=list(snap.slots), kv_tokens=snap.kv_tokens,
                            kv_budget_tokens=snap.kv_budget_tokens, n_decode_total=snap.n_decode_total,
                            n_busy_slots_total=snap.n_busy_slots_total, pid=self.pid))
        elif isinstance(msg, Generate):
            self._on_generate(msg)
        elif isinstance(msg, Cancel):
            self._on_cancel(msg.id)
        elif isinstance(msg, Shutdown):
            if not self._stopping:
                self._begin_stop("Shutdown received", self.cfg.shutdown_grace_s)
        elif isinstance(msg, (Tokenize, Detokenize, ApplyTemplate)):
            self._on_text_op(msg)
        elif isinstance(msg, KVChunk):
            self._streams.chunk(msg, "the model is still loading" if self.engine is None
                                else "the worker is shutting down" if self._stopping else None)
        elif isinstance(msg, KVAck):
            self._streams.ack(msg)
        elif isinstance(msg, SlotAction):
            if self.engine is None:
                self._send(Error(id=msg.id, code=ErrorCode.BUSY, message="the model is still loading"))
            elif self._stopping:
                self._send(Error(id=msg.id, code=ErrorCode.BUSY, message="the worker is shutting down"))
            else:
                self.runner.kv.submit_slot_action(msg)
        else:
            self._send(Error(id=msg.id, code=ErrorCode.PROTOCOL_ERROR,
                             message=f"unexpected message type {msg.TYPE!r}: the worker does not accept it"))

    # ------------------------------------------------------------------ requests

    def _on_generate(self, g: Generate) -> None:
        if self._stopping:
            self._send(Error(id=g.id, code=ErrorCode.BUSY, message="the worker is shutting down"))
            return
        err = self.runner.submit(g)
        if err is not None:
            self._send(err)
            return
        log.info("request %s accepted (X-Request-Id %s)", g.id, g.trace_id or "-")

    def _on_cancel(self, job_id: str) -> None:
        if self._streams.cancel_in(job_id):
            return
        if self.runner.cancel_waiting(job_id):
            self._send(cancelled_done(job_id))
            return
        job = self.runner.jobs.running(job_id)
        if job is not None:
            self._cancel_running(job)
        # unknown (or already finished): ignored

    def _cancel_running(self, job: Job) -> None:
        if job.cancel_at is None:
            job.cancel_at = time.monotonic()
        job.cancel.set()  # also seen by a StateOut still on its way (the runner is done with the job)
        if self._streams.cancel_out(job.id, job.tokens_sent):  # its engine part is over: ended here
            return
        self.runner.cancel(job.id)

    def _on_text_op(self, msg: Tokenize | Detokenize | ApplyTemplate) -> None:
        if self.engine is None:
            self._send(Error(id=msg.id, code=ErrorCode.BUSY, message="the model is still loading"))
            return
        # answered by the runner's text thread (FrameOut): a 7 MB tokenize never holds up this
        # loop's Pings and Token relaying, nor the engine's steps
        self.runner.text.submit(msg)

    # ------------------------------------------------------------------ exit

    def _begin_stop(self, reason: str, grace_s: float, linger_ms: int | None = None) -> None:
        if linger_ms is not None:
            self._linger_ms = min(self._linger_ms, linger_ms)
        if self._stopping:
            self._stop_deadline = min(self._stop_deadline, time.monotonic() + grace_s)
            return
        log.info("worker %s for %s stopping: %s", self.pid, self.cfg.model, reason)
        self._stopping = True
        self._stop_reason = reason
        self._stop_deadline = time.monotonic() + grace_s
        for job in self.runner.jobs.take_waiting():
            self._send(cancelled_done(job.id))
        for job in self.runner.jobs.running_jobs():
            self._cancel_running(job)
        if linger_ms != 0 and self.engine is not None:  # not when the parent is gone: nobody to serve again
            self._persisting = self.runner.kv.request_persist()
        self._check_stopped(time.monotonic())

    def _check_stopped(self, now: float) -> None:
        if self.engine is None and self._exit_code is None:
            self._exit_code = 0  # still loading: nothing runs, nothing to wait for
            return
        if not self.runner.jobs.running_jobs():
            if not self._persisting:  # the KV cache is saved (the router's grace bounds how long)
                self._exit_code = 0
        elif now >= self._stop_deadline:
            for job in self.runner.jobs.release_all():
                log.warning("request %s did not stop within the grace period; exiting anyway", job.id)
                self._send(cancelled_done(job.id, job.tokens_sent))
            self._exit_code = 0

    def _close(self) -> None:
        # The runner ends within a token once cancelled; do not wait for it when nobody listens.
        runner_ended = self.runner.stop(0.2 if self._linger_ms > 0 else 0.0)
        self._kv_events.close(self._linger_ms)  # AllBlocksCleared: the worker's cache goes with it
        if self._channel is not None:
            self._channel.close(self._linger_ms)
            self._channel = None
        if runner_ended:  # else the runner may still post: leave its pipe open rather than let the
            for fd in (self._wake_r, self._wake_w):  # fd number be reused and written into
                try:
                    os.close(fd)
                except OSError:
                    pass


def ready_frame(cfg: WorkerConfig, worker_id: str, ev: Loaded, max_jobs: int) -> Ready:
    """The Ready of a worker whose engine loaded (``ev``), running ``max_jobs`` generations at once."""
    info = ev.engine.info
    try:
        file_size = int(info.file_size)
    except (TypeError, ValueError):
        file_size = os.path.getsize(cfg.gguf)
    return Ready(
        id=worker_id, model=cfg.model, architecture=str(info.architecture), gguf_path=cfg.gguf,
        file_size=file_size, fingerprint=str(info.fingerprint), n_ctx=int(info.n_ctx),
        n_ctx_train=int(info.n_ctx_train), n_vocab=int(info.n_vocab),
        has_chat_template=bool(info.has_chat_template), pid=os.getpid(), load_ms=float(ev.load_ms),
        max_jobs=max_jobs, kv_budget_tokens=int(getattr(info, "kv_budget_tokens", 0) or 0))


def open_channel(cfg: WorkerConfig, connected: tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]] | None
                 ) -> Channel | None:
    """The worker's channel: over ``connected`` (a warm spare's socket), or newly connected to
    ``cfg.endpoint`` (None when that fails: logged)."""
    if connected is not None:
        return Channel.adopt(*connected, cfg.endpoint, cfg.linger_ms)
    channel = Channel(cfg.endpoint, cfg.credentials, cfg.linger_ms)
    return channel if channel.connect() else None
