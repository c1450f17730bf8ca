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

Job queue: ``runner.capacity`` generations run at once (1: the depth-one
queue); further Generates wait in arrival order, at most ``max_queue`` of them;
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import psutil
import zmq

from protocol.errors import ErrorCode
from protocol.limits import DEFAULT_KV_BUDGET_MIB
from protocol import (
    KV_STREAM_IDLE_S,
    MAX_FRAME_BYTES,
    ApplyTemplate,
    Cancel,
    Detokenize,
    Error,
    Generate,
    Hello,
    KVAck,
    KVChunk,
    LoadProgress,
    Message,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Shutdown,
    SlotAction,
    Token,
    Tokenize,
    WorkerCredentials,
    decode,
    encode,
)
from worker.runner import (
    FrameOut,
    Job,
    JobFinished,
    LoadFailed,
    LoadStep,
    Loaded,
    Persisted,
    RunnerEvent,
    BatchRunner,
    StateOut,
    cancelled_done,
    check_generate,
)

log = logging.getLogger("modelyard.worker")

__all__ = ["ParentWatch", "WorkerConfig", "WorkerServer", "default_loader"]

UNKNOWN_ID = "unknown"  # id of an Error answering a frame whose id could not be read
#: Incoming KV-state streams a worker validates at once (each holds up to one state in memory).
MAX_KV_RECEIVERS = 4


def default_loader(gguf_path: str, n_ctx: int | None, chat_template: str | None, *, parallel: int = 1,
                   kv_budget_mib: float | None = None, weights: str | None = None, n_ubatch: int | None = None,
                   progress: Callable[[str, int, int], None] | None = None) -> Any:
    """``worker.engine.Engine.load`` (imported lazily: the engine pulls in numpy); no
    ``kv_budget_mib`` -> ``protocol.limits.DEFAULT_KV_BUDGET_MIB``; no ``weights`` -> the engine's
    default (``n_ubatch`` likewise); ``progress`` as Engine.load's."""
    from worker.engine import Engine

    extra: dict[str, Any] = {} if weights is None else {"weights": weights}
    if n_ubatch is not None:
        extra["n_ubatch"] = n_ubatch
    return Engine.load(gguf_path, n_ctx=n_ctx, chat_template=chat_template, parallel=parallel,
                       kv_budget_mib=DEFAULT_KV_BUDGET_MIB if kv_budget_mib is None else kv_budget_mib,
                       progress=progress, **extra)


@dataclass
class WorkerConfig:
    """What one worker serves and how it behaves.

    model: configured model name (echoed in Hello / Ready).
    gguf: path of the GGUF file.
    endpoint: the router's ROUTER endpoint to connect to (``ipc://...`` or ``tcp://host:port``).
    n_ctx: KV cache size in tokens; None -> the engine's default.
    chat_template: template text or known name overriding the GGUF's; None -> the GGUF's.
    max_queue: Generates that may wait behind the running one(s); more -> Error "busy".
    parallel: KV slots: sequences decoded at once (``Ready.max_jobs``).
    kv_budget_mib: KV memory of all sequences and cached prefixes (MiB); None -> protocol.limits.DEFAULT_KV_BUDGET_MIB.
    parent_pid: exit when this process is gone; None -> no watch.
    shutdown_grace_s: after Shutdown, how long to wait for the running generation
        to end (seconds) before exiting anyway.
    parent_gone_grace_s: the same when the parent is gone (seconds; default 0: nobody
        listens any more, and the KV cache dies with the process).
    poll_ms: longest socket poll (ms); bounds how late the parent check runs.
    parent_check_s: interval of the parent check (seconds).
    linger_ms: ZMQ LINGER on exit (ms): how long unsent frames may delay exit.
    credentials: the per-spawn secret proven in Hello and, over tcp, the CURVE keys
        (``protocol.credentials``); None -> an empty secret, no CURVE.
    slot_save_path: directory of SlotAction save / restore files; None -> slot actions refused.
    kv_cache_dir: directory of this model's KV states kept across stops: on Shutdown / SIGTERM
        the idle KV entries are saved there (most recent first, within ``kv_cache_mib``) before
        exiting; at load they are indexed and restored lazily on a prefix match. None -> off.
    kv_cache_mib: disk budget of ``kv_cache_dir`` (MiB).
    """

    model: str
    gguf: str
    endpoint: str
    n_ctx: int | None = None
    chat_template: str | None = None
    max_queue: int = 8
    parallel: int = 1
    kv_budget_mib: float | None = None
    weights: str | None = None  # "quantized" | "f32"; None: the engine's default
    n_ubatch: int | None = None  # tokens of a prompt's micro-batch; None: the engine's default (512)
    parent_pid: int | None = None
    shutdown_grace_s: float = 3.0
    parent_gone_grace_s: float = 0.0
    poll_ms: int = 100
    parent_check_s: float = 0.2
    linger_ms: int = 1000
    credentials: WorkerCredentials | None = None
    slot_save_path: str | None = None
    kv_cache_dir: str | None = None
    kv_cache_mib: float = 1024.0

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint must be ipc://... or tcp://host:port, got {self.endpoint!r}")
        if self.n_ctx is not None and self.n_ctx <= 0:
            raise ValueError(f"n_ctx must be a positive number of tokens, got {self.n_ctx}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {self.parallel}")
        if self.kv_budget_mib is not None and not self.kv_budget_mib > 0:
            raise ValueError(f"kv_budget_mib must be > 0, got {self.kv_budget_mib}")


