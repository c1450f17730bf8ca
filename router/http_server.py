"""The HTTP transport: limits for slow or absent clients, and unambiguous request framing.

uvicorn's own settings are used where they exist (:func:`uvicorn_settings`):

* ``server.keep_alive_timeout_s`` -> ``timeout_keep_alive``: an idle keep-alive
  connection is closed;
* ``server.max_connections`` -> ``limit_concurrency`` (+1: uvicorn counts the
  connection asking): a request on a connection beyond that many open ones (or
  beyond that many requests in progress) gets uvicorn's 503 at once (plain text,
  ``Connection: close``);
* ``server.max_header_bytes`` -> ``h11_max_incomplete_event_size``: a larger
  request head is a 400 (h11) and the connection is closed.

uvicorn has no timeout for a request head that never completes (a slowloris
client), so :class:`GuardedH11Protocol` adds ``server.header_timeout_s``: from
the moment a connection opens, or a response on it completes, its next request
head must arrive in full within that time, else the connection is closed. A
client that stops reading its answer (``server.stream_stall_timeout_s``): when the
connection's write buffer is full (asyncio's ``pause_writing``) and stays full that
long, the connection is aborted (one INFO line). The app then sees the client as
gone (``http.disconnect``), exactly as if it had left: a stream is cancelled on its
worker and its job slot freed. The body timeout (``server.body_timeout_s``) is applied where a body is read
(``router.params.read_json``: 408).

Framing (:class:`FramingGuard`): h11 accepts a request carrying both
``Transfer-Encoding`` and ``Content-Length`` and lets the chunked coding win.
RFC 9112 §6.3 says such a message "ought to be handled as an error" (it is how
request smuggling works) and the connection MUST be closed after responding; so
it is refused with 400 ``ambiguous_framing`` and ``Connection: close`` before
the app sees it — a request pipelined behind it never runs.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.config import ServerConfig
from router.errors import BadRequest, error_payload
from router.responses import JSONResponse

log = logging.getLogger("modelyard.http")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a request-head timeout (``header_timeout_s``)."""

    header_timeout_s: float = 10.0
    stream_stall_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_stall_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The client does not read: its answer may wait ``stream_stall_timeout_s`` for it."""
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.stream_stall_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        self._disarm_stall_timer()
        super().resume_writing()

    def _disarm_stall_timer(self) -> None:
        timer = getattr(self, "_stall_timer", None)
        if timer is not None:
            timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        self._stall_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        rid = cycle.scope.get("state", {}).get("request_id") if cycle is not None else None
        what = f"{cycle.scope.get('method')} {cycle.scope.get('path')}" if cycle is not None else "a response"
        peer = "%s:%d" % self.client if self.client else "a client"
        if cycle is not None:
            cycle.scope.setdefault("state", {})["stalled"] = True
        log.info("closing the connection of %s: it read nothing of %s (request %s) for "
                 "stream_stall_timeout_s=%g s", peer, what, rid or "-", self.stream_stall_timeout_s)
        self.transport.abort()  # its unsent bytes are dropped; the app sees http.disconnect

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 for an invalid request (e.g. a bad chunk of a body) — but the app may
        already be answering that request: its answer is dropped from now on (it sees the
        client as gone), and if the answer has begun, a 400 cannot follow it on the wire, so
        the connection is just closed (uvicorn would raise inside ``data_received`` and
        asyncio log a traceback; the app's next send would raise a second one)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        if self.conn.our_state is not h11.IDLE:  # an answer to this request has begun (or ended)
            log.info("closing the connection of %s: invalid request data after its answer began (%s)",
                     "%s:%d" % self.client if self.client else "a client", msg)
            self.transport.close()
            return
        super().send_400_response(msg)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a whole request head arrived
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
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
    """:class:`GuardedH11Protocol` with ``server``'s head and stall timeouts."""
    return type("RouterH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": server.header_timeout_s,
                                                             "stream_stall_timeout_s": server.stream_stall_timeout_s})


def uvicorn_settings(server: ServerConfig) -> dict[str, Any]:
    """The ``uvicorn.Config`` keyword arguments that bound slow or absent clients."""
    return {
        "http": protocol_class(server),
        "timeout_keep_alive": server.keep_alive_timeout_s,
        "limit_concurrency": server.max_connections + 1,
        "h11_max_incomplete_event_size": server.max_header_bytes,
    }


class FramingGuard:
    """Refuses a request with both Transfer-Encoding and Content-Length (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
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
