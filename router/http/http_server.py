"""The HTTP transport: limits for slow or absent clients, and unambiguous request framing.

uvicorn's own settings are used where they exist (:func:`uvicorn_settings`):

* ``server.keep_alive_timeout_s`` -> ``timeout_keep_alive``: an idle keep-alive
  connection is closed;
* ``server.max_header_bytes`` -> ``h11_max_incomplete_event_size``: a larger
  request head is a 400 (h11) and the connection is closed.

Connection admission (``server.max_connections``) is not uvicorn's
``limit_concurrency``, which counts every open socket — so sockets that send
nothing (and reconnect whenever the head timeout closes them) starved every real
request, ``/health`` included, of a plain 503. Here two bounds apply instead:

* :class:`RequestAdmission` counts *requests in progress* (a whole head arrived,
  the answer not yet complete — a running stream included): one beyond
  ``max_connections`` gets a 503 ``too_many_requests_in_progress`` at once, with
  ``Retry-After`` and its dialect's error body, and ``Connection: close``;
* open sockets: when a new connection makes more than ``max_connections`` open,
  the connections that are waiting for a request head (fresh ones that sent
  nothing or only part of a head, idle keep-alive ones) are closed, the longest
  idle first (:meth:`GuardedH11Protocol.connection_made`). A socket that sends
  nothing never holds a place a request needs.

uvicorn has no timeout for a request head that never completes (a slowloris
client), so :class:`GuardedH11Protocol` adds ``server.header_timeout_s``: from
the moment a connection opens, or a response on it completes, its next request
head must arrive in full within that time, else the connection is closed.

A client that stops reading its answer (``server.stream_stall_timeout_s``) is
measured at the router's own send queue, not at the kernel's buffers (which take
megabytes from a reader that reads nothing: at ~250 bytes per token a stream never
filled them, and a slot stayed held for minutes). Each connection lets the kernel
hold at most :data:`KERNEL_UNSENT_BYTES` not yet sent (``TCP_NOTSENT_LOWAT``) and its
transport :data:`SEND_QUEUE_BYTES`; beyond the client's own TCP window, what it has
not taken stays in the router's send queue, and once that queue is full the SSE
writer waits (asyncio's ``pause_writing``) — it pulls nothing more of the
generation. From then on ``/slots`` shows that slot's ``reader_stalled_s``
(:data:`STALLED_READERS`); if the queue stays full for ``stream_stall_timeout_s``
the connection is aborted (one INFO line). The app then sees the client as gone
(``http.disconnect``), exactly as if it had left: the stream is cancelled on its
worker, its KV slot freed, and its access line says ``status=499 stalled=true``.
The body timeout (``server.body_timeout_s``) is applied where a body is read
(``router.http.params.read_json``: 408).

Framing: a request whose framing h11 refuses (a malformed request line or header,
a bad chunk of a chunked body) gets a 400 ``invalid_framing`` (JSON, ``Connection:
close``) unless its answer has already begun — then the connection is just closed
(:meth:`GuardedH11Protocol.send_400_response`). A ``Content-Length`` beyond the body
limit (``router.http.params.MAX_BODY_BYTES``) is a 413 ``request_too_large`` at once,
before a byte of the body is awaited (:class:`FramingGuard`). h11 accepts a request carrying both
``Transfer-Encoding`` and ``Content-Length`` and lets the chunked coding win.
RFC 9112 §6.3 says such a message "ought to be handled as an error" (it is how
request smuggling works) and the connection MUST be closed after responding; so
it is refused with 400 ``ambiguous_framing`` and ``Connection: close`` before
the app sees it — a request pipelined behind it never runs.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.config import ServerConfig
from router.http.errors import BadRequest, PayloadTooLarge, Unavailable, error_payload, error_response
from router.http.params import MAX_BODY_BYTES
from router.http.responses import JSONResponse, dumps

log = logging.getLogger("modelyard.http")

#: Bytes the kernel may hold of a connection's answer before they are sent (``TCP_NOTSENT_LOWAT``).
KERNEL_UNSENT_BYTES = 16 * 1024
#: The transport's write buffer (the router's send queue) above which the writer waits, bytes.
SEND_QUEUE_BYTES = 64 * 1024
#: ``TCP_NOTSENT_LOWAT`` (Linux 3.12+, macOS); absent from older Pythons' socket module.
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


class StalledReaders:
    """Generations whose client has not taken what was sent (its send queue is full):
    generation id (``Generate.id``, a slot's ``id_task``) -> since when (monotonic s)."""

    def __init__(self) -> None:
        self._since: dict[str, float] = {}

    def mark(self, ids: list[str], since: float | None) -> None:
        for i in ids:
            if since is None:
                self._since.pop(i, None)
            else:
                self._since.setdefault(i, since)

    def stalled_s(self, generation_id: str | None, now: float) -> float | None:
        """Seconds the client of ``generation_id`` has taken nothing, or None (it reads). A
        choice's sequence id (``<id>#<i>``, a worker's slot of ``n`` > 1) is its request's."""
        since = self._since.get(generation_id.split("#", 1)[0]) if generation_id else None
        return None if since is None else round(max(0.0, now - since), 3)


#: The one registry (one router per process; ids are unique).
STALLED_READERS = StalledReaders()


#: Seconds a connection answered before its request's body was read (a 413) keeps dropping what
#: the client still sends before it is closed (see ``GuardedH11Protocol._close_or_linger``).
LINGER_S = 2.0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a request-head timeout (``header_timeout_s``), idle-socket
    eviction beyond ``max_connections``, a bounded send queue with the stall timeout, and
    JSON 400s for invalid framing (see the module docstring)."""

    header_timeout_s: float = 10.0
    stream_stall_timeout_s: float = 30.0
    max_connections: int = 256

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._stalled_ids: list[str] = []
        self._idle_since = self.loop.time()
        self._linger_timer: asyncio.TimerHandle | None = None
        self._close_now = transport.close
        setattr(transport, "close", self._close_or_linger)  # every close of uvicorn's goes through it
        super().connection_made(transport)
        self._bound_send_queue(transport)
        self._arm_head_timer()
        self._evict_idle()

    @staticmethod
    def _bound_send_queue(transport: asyncio.Transport) -> None:
        transport.set_write_buffer_limits(high=SEND_QUEUE_BYTES)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, KERNEL_UNSENT_BYTES)
            except OSError:  # not supported here: the kernel's own buffers bound it, later
                pass

    def _evict_idle(self) -> None:
        """More than ``max_connections`` open: close those waiting for a request head, the
        longest idle first, until the count is back (never a connection with a request)."""
        # connections already closing still sit in the set until their connection_lost: counting
        # them made each new socket of a burst close ever more (300 at once closed 299, not 44)
        excess = sum(1 for p in self.connections if not p.transport.is_closing()) - self.max_connections
        if excess <= 0:
            return
        idle = sorted((p for p in self.connections if p is not self and isinstance(p, GuardedH11Protocol)
                       and not p.transport.is_closing() and p._waiting_for_head()),
                      key=lambda p: p._idle_since)
        for p in idle[:excess]:
            log.info("closing the idle connection of %s: %d connections open (max_connections=%d)",
                     "%s:%d" % p.client if p.client else "a client", len(self.connections), self.max_connections)
            p.transport.close()

    def _close_or_linger(self) -> None:
        """Close the connection; but while the client is still sending the request's body (an
        answer given before it was read: a 413 on its Content-Length), first send the answer and
        a FIN, and read and drop what the client still sends for up to :data:`LINGER_S` (or
        until it closes): closing with unread bytes resets the connection, and the client's
        kernel then drops the answer it had not yet read (nginx's lingering close)."""
        t = self.transport
        if self._linger_timer is not None:
            return  # already lingering: it ends by its timer or the client's close
        if self.conn.their_state is not h11.SEND_BODY or t.is_closing() or not t.can_write_eof():
            self._close_now()
            return
        t.write_eof()  # after the queued answer
        self._linger_timer = self.loop.call_later(LINGER_S, self._close_now)
        t.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            return  # the rest of a body already answered: dropped
        super().data_received(data)

    def eof_received(self) -> None:
        if self._linger_timer is not None:
            self._close_now()
            return
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self._disarm_head_timer()
        self._disarm_stall_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The client does not read: its answer may wait ``stream_stall_timeout_s`` for it."""
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.stream_stall_timeout_s, self._stalled)
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                access = cycle.scope.get("state", {}).get("access") or {}
                self._stalled_ids = list(access.get("generation_ids") or [])
                STALLED_READERS.mark(self._stalled_ids, self.loop.time())

    def resume_writing(self) -> None:
        self._disarm_stall_timer()
        super().resume_writing()

    def _disarm_stall_timer(self) -> None:
        timer = getattr(self, "_stall_timer", None)
        if timer is not None:
            timer.cancel()
            self._stall_timer = None
        ids = getattr(self, "_stalled_ids", None)
        if ids:
            STALLED_READERS.mark(ids, None)
            self._stalled_ids = []

    def _stalled(self) -> None:
        self._stall_timer = None
        if self.transport.is_closing():  # closed with its answer unsent: the client will not take it
            self.transport.abort()
            return
        cycle = self.cycle
        rid = cycle.scope.get("state", {}).get("request_id") if cycle is not None else None
        what = f"{cycle.scope.get('method')} {cycle.scope.get('path')}" if cycle is not None else "a response"
        peer = "%s:%d" % self.client if self.client else "a client"
        if cycle is not None:
            cycle.scope.setdefault("state", {})["stalled"] = True
        log.info("closing the connection of %s: it read nothing of %s (request %s) for "
                 "stream_stall_timeout_s=%g s", peer, what, rid or "-", self.stream_stall_timeout_s)
        STALLED_READERS.mark(self._stalled_ids, None)
        self._stalled_ids = []
        self.transport.abort()  # its unsent bytes are dropped; the app sees http.disconnect

    def send_400_response(self, msg: str) -> None:
        """An invalid request (h11 refused its framing: a bad request line or header, a bad
        chunk of a body): a JSON 400 ``invalid_framing`` and the connection closes. The app
        may already be answering that request: its answer is dropped from now on (it sees the
        client as gone), and if the answer has begun, a 400 cannot follow it on the wire, so
        the connection is just closed (one INFO line)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        began = cycle is not None and (cycle.response_started or cycle.response_complete)
        if began or self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            log.info("closing the connection of %s: invalid request data after its answer began (%s)",
                     "%s:%d" % self.client if self.client else "a client", msg)
            self.transport.close()
            return
        log.info("refused a request of %s: %s (invalid framing); closing the connection",
                 "%s:%d" % self.client if self.client else "a client", msg)
        body = dumps(error_payload(BadRequest(
            "invalid HTTP request: its request line, a header or its body framing (a chunk) is malformed "
            "(RFC 9112); the connection is closed", code="invalid_framing")))
        try:
            for event in (h11.Response(status_code=400, reason=b"Bad Request", headers=[
                              (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                              (b"connection", b"close")]),
                          h11.Data(data=body), h11.EndOfMessage()):
                out = self.conn.send(event)
                if out:
                    self.transport.write(out)
        except h11.LocalProtocolError:  # h11 cannot frame a response in this state: just close
            pass
        self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a whole request head arrived
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        if self._stalled_ids:  # the generation is over (its slot is free); the stall timer still runs
            STALLED_READERS.mark(self._stalled_ids, None)
            self._stalled_ids = []
        super().on_response_complete()
        if not self.transport.is_closing() and self._waiting_for_head():
            self._arm_head_timer()

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._waiting_for_head():
            return
        peer = "%s:%d" % self.client if self.client else "a client"
        log.info("closing the connection of %s: no complete request head within header_timeout_s=%g s",
                 peer, self.header_timeout_s)
        self.transport.close()


def protocol_class(server: ServerConfig) -> type[GuardedH11Protocol]:
    """:class:`GuardedH11Protocol` with ``server``'s head and stall timeouts and connection bound."""
    return type("RouterH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": server.header_timeout_s,
                                                             "stream_stall_timeout_s": server.stream_stall_timeout_s,
                                                             "max_connections": server.max_connections})


def uvicorn_settings(server: ServerConfig) -> dict[str, Any]:
    """The ``uvicorn.Config`` keyword arguments that bound slow or absent clients (no
    ``limit_concurrency``: :class:`RequestAdmission` and the idle eviction replace it)."""
    return {
        "http": protocol_class(server),
        "timeout_keep_alive": server.keep_alive_timeout_s,
        "h11_max_incomplete_event_size": server.max_header_bytes,
    }


class RequestAdmission:
    """At most ``server.max_connections`` requests in progress; one more gets a 503
    ``too_many_requests_in_progress`` at once (Retry-After, its dialect's error body,
    ``Connection: close``). Pure ASGI, outside everything but the access log."""

    def __init__(self, app: ASGIApp, server: ServerConfig) -> None:
        self.app = app
        self.max = server.max_connections
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_progress >= self.max:
            log.info("refused %s %s: %d requests in progress (max_connections=%d)", scope["method"],
                     scope["path"], self.in_progress, self.max)
            err = Unavailable(f"{self.in_progress} requests are in progress (server.max_connections="
                              f"{self.max}); retry shortly", code="too_many_requests_in_progress")
            resp = error_response(err, scope.get("path", ""))
            resp.headers["Connection"] = "close"
            await resp(scope, receive, send)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1


class FramingGuard:
    """Refuses a request with both Transfer-Encoding and Content-Length (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
            if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
                log.info("refused %s %s: Content-Length %s beyond %d bytes; closing the connection",
                         scope["method"], scope["path"], declared.decode()[:24], MAX_BODY_BYTES)
                resp = error_response(PayloadTooLarge(f"request body of {declared.decode()[:24]} bytes exceeds "
                                                      f"{MAX_BODY_BYTES} bytes", code="request_too_large"),
                                      scope.get("path", ""))
                resp.headers["Connection"] = "close"
                await resp(scope, receive, send)
                return
            names = {name for name, _ in scope.get("headers", [])}
            if b"transfer-encoding" in names and b"content-length" in names:
                log.info("refused %s %s: both Transfer-Encoding and Content-Length; closing the connection",
                         scope["method"], scope["path"])
                err = BadRequest("the request has both Transfer-Encoding and Content-Length (ambiguous "
                                 "framing, RFC 9112 section 6.3); the connection is closed",
                                 code="ambiguous_framing")
                await JSONResponse(error_payload(err), status_code=400,
                                   headers={"Connection": "close"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