class ParentWatch:
    """Tells whether process ``pid`` is gone: exited, a zombie, or its pid reused.

    When ``pid`` is our parent at construction, being re-parented also counts
    as gone (the parent died and we were adopted).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._is_parent = pid == os.getppid()
        try:
            self._proc: psutil.Process | None = psutil.Process(pid)
        except psutil.Error:
            self._proc = None

    def gone(self) -> bool:
        if self._is_parent and os.getppid() != self.pid:
            return True
        if self._proc is None:
            return True
        try:
            if not self._proc.is_running():  # also catches pid reuse (create time differs)
                return True
            return self._proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:  # access denied and the like: cannot tell, assume alive
            return False


class WorkerServer:
    """Serve one model over one DEALER socket. ``serve()`` returns the exit status.

    Args:
        cfg: the worker's configuration.
        loader: ``(gguf_path, n_ctx, chat_template) -> engine`` following
            docs/ENGINE-API.md; default :func:`default_loader`.
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
                                     kv_cache_mib=cfg.kv_cache_mib)
        self.engine: Any = None
        self.pending: deque[Job] = deque()
        self.running: dict[str, Job] = {}
        self._sock: zmq.Socket[bytes] | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._exit_code: int | None = None
        self._stopping = False
        self._stop_deadline = 0.0
        self._stop_reason = ""
        self._stop_requested = threading.Event()
        self._persisting = False  # stopping: the idle KV entries are being saved (Persisted ends it)
        self._linger_ms = cfg.linger_ms
        self._dropped = 0  # frames dropped because the router was not reading
        self._watch = ParentWatch(cfg.parent_pid) if cfg.parent_pid is not None else None
        self._senders: dict[str, Any] = {}  # job id -> worker.kvstream.StateSender (stream_state)
        self._receivers: dict[str, Any] = {}  # stream id -> worker.kvstream.StateReceiver

    # ------------------------------------------------------------------ public

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
        if connected is not None:
            self._ctx, sock = connected
            sock.setsockopt(zmq.LINGER, self.cfg.linger_ms)
        else:
            self._ctx = zmq.Context()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, self.cfg.linger_ms)
            # Frames queue while the router is not reading; sends never block (NOBLOCK) and a
            # full queue drops frames rather than freezing the loop (parent checks must go on).
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            if creds is not None and creds.curve:  # tcp: the router's key and ours, handed over privately
                sock.curve_serverkey = str(creds.server_public).encode()
                sock.curve_publickey = str(creds.public).encode()
                sock.curve_secretkey = str(creds.secret_key).encode()
            try:
                sock.connect(self.cfg.endpoint)
            except zmq.ZMQError as e:
                log.error("cannot connect to %s: %s", self.cfg.endpoint, e)
                self._exit_code = 1
                sock.close(linger=0)
                self._close()
                return 1
        self._sock = sock
        try:
            if connected is None:
                self._send(Hello(id=self.worker_id, model=self.cfg.model, pid=self.pid,
                                 auth=creds.secret if creds is not None else ""))
            if self._watch is not None and self._watch.gone():
                self._begin_stop(f"parent process {self.cfg.parent_pid} is gone", 0.0, linger_ms=0)
            else:
                self.runner.start()
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(self._wake_r, zmq.POLLIN)
            next_check = 0.0
            while self._exit_code is None:
                ready = dict(poller.poll(self.cfg.poll_ms))
                if self._wake_r in ready:
                    self._drain_wake()
                self._drain_events()
                if sock in ready:
                    self._drain_socket()
                now = time.monotonic()
                if self._stop_requested.is_set() and not self._stopping:
                    self._begin_stop("stop requested (signal)", self.cfg.shutdown_grace_s)
                if self._watch is not None and now >= next_check:
                    next_check = now + self.cfg.parent_check_s
                    if not self._stopping or self._linger_ms > 0:
                        if self._watch.gone():
                            self._begin_stop(f"parent process {self.cfg.parent_pid} is gone",
                                             self.cfg.parent_gone_grace_s, linger_ms=0)
                if self._senders or self._receivers:
                    self._drop_idle_streams(now)
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
                job = self.running.pop(ev.job_id, None)
                if job is not None:  # None only after giving up on it at exit (answered already)
                    self._send(ev.final)
                if job is not None and job.cancel_at is not None:
                    log.debug("request %s: Cancel -> Done in %.1f ms", job.id,
                              (time.monotonic() - job.cancel_at) * 1e3)
                self._start_next()
            elif isinstance(ev, StateOut):
                self._on_state_out(ev)
            elif isinstance(ev, LoadStep):
                self._send(LoadProgress(id=self.worker_id, stage=ev.stage, done=ev.done, total=ev.total))
            elif isinstance(ev, Persisted):
                self._persisting = False
            elif isinstance(ev, Loaded):
                self._on_loaded(ev)
            elif isinstance(ev, LoadFailed):
                log.error("cannot load %s (%s): %s", self.cfg.model, self.cfg.gguf, ev.reason)
                self._send(Error(id=self.worker_id, code=ErrorCode.LOAD_FAILED, message=ev.reason[:4000]))
                while self.pending:  # requests that arrived while loading
                    self._send(Error(id=self.pending.popleft().id, code=ErrorCode.LOAD_FAILED, message=ev.reason[:4000]))
                self._stop_reason = "load failed"
                self._exit_code = 1

    def _on_loaded(self, ev: Loaded) -> None:
        self.engine = ev.engine
        info = ev.engine.info
        try:
            file_size = int(info.file_size)
        except (TypeError, ValueError):
            file_size = os.path.getsize(self.cfg.gguf)
        ready = Ready(
            id=self.worker_id, model=self.cfg.model, architecture=str(info.architecture), gguf_path=self.cfg.gguf,
            file_size=file_size, fingerprint=str(info.fingerprint), n_ctx=int(info.n_ctx),
            n_ctx_train=int(info.n_ctx_train), n_vocab=int(info.n_vocab),
            has_chat_template=bool(info.has_chat_template), pid=self.pid, load_ms=float(ev.load_ms),
            max_jobs=int(self.runner.capacity),
            kv_budget_tokens=int(getattr(info, "kv_budget_tokens", 0) or 0))
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
        self._start_next()

    def _start_next(self) -> None:
        while (self.engine is not None and not self._stopping and self.pending
               and len(self.running) < self.runner.capacity):
            job = self.pending.popleft()
            self.running[job.id] = job
            self.runner.submit(job)

    # ------------------------------------------------------------------ socket

    def _send(self, msg: Message) -> None:
        assert self._sock is not None
        try:
            frame = encode(msg)
        except Exception as e:  # noqa: BLE001 - a record that does not encode is our bug, not the peer's
            log.error("cannot encode %s %s: %s", msg.TYPE, msg.id, e)
            if isinstance(msg, (Token, Error)):
                return  # a Token is dropped (its text is still accounted for by the stream's end)
            too_big = isinstance(e, ProtocolError) and "exceeds" in e.reason
            frame = encode(Error(
                id=msg.id, code=ErrorCode.INVALID_REQUEST if too_big else ErrorCode.INTERNAL_ERROR,
                message=(f"the {msg.TYPE} answer does not fit in one frame ({MAX_FRAME_BYTES} bytes)" if too_big
                         else f"cannot encode the {msg.TYPE} answer: {type(e).__name__}: {e}")[:1000]))
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self._dropped += 1
            if self._dropped in (1, 10, 100) or self._dropped % 1000 == 0:
                log.warning("router is not reading: dropped a %s frame for %s (%d dropped so far)",
                            msg.TYPE, msg.id, self._dropped)
        except zmq.ZMQError as e:
            log.warning("cannot send a %s frame for %s: %s", msg.TYPE, msg.id, e)

    def _drain_socket(self) -> None:
        assert self._sock is not None
        for _ in range(1000):  # bounded, so runner frames and parent checks are never starved
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                log.warning("recv failed: %s", e)
                return
            self._on_frame(parts)
            if self._exit_code is not None:
                return

    def _on_frame(self, parts: list[bytes]) -> None:
        if len(parts) != 1:
            self._send(Error(id=UNKNOWN_ID, code=ErrorCode.PROTOCOL_ERROR,
                             message=f"a frame must be one message part, got {len(parts)} parts"))
            return
        try:
            msg = decode(parts[0])
        except ProtocolError as e:
            self._send(Error(id=e.msg_id or UNKNOWN_ID, code=ErrorCode.PROTOCOL_ERROR, message=e.reason))
            return
        try:
            self._dispatch(msg)
        except Exception as e:  # noqa: BLE001 - no request kills the worker
            log.error("handling %s %s failed:\n%s", msg.TYPE, msg.id, traceback.format_exc())
            self._send(Error(id=msg.id, code=ErrorCode.INTERNAL_ERROR, message=f"{type(e).__name__}: {e}"[:1000]))

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, Ping):
            self.runner.request_threads(msg.threads)
            snap = self.runner.snapshot
            self._send(Pong(id=msg.id, busy=bool(self.running), queue_len=len(self.pending),
                            running_ids=list(self.running), slots=list(snap.slots), kv_tokens=snap.kv_tokens,
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
            self._on_kv_chunk(msg)
        elif isinstance(msg, KVAck):
            sender = self._senders.get(msg.id)
            if sender is not None:  # else: a stream that ended or was cancelled
                sender.ack(msg.seq)
                self._pump(sender)
        elif isinstance(msg, SlotAction):
            if self.engine is None:
                self._send(Error(id=msg.id, code=ErrorCode.BUSY, message="the model is still loading"))
            elif self._stopping:
                self._send(Error(id=msg.id, code=ErrorCode.BUSY, message="the worker is shutting down"))
            else:
                self.runner.submit_slot_action(msg)
        else:
            self._send(Error(id=msg.id, code=ErrorCode.PROTOCOL_ERROR,
                             message=f"unexpected message type {msg.TYPE!r}: the worker does not accept it"))

    # ------------------------------------------------------------------ requests

    def _on_generate(self, g: Generate) -> None:
        if self._stopping:
            self._send(Error(id=g.id, code=ErrorCode.BUSY, message="the worker is shutting down"))
            return
        if g.id in self.running or any(j.id == g.id for j in self.pending):
            self._send(Error(id=g.id, code=ErrorCode.INVALID_REQUEST, message=f"request id {g.id!r} is already in use"))
            return
        err = check_generate(g, None if self.engine is None else int(self.engine.info.n_vocab))
        if err is not None:
            self._send(err)
            return
        can_start_now = self.engine is not None and not self.pending and len(self.running) < self.runner.capacity
        if not can_start_now and len(self.pending) >= self.cfg.max_queue:
            self._send(Error(id=g.id, code=ErrorCode.BUSY, message=(
                f"the worker is busy: {len(self.running)} running, {len(self.pending)} waiting "
                f"(max_queue={self.cfg.max_queue})")))
            return
        self.pending.append(Job(g))
        log.info("request %s accepted (X-Request-Id %s)", g.id, g.trace_id or "-")
        self._start_next()

    def _on_cancel(self, job_id: str) -> None:
        if self._receivers.pop(job_id, None) is not None:
            log.info("KV stream %s cancelled: the partial state is dropped", job_id)
            return
        for job in self.pending:
            if job.id == job_id:
                self.pending.remove(job)
                self._send(cancelled_done(job_id))
                return
        running = self.running.get(job_id)
        if running is not None:
            self._cancel_running(running)
        # unknown (or already finished): ignored

    def _cancel_running(self, job: Job) -> None:
        if job.cancel_at is None:
            job.cancel_at = time.monotonic()
        job.cancel.set()  # also seen by a StateOut still on its way (the runner is done with the job)
        if self._senders.pop(job.id, None) is not None:  # its engine part is over: end it here
            self._end_streamed(job.id, cancelled_done(job.id, job.tokens_sent))
            return
        self.runner.cancel(job.id)

    # ------------------------------------------------------------------ KV-state streams

    def _on_state_out(self, ev: StateOut) -> None:
        from worker.kvstream import StateSender

        job = self.running.get(ev.job_id)
        if job is None:  # given up on at exit (answered already)
            return
        if job.cancel.is_set():
            self._end_streamed(job.id, cancelled_done(job.id, job.tokens_sent))
            return
        sender = StateSender(job.id, ev.state, ev.final)
        self._senders[job.id] = sender
        self._pump(sender)

    def _pump(self, sender: Any) -> None:
        """Send the chunks ``sender``'s window allows; after the last one, the job's Done."""
        for seq, data, last in sender.take():
            self._send(KVChunk(id=sender.job_id, seq=seq, data=data, last=last))
        if sender.done:
            self._senders.pop(sender.job_id, None)
            log.info("request %s: streamed its KV state (%d tokens, %d bytes)", sender.job_id, sender.n_tokens,
                     sender.n_bytes)
            self._end_streamed(sender.job_id, sender.final)

    def _end_streamed(self, job_id: str, final: Message) -> None:
        if self.running.pop(job_id, None) is not None:
            self._send(final)
        self._start_next()

    def _on_kv_chunk(self, msg: KVChunk) -> None:
        from worker.engine.kv.state import KVStateError
        from worker.kvstream import StateReceiver, StreamOrderError

        rcv = self._receivers.get(msg.id)
        if rcv is None:
            why = ("the model is still loading" if self.engine is None
                   else "the worker is shutting down" if self._stopping
                   else f"{len(self._receivers)} KV streams are already arriving" if len(self._receivers) >= MAX_KV_RECEIVERS
                   else None)
            if why is not None:
                self._send(Error(id=msg.id, code=ErrorCode.BUSY, message=why))
                return
            if msg.seq != 0:
                self._send(Error(id=msg.id, code=ErrorCode.PROTOCOL_ERROR,
                                 message=f"KV chunk {msg.seq} of a stream that is not open here"))
                return
            rcv = self._receivers[msg.id] = StateReceiver(msg.id, self.engine.kv_identity)
        try:
            rcv.feed(msg.seq, msg.data)
            self._send(KVAck(id=msg.id, seq=msg.seq))
            if not msg.last:
                return
            state = rcv.finish()
        except (KVStateError, StreamOrderError) as e:
            del self._receivers[msg.id]
            code = e.code if isinstance(e, KVStateError) else ErrorCode.PROTOCOL_ERROR
            text = e.message if isinstance(e, KVStateError) else str(e)
            log.warning("KV stream %s refused: %s: %s", msg.id, code, text)
            self._send(Error(id=msg.id, code=code, message=text))
            return
        del self._receivers[msg.id]
        self.runner.install_state(msg.id, state, rcv.n_bytes, rcv.t0)  # answered by the engine thread

    def _drop_idle_streams(self, now: float) -> None:
        for sid, rcv in list(self._receivers.items()):
            if now - rcv.last_activity > KV_STREAM_IDLE_S:
                del self._receivers[sid]
                log.warning("KV stream %s: no chunk for %.0f s; the partial state is dropped", sid, KV_STREAM_IDLE_S)
        for jid, snd in list(self._senders.items()):
            if now - snd.last_activity > KV_STREAM_IDLE_S:
                del self._senders[jid]
                log.warning("request %s: its KV stream got no acknowledgement for %.0f s; dropped", jid,
                            KV_STREAM_IDLE_S)
                self._end_streamed(jid, Error(id=jid, code=ErrorCode.INTERNAL_ERROR, message=(
                    f"the KV state stream was not acknowledged within {KV_STREAM_IDLE_S:g} s")))

    def _on_text_op(self, msg: Tokenize | Detokenize | ApplyTemplate) -> None:
        if self.engine is None:
            self._send(Error(id=msg.id, code=ErrorCode.BUSY, message="the model is still loading"))
            return
        # answered by the runner's text thread (FrameOut): a 7 MB tokenize never holds up this
        # loop's Pings and Token relaying, nor the engine's steps
        self.runner.submit_text_op(msg)

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
        while self.pending:
            self._send(cancelled_done(self.pending.popleft().id))
        for job in list(self.running.values()):
            self._cancel_running(job)
        if linger_ms != 0 and self.engine is not None:  # not when the parent is gone: nobody to serve again
            self._persisting = self.runner.persist()
        self._check_stopped(time.monotonic())

    def _check_stopped(self, now: float) -> None:
        if self.engine is None and self._exit_code is None:
            self._exit_code = 0  # still loading: nothing runs, nothing to wait for
            return
        if not self.running:
            if not self._persisting:  # the KV cache is saved (the router's grace bounds how long)
                self._exit_code = 0
        elif now >= self._stop_deadline:
            for job in self.running.values():
                log.warning("request %s did not stop within the grace period; exiting anyway", job.id)
                self._send(cancelled_done(job.id, job.tokens_sent))
            self.running.clear()
            self._exit_code = 0

    def _close(self) -> None:
        # The runner ends within a token once cancelled; do not wait for it when nobody listens.
        runner_ended = self.runner.stop(0.2 if self._linger_ms > 0 else 0.0)
        if self._sock is not None:
            self._sock.close(linger=self._linger_ms)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if runner_ended:  # else the runner may still post: leave its pipe open rather than let the
            for fd in (self._wake_r, self._wake_w):  # fd number be reused and written into
                try:
                    os.close(fd)
                except OSError:
                    pass
