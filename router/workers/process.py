"""One worker's connection: the mechanism under a model's state machine
(``router.workers.lifecycle``, applied by ``pool.ModelSlot`` alone).

:class:`WorkerProcess` binds a ROUTER socket at the endpoint its launcher names, has the
launcher (``router.workers.launchers``) start the worker, accepts the Hello of that worker
only — the peer that proves the per-spawn secret the launcher handed it privately
(``protocol.credentials``; over tcp the socket also speaks ZeroMQ CURVE with keys handed over
the same way) and whose pid the launcher's handle owns — and routes frames to per-request
queues by request id. The handle reports the process's exit; then every open request queue
receives a :class:`WorkerGone` at once. A warm spare's connection is made by the launcher
before any model wants it; the model that takes it (:meth:`WorkerProcess.adopt`) sends Assign
from :meth:`WorkerProcess.start` instead of starting a process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol import (
    Cancel,
    Error,
    Hello,
    LoadProgress,
    Message,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Shutdown,
    WorkerCredentials,
    decode,
    encode,
    secret_matches,
)
from protocol.errors import ErrorCode
from router.config import ModelConfig
from router.workers.launchers import LaunchError, Launcher, WorkerHandle
from router.workers.options import assign_for, option_args
from router.workers.tasks import spawn

log = logging.getLogger("modelyard.worker")


class LoadFailed(Exception):
    """The worker did not become ready. ``exit_code`` is set when the process exited."""

    def __init__(self, reason: str, exit_code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


@dataclass(frozen=True)
class WorkerGone:
    """Put into every open request queue when the worker process is gone."""

    reason: str
    exit_code: int | None


@dataclass(frozen=True)
class Aborted:
    """Put into one request's queue when the router ends it (shutting down): the
    request fails with ``reason`` and its worker gets Cancel."""

    reason: str


#: What a request's queue carries: the worker's frames, or word that it ended.
StreamItem = Message | WorkerGone | Aborted


class WorkerUnreachable(Exception):
    """A frame could not be sent: the worker is gone or not connected."""


#: A CURVE keypair (public, secret), Z85 text, as ``zmq.curve_keypair`` makes it.
CurveKeypair = tuple[str, str]

#: ZeroMQ monitor events that mean a peer failed the CURVE handshake.
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
#: tcp: ZMTP heartbeats every HEARTBEAT_IVL_MS; a peer silent for HEARTBEAT_TIMEOUT_MS is
#: disconnected (a worker whose host vanished is known within ~2 s, not at the next request; a
#: worker that dies on a live host closes its connection and is known at once).
HEARTBEAT_IVL_MS = 500
HEARTBEAT_TIMEOUT_MS = 2000
#: The exit code a worker gets when its connection is lost (as a SIGKILLed child's).
LOST_EXIT_CODE = -9


def new_curve_keypair() -> CurveKeypair:
    """A fresh CURVE keypair. Raises RuntimeError if libzmq was built without CURVE."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support (zmq.has('curve') is False)")
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


_ids = itertools.count(1)


