"""One worker's socket: the frames half of a worker connection (``router.workers.process``).

:class:`WorkerChannel` binds a ROUTER socket (over tcp with ZeroMQ CURVE, its client keys made
per spawn), makes this spawn's credentials (``protocol.credentials``), accepts the Hello of the
one peer that proves the per-spawn secret and whose pid the process owns (:meth:`_is_own`),
refuses and counts any other, and routes that peer's frames to per-request queues by request
id (:meth:`open_stream`); frames for no open request go to :meth:`_unrouted` (Ready,
LoadProgress, a load's Error, KvEvents — never a request's, whatever their id: the process's). When the worker is gone every open queue
receives a :class:`WorkerGone` (:meth:`_end_streams`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol import (
    Cancel, Error, Hello, Message, Ping, Pong, ProtocolError, WorkerCredentials, decode, encode,
    secret_matches,
)
from protocol.errors import ErrorCode
from protocol.kv_events import KvEvents
from router.workers.tasks import spawn

log = logging.getLogger("modelyard.worker")


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


def new_curve_keypair() -> CurveKeypair:
    """A fresh CURVE keypair. Raises RuntimeError if libzmq was built without CURVE."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support (zmq.has('curve') is False)")
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


_ids = itertools.count(1)


class WorkerChannel:
    """The socket of one worker connection and its per-request streams (the base of
    ``router.workers.process.WorkerProcess``, which says who the peer is and when it is gone)."""

    def __init__(self, ctx: zmq.asyncio.Context, curve_server: CurveKeypair | None = None) -> None:
        self.endpoint = ""  # the bound endpoint (a tcp port 0 is known once bound)
        self.serial = next(_ids)
        self._ctx = ctx
        self._sock: zmq.asyncio.Socket | None = None
        self._identity: bytes | None = None
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._hello = asyncio.Event()
        self.exited = asyncio.Event()
        self.exit_code: int | None = None
        self._call_ids = itertools.count(1)
        self._curve_server = curve_server  # the service's CURVE keypair (tcp), else None
        self._credentials: WorkerCredentials | None = None
        self._monitor: asyncio.Task[None] | None = None
        self.refused_peers = 0  # peers refused on this socket: bad Hello, failed CURVE handshake
        self._on_hello: Callable[[], None] | None = None
        self.last_frame_at = time.monotonic()  # when its own peer last sent a frame (monotonic s)

    # ------------------------------------------------------------------ what the process says

    @property
    def name(self) -> str:
        """The model's name (for logs)."""
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        """The worker's pid (None before it is started)."""
        raise NotImplementedError

    def exit_description(self) -> str:
        """Why the worker is gone."""
        raise NotImplementedError

    def _is_own(self, pid: int) -> bool:
        """``pid`` is the spawned process (or its child)."""
        raise NotImplementedError

    def _unrouted(self, msg: Message) -> None:
        """A frame of the worker for no open request (Ready, LoadProgress, ...)."""
        raise NotImplementedError

    @property
    def warm(self) -> bool:
        """It has said Hello with this spawn's secret (a spare is warm from then on)."""
        return self._hello.is_set()

    # ------------------------------------------------------------------ the socket

    def _bind(self, endpoint: str) -> None:
        """Bind the ROUTER socket at ``endpoint`` and make this spawn's credentials (over tcp with
        CURVE); start reading. Raises zmq.ZMQError if it cannot bind (the socket is closed)."""
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
        try:
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        if self.endpoint.startswith("tcp://"):
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if curve is not None:
            self._monitor = asyncio.create_task(self._watch_handshakes(sock), name=f"worker-monitor-{self.name}")
        self._reader = asyncio.create_task(self._read_loop(), name=f"worker-reader-{self.name}")

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

    def _end_streams(self, gone: WorkerGone) -> None:
        """The worker is gone: the frames it sent before are delivered first, then ``gone`` to every open stream."""
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
        for q in self._streams.values():
            q.put_nowait(gone)

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
        ROUTER_MANDATORY), :meth:`_connection_lost` decides what that means."""
        for delay in (0.0, 0.2):  # the socket drops the peer's pipe when it next processes commands
            await asyncio.sleep(delay)
            if self._identity is None or self.exited.is_set():
                return
            try:
                await self.send(Ping(id=self.new_call_id("probe")))
                continue  # still routed: another peer left (or not yet dropped)
            except (WorkerUnreachable, ProtocolError):
                pass
            self._connection_lost()
            return

    def _connection_lost(self) -> None:
        """The worker's connection is gone (it died, or its host or network did). The process
        side (``router.workers.process.WorkerProcess``) ends it; the channel alone does nothing."""

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
        q = self._streams.get(msg.id) if not isinstance(msg, KvEvents) else None
        if q is not None:
            q.put_nowait(msg)
            return
        self._unrouted(msg)

    def _authentic(self, hello: Hello) -> bool:
        """The Hello proves this spawn's secret and names our process (or its child)."""
        creds = self._credentials
        return creds is not None and secret_matches(creds.secret, hello.auth) and self._is_own(hello.pid)

    # ------------------------------------------------------------------ streams and calls

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