class WorkerProcess:
    """One worker and its socket. Create, ``await start()``, use, ``await stop()``.

    ``model`` None: a warm spare (made by its launcher: :meth:`start_spare`, then
    :meth:`adopt` by the model that takes it). Not a state owner: ``pool.ModelSlot``
    decides; this object executes.
    """

    def __init__(self, model: ModelConfig | None, ctx: zmq.asyncio.Context, launcher: Launcher,
                 curve_server: CurveKeypair | None = None) -> None:
        self.model = model
        self._launcher = launcher
        self.endpoint = ""  # the bound endpoint (a tcp port 0 is known once bound)
        self.command: list[str] = []
        self.serial = next(_ids)
        self._ctx = ctx
        self._sock: zmq.asyncio.Socket | None = None
        self._identity: bytes | None = None
        self._handle: WorkerHandle | None = None
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._hello = asyncio.Event()
        self._ready: asyncio.Future[Ready] = asyncio.get_running_loop().create_future()
        self.exited = asyncio.Event()
        self.exit_code: int | None = None
        self.kill_reason: str | None = None  # set when we killed it (hung, stop)
        self._stop_requested = False
        self.ready: Ready | None = None
        self._late_fingerprint = ""  # from a second Ready (sent when the file's hash finished after load)
        self.started_at = time.time()
        self.from_spare = False  # started as a warm spare, then given this model (adopt)
        self.start_ended = asyncio.Event()  # start() has returned or raised (the launcher's replacement waits for it)
        self._exit_callbacks: list[Callable[[WorkerProcess], None]] = []
        self._call_ids = itertools.count(1)
        self._curve_server = curve_server  # the service's CURVE keypair (tcp), else None
        self._credentials: WorkerCredentials | None = None
        self._monitor: asyncio.Task[None] | None = None
        self.refused_peers = 0  # peers refused on this socket: bad Hello, failed CURVE handshake
        self._on_hello: Callable[[], None] | None = None
        self._on_load_step: Callable[[LoadProgress], None] | None = None
        self.last_frame_at = time.monotonic()  # when its own peer last sent a frame (monotonic s)

    # ------------------------------------------------------------------ facts

    @property
    def name(self) -> str:
        """The model's name, or "(spare)" before a spare is adopted (for logs)."""
        return self.model.name if self.model is not None else "(spare)"

    @property
    def pid(self) -> int | None:
        return self._handle.pid if self._handle is not None else None

    @property
    def host(self) -> str:
        """Where it runs: its process's host once started (a Ray node), else its launcher's."""
        return self._handle.host if self._handle is not None else self._launcher.host

    @property
    def alive(self) -> bool:
        return self._handle is not None and not self.exited.is_set()

    @property
    def warm(self) -> bool:
        """It has said Hello with this spawn's secret (a spare is warm from then on)."""
        return self._hello.is_set()

    @property
    def max_jobs(self) -> int:
        """Generations the worker runs at once (1: the depth-one job queue)."""
        return max(1, self.ready.max_jobs) if self.ready is not None else 1

    def rss_bytes(self) -> int | None:
        """Resident memory of the worker process, bytes (None if gone)."""
        return self._handle.rss_bytes() if self._handle is not None and self.alive else None

    def exit_description(self) -> str:
        if self.kill_reason:
            return self.kill_reason
        code = self.exit_code
        if code is None:
            return "worker process is gone"
        if code < 0:
            return f"worker process was killed by signal {-code}"
        return f"worker process exited with code {code}"

    def on_exit(self, callback: Callable[[WorkerProcess], None]) -> None:
        """Call ``callback(self)`` (in the event loop) once the process has exited."""
        self._exit_callbacks.append(callback)

    # ------------------------------------------------------------------ lifecycle

    async def _launch(self) -> None:
        """Bind the socket at the launcher's endpoint, make this spawn's credentials, and have
        the launcher start the worker (``self.model``'s, or a spare). Raises LoadFailed."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, 17 * 1024 * 1024)
        curve = None
        if self._curve_server is not None:
            sock.curve_server = True
            sock.curve_publickey = self._curve_server[0].encode("ascii")
            sock.curve_secretkey = self._curve_server[1].encode("ascii")
            curve = (self._curve_server[0], *new_curve_keypair())
        self._credentials = WorkerCredentials.new(curve)
        endpoint = self._launcher.endpoint()
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            self.exited.set()
            raise LoadFailed(f"cannot bind the worker socket {endpoint}: {e}") from None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        if self.endpoint.startswith("tcp://"):
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if curve is not None:
            self._monitor = asyncio.create_task(self._watch_handshakes(sock), name=f"worker-monitor-{self.name}")
        self._reader = asyncio.create_task(self._read_loop(), name=f"worker-reader-{self.name}")
        try:
            launched = await self._launcher.start(self.model, self.endpoint, self._credentials)
        except LaunchError as e:
            self._close_socket()
            self.exited.set()
            raise LoadFailed(e.reason) from None
        self._handle = launched.handle
        self.command = list(launched.command)
        launched.handle.on_exit(self._on_exit)

    async def start_spare(self, timeout_s: float) -> bool:
        """Start this connection's worker as a warm spare (no model) and wait for its Hello.
        True once it is warm; False if it could not start, exited, or said no Hello within
        ``timeout_s`` seconds (then it is still running: the caller kills it)."""
        try:
            await self._launch()
        except LoadFailed as e:
            self.kill_reason = e.reason
            return False
        hello = asyncio.ensure_future(self._hello.wait())
        exited = asyncio.ensure_future(self.exited.wait())
        try:
            await asyncio.wait({hello, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hello.cancel()
            exited.cancel()
        return self.warm and not self.exited.is_set()

    def adopt(self, model: ModelConfig) -> None:
        """This warm spare is ``model``'s from now on: its :meth:`start` sends Assign."""
        assert self.model is None and self._handle is not None, "only a started spare is adopted"
        self.model = model
        self.from_spare = True
        self.command = [*self.command, *option_args(model)]  # what it runs, as a worker started for it

    async def start(self, timeout_s: float, progress: Callable[[str, dict[str, Any]], None] | None = None) -> Ready:
        """Start the worker (or, an adopted spare, send it Assign) and wait for Hello then Ready.
        ``progress(stage, fields)`` hears ``spawned`` (``pid``; ``spare`` True for an adopted
        spare), ``connected`` (the worker's Hello: it is loading) and each LoadProgress the
        worker sends (its ``stage``; ``done``, ``total``).

        Raises LoadFailed on Error(load_failed), process exit, or no Ready
        within ``timeout_s`` seconds (the process is then killed).
        """
        try:
            return await self._start(timeout_s, progress)
        finally:
            self.start_ended.set()

    async def _start(self, timeout_s: float, progress: Callable[[str, dict[str, Any]], None] | None) -> Ready:
        assert self.model is not None, "a spare starts with start_spare()"
        adopted = self._handle is not None
        if not adopted:
            await self._launch()
        if progress is not None:
            progress("spawned", {"pid": self.pid, **({"spare": True} if adopted else {})})
            self._on_hello = lambda: progress("connected", {})
            self._on_load_step = lambda m: progress(m.stage, {"done": m.done, "total": m.total})
        if adopted:
            if self._on_hello is not None:
                self._on_hello()
            try:
                await self.send(assign_for(self.model, self.new_call_id("assign")))
            except (WorkerUnreachable, ProtocolError) as e:
                self.kill("could not be assigned its model")
                await self._wait_exited(5.0)
                raise LoadFailed(f"cannot give the warm spare its model: {e}", self.exit_code) from None
        exited = asyncio.ensure_future(self.exited.wait())
        try:
            waiters: set[asyncio.Future[Any]] = {self._ready, exited}
            done, _ = await asyncio.wait(waiters, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if self._ready.done() and not self._ready.cancelled() and self._ready.exception() is None:
            self.ready = self._ready.result()
            if not self.ready.fingerprint and self._late_fingerprint:
                self.ready = dataclasses.replace(self.ready, fingerprint=self._late_fingerprint)
            return self.ready
        if self._ready.done() and not self._ready.cancelled():
            err = self._ready.exception()
            if not await self._wait_exited(2.0):  # the worker exits 1 after Error(load_failed)
                self.kill("load failed")
                await self._wait_exited(5.0)
            raise LoadFailed(str(err), self.exit_code)
        if self.exited.is_set():
            raise LoadFailed(f"{self.exit_description()} before it was ready", self.exit_code)
        self.kill(f"not ready within load_timeout_s={timeout_s:g}")
        await self._wait_exited(5.0)
        raise LoadFailed(f"worker was not ready within load_timeout_s={timeout_s:g} s; killed", self.exit_code)

    def _on_exit(self, code: int) -> None:
        if self.exited.is_set():  # declared lost already (_probe_peer); its launcher's news comes later
            return
        self.exit_code = code
        self.exited.set()
        # Frames the worker sent before it died are delivered before the news of its death.
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            raw: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
            while True:
                try:
                    parts = raw.recv_multipart(zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                self._handle_frame(parts)
        gone = WorkerGone(self.exit_description(), code)
        log.log(logging.INFO if self._stop_requested else logging.WARNING, "worker %s (pid %s) for %s: %s",
                self.serial, self.pid, self.name, gone.reason)
        for q in self._streams.values():
            q.put_nowait(gone)
        for cb in self._exit_callbacks:
            try:
                cb(self)
            except Exception:  # pragma: no cover - a bug in a callback must not stop the others
                log.exception("worker exit callback failed")
        self._close_socket()

    def kill(self, reason: str | None = None) -> None:
        """End the process now (its launcher's kill: SIGKILL for a local child; no-op if gone).
        ``reason`` becomes its exit description."""
        if reason and not self.kill_reason and not self.exited.is_set():
            self.kill_reason = reason
        if self._handle is not None:
            self._handle.kill()

    async def stop(self, grace_s: float) -> None:
        """Shutdown frame, up to ``grace_s`` seconds to exit, then kill. Idempotent."""
        self._stop_requested = True
        if self._handle is None:
            self._close_socket()
            return
        if not self.exited.is_set():
            if self._identity is None:  # not connected (still starting): nothing to ask
                self.kill("stopped before it connected")
            try:
                await self.send(Shutdown(id=f"shutdown-{self.serial}"))
            except WorkerUnreachable:
                pass
            if not await self._wait_exited(grace_s):
                log.warning("worker %s for %s ignored Shutdown for %.1f s; killing", self.pid,
                            self.name, grace_s)
                self.kill(f"killed after ignoring Shutdown for {grace_s:g} s")
                await self._wait_exited(10.0)
        self._close_socket()

    async def _wait_exited(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self.exited.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def _close_socket(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except OSError:
                pass

    # ------------------------------------------------------------------ frames

    async def _read_loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        while True:
            try:
                parts = await sock.recv_multipart(copy=True)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self._handle_frame(parts)

    async def _watch_handshakes(self, sock: zmq.asyncio.Socket) -> None:
        """Log (and count) every peer that failed the CURVE handshake on ``sock``; on any peer's
        disconnection, check that the worker is still connected (:meth:`_probe_peer`)."""
        mon = sock.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED)
        try:
            while True:
                try:
                    event = parse_monitor_message(await mon.recv_multipart())
                except (zmq.ZMQError, asyncio.CancelledError):
                    return
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    spawn(self._probe_peer())
                    continue
                self._refused(f"CURVE handshake failed ({zmq.Event(event['event']).name}, "
                              f"errno {event['value']})")
        finally:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(linger=0)

    async def _probe_peer(self) -> None:
        """A peer disconnected: if it was the worker (a Ping to its routing id is now refused:
        ROUTER_MANDATORY), the worker is lost, as if it had exited: its streams end with their
        error at once, it is killed through its launcher, and a later exit report is ignored.
        A worker on another host is then known to be gone within the heartbeat timeout, whatever
        its launcher learns and when."""
        for delay in (0.0, 0.2):  # the socket drops the peer's pipe when it next processes commands
            await asyncio.sleep(delay)
            if self._identity is None or self.exited.is_set() or self._stop_requested:
                return
            try:
                await self.send(Ping(id=self.new_call_id("probe")))
                continue  # still routed: another peer left (or not yet dropped)
            except (WorkerUnreachable, ProtocolError):
                pass
            self.kill("its connection was lost (host or network gone)")
            log.warning("worker %s (pid %s on %s) for %s: connection lost", self.serial, self.pid, self.host, self.name)
            self._on_exit(LOST_EXIT_CODE)
            return

    def _refused(self, why: str) -> None:
        """Count a refused peer; log the first ten, then every hundredth (a peer that keeps
        reconnecting must not flood the log)."""
        self.refused_peers += 1
        n = self.refused_peers
        if n <= 10 or n % 100 == 0:
            log.warning("refused a peer on %s's worker socket: %s (%d refused so far)", self.name, why, n)

    def _handle_frame(self, parts: list[bytes]) -> None:
        if len(parts) != 2:
            log.warning("dropping a %d-part frame from %s's worker", len(parts), self.name)
            return
        ident, payload = parts
        try:
            msg = decode(payload)
        except ProtocolError as e:
            log.warning("bad frame from %s's worker: %s", self.name, e.reason)
            if e.msg_id is not None and e.msg_id in self._streams and ident == self._identity:
                self._streams[e.msg_id].put_nowait(
                    Error(id=e.msg_id, code=ErrorCode.PROTOCOL_ERROR, message=f"bad frame from worker: {e.reason}"))
            return
        self._dispatch(ident, msg)

    def _dispatch(self, ident: bytes, msg: Message) -> None:
        if isinstance(msg, Hello):
            if self._identity is None and self._authentic(msg):
                self._identity = ident
                self._hello.set()
                if self._on_hello is not None:
                    self._on_hello()
            elif ident != self._identity:
                why = ("another peer is already connected" if self._identity is not None
                       else "wrong secret or not the spawned process")
                self._refused(f"ignoring Hello claiming pid {msg.pid} (worker {self.pid}): {why}")
            return
        if ident != self._identity:
            log.warning("ignoring %s from an unknown peer on %s's socket", msg.TYPE, self.name)
            return
        self.last_frame_at = time.monotonic()  # liveness: any frame of the worker (router.workers.liveness judges)
        q = self._streams.get(msg.id)
        if q is not None:
            q.put_nowait(msg)
            return
        if isinstance(msg, LoadProgress):
            if not self._ready.done() and self._on_load_step is not None:
                self._on_load_step(msg)
            return
        if isinstance(msg, Ready):
            if not self._ready.done():
                self._ready.set_result(msg)
            elif msg.fingerprint:  # the second Ready: the fingerprint the worker was still computing
                self._late_fingerprint = msg.fingerprint
                if self.ready is not None and not self.ready.fingerprint:
                    self.ready = dataclasses.replace(self.ready, fingerprint=msg.fingerprint)
            return
        if isinstance(msg, Error) and not self._ready.done():
            self._ready.set_exception(LoadFailed(f"{msg.code}: {msg.message}"))
            return
        log.debug("frame %s for unknown request %s from %s's worker", msg.TYPE, msg.id, self.name)

    def _authentic(self, hello: Hello) -> bool:
        """The Hello proves this spawn's secret and names our process (or its child)."""
        creds = self._credentials
        return creds is not None and secret_matches(creds.secret, hello.auth) and self._is_own(hello.pid)

    def _is_own(self, pid: int) -> bool:
        return self._handle is not None and self._handle.is_own(pid)

    def open_stream(self, request_id: str, into: asyncio.Queue[StreamItem] | None = None) -> asyncio.Queue[StreamItem]:
        """Route the frames of ``request_id`` into ``into`` (a request record's inbox; else a new
        queue) from now on; returns it. A gone worker yields WorkerGone at once."""
        q: asyncio.Queue[StreamItem] = into if into is not None else asyncio.Queue()
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._streams[request_id] = q
        if self.exited.is_set():
            q.put_nowait(WorkerGone(self.exit_description(), self.exit_code))
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort_stream(self, request_id: str, reason: str) -> None:
        """End ``request_id`` from the router's side (its reader raises; it then cancels)."""
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(Aborted(reason))

    async def send(self, msg: Message | bytes) -> None:
        """Send one message (or a frame already made by :func:`protocol.encode`). Raises
        ProtocolError if it cannot be encoded (nothing is sent), WorkerUnreachable if
        the worker is gone or not connected."""
        frame = msg if isinstance(msg, bytes) else encode(msg)
        if self._sock is None or self._identity is None or self.exited.is_set():
            raise WorkerUnreachable(self.exit_description() if self.exited.is_set() else "worker not connected")
        try:
            await self._sock.send_multipart([self._identity, frame])
        except zmq.ZMQError as e:
            raise WorkerUnreachable(f"cannot reach worker: {e}") from None

    def send_nowait(self, msg: Message) -> None:
        """Fire-and-forget send (for cleanup paths that must not await)."""
        async def _go() -> None:
            try:
                await self.send(msg)
            except WorkerUnreachable:
                pass
            except ProtocolError as e:  # pragma: no cover - Cancel/Shutdown always encode
                log.error("cannot send %s to %s's worker: %s", msg.TYPE, self.name, e.reason)
        spawn(_go())

    async def call(self, msg: Message, timeout_s: float) -> Message:
        """Send ``msg`` and return the first frame answering its id (a result or an Error).

        Raises ProtocolError (cannot be encoded: nothing sent, no stream opened),
        WorkerUnreachable (not sent), TimeoutError, or returns a WorkerGone-derived
        Error(code=ErrorCode.WORKER_GONE) if the process died meanwhile.
        """
        frame = encode(msg)  # before the stream opens: a frame the protocol cannot carry sends nothing
        q = self.open_stream(msg.id)
        try:
            await self.send(frame)
            answer = await asyncio.wait_for(q.get(), timeout_s)
        finally:
            self.close_stream(msg.id)
        if isinstance(answer, WorkerGone):
            return Error(id=msg.id, code=ErrorCode.WORKER_GONE, message=answer.reason)
        if isinstance(answer, Aborted):  # only a running generation's stream is aborted, never a call's id
            raise WorkerUnreachable(f"ended by the router: {answer.reason}")
        return answer

    def new_call_id(self, kind: str) -> str:
        return f"{kind}-{self.serial}-{next(self._call_ids)}"

    async def ping(self, timeout_s: float) -> Pong | None:
        """A Pong, or None if none came within ``timeout_s`` seconds."""
        try:
            ans = await self.call(Ping(id=self.new_call_id("ping")), timeout_s)
        except (TimeoutError, WorkerUnreachable, ProtocolError):
            return None
        return ans if isinstance(ans, Pong) else None

    def cancel(self, request_id: str) -> None:
        self.send_nowait(Cancel(id=request_id))

