"""Resumable streams, as llama-server serves them (``tools/server/server-stream.cpp``).

A streaming request that carries ``X-Conversation-Id: <id>`` gets a *session*: every byte
of its SSE answer is kept in a buffer of at most :data:`SESSION_MAX_BYTES` (the oldest
bytes are dropped beyond it), and the generation no longer depends on its connection —
a client that goes away (a reload, a lost network) leaves it running to its end, and
``GET /v1/stream?conv_id=<id>&from=<offset>`` replays the answer from byte ``offset`` and
follows it live until it ends. ``POST /v1/streams/lookup`` (``{"conversation_ids": [...]}``)
says which sessions exist (``conversation_id``, ``is_done``, ``total_bytes``, ``started_at``,
``completed_at``; an id also matches its ``<id>::<suffix>`` variants), and
``DELETE /v1/stream?conv_id=<id>`` is the explicit stop: the generation is cancelled and
the session forgotten (204, also when there was none). One conversation has at most one
session: a new request with the same id replaces (and cancels) the previous one. A
finished session is forgotten :data:`SESSION_TTL_S` after it ended; at most
:data:`MAX_SESSIONS` are kept (a new one beyond that first forgets the oldest finished
ones; when every kept one is still running, the new stream is served without a session,
as a plain stream, and says so in the log).

Errors (llama-server's): no ``conv_id`` is a 400, an unknown or expired one a 404
(``Stream not found or expired``), an offset that is not a number or whose bytes were
dropped from the buffer a 400 (``Stream offset lost, please restart``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.http.errors import BadRequest, NotFound
from router.http.params import read_json
from router.http.responses import JSONResponse
from router.http.routes import route_table

log = logging.getLogger("modelyard.streams")

#: The request header naming the conversation a stream belongs to (llama-server's).
HEADER = b"x-conversation-id"
#: A finished session is forgotten this long after it ended, s (llama-server: 300).
SESSION_TTL_S = 300.0
#: Bytes of one stream kept for replay (llama-server: 4 MiB); older bytes are dropped.
SESSION_MAX_BYTES = 4 * 1024 * 1024
#: Sessions kept at once (running or finished).
MAX_SESSIONS = 256


class OffsetLost(Exception):
    """The bytes from the asked offset were dropped from the buffer."""


class StreamSession:
    """One stream's bytes (the last :data:`SESSION_MAX_BYTES` of them) and its producer."""

    def __init__(self, conversation_id: str, max_bytes: int = SESSION_MAX_BYTES) -> None:
        self.conversation_id = conversation_id
        self.started_at = int(time.time())
        self.completed_at = 0  # unix s once done
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self.dropped = 0  # bytes dropped from the front
        self.done = False
        self._changed = asyncio.Event()
        self._producer: asyncio.Task[None] | None = None

    @property
    def total_bytes(self) -> int:
        """Every byte that entered the session."""
        return self.dropped + len(self._buf)

    def append(self, data: bytes) -> None:
        if self.done or not data:
            return
        self._buf += data
        over = len(self._buf) - self.max_bytes
        if over > 0:
            del self._buf[:over]
            self.dropped += over
        self._wake()

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.completed_at = int(time.time())
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def start(self, produce: Awaitable[None]) -> None:
        self._producer = asyncio.ensure_future(produce)

    def cancel(self) -> None:
        """Stop the generation (its producer) and end the session."""
        if self._producer is not None and not self._producer.done():
            self._producer.cancel()
        self.finish()

    async def read_from(self, offset: int) -> AsyncIterator[bytes]:
        """The bytes from ``offset`` on, as they come, until the session ends. Raises OffsetLost."""
        while True:
            if offset < self.dropped:
                raise OffsetLost
            end = self.total_bytes
            if offset < end:
                chunk = bytes(self._buf[offset - self.dropped:])
                offset = end
                yield chunk
                continue
            if self.done:
                return
            await self._changed.wait()

    def describe(self) -> dict[str, Any]:
        return {"conversation_id": self.conversation_id, "is_done": self.done, "total_bytes": self.total_bytes,
                "started_at": self.started_at, "completed_at": self.completed_at}


class StreamSessions:
    """The router's sessions by conversation id (one app, one store: ``app.state.streams``)."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._by_id: dict[str, StreamSession] = {}

    def _expire(self) -> None:
        cutoff = time.time() - self.ttl_s
        for cid, s in list(self._by_id.items()):
            if s.done and s.completed_at <= cutoff:
                del self._by_id[cid]

    def create(self, conversation_id: str) -> StreamSession | None:
        """A new session for ``conversation_id``, replacing (and cancelling) a previous one; None
        when :data:`MAX_SESSIONS` are all still running."""
        self._expire()
        previous = self._by_id.pop(conversation_id, None)
        if previous is not None:
            previous.cancel()
        while len(self._by_id) >= self.max_sessions:
            oldest = min((s for s in self._by_id.values() if s.done), key=lambda s: s.completed_at, default=None)
            if oldest is None:
                log.warning("stream for conversation %r is not resumable: %d streams are running", conversation_id,
                            len(self._by_id))
                return None
            del self._by_id[oldest.conversation_id]
        session = StreamSession(conversation_id)
        self._by_id[conversation_id] = session
        return session

    def get(self, conversation_id: str) -> StreamSession | None:
        self._expire()
        return self._by_id.get(conversation_id)

    def lookup(self, ids: list[str]) -> list[StreamSession]:
        self._expire()
        out: list[StreamSession] = []
        for rid in ids:
            out += [s for cid, s in self._by_id.items() if cid == rid or cid.startswith(rid + "::")]
        return out

    def delete(self, conversation_id: str) -> None:
        s = self._by_id.pop(conversation_id, None)
        if s is not None:
            s.cancel()

    def close(self) -> None:
        """The router stops: every running stream is cancelled."""
        for s in self._by_id.values():
            s.cancel()
        self._by_id.clear()


def conversation_id(scope: Scope) -> str:
    """The request's ``X-Conversation-Id`` ("" when absent)."""
    for name, value in scope.get("headers", []):
        if name == HEADER:
            text: str = value.decode("latin-1")
            return text.strip()
    return ""


def store_of(scope: Scope) -> StreamSessions | None:
    app = scope.get("app")
    state = getattr(app, "state", None)
    return getattr(state, "streams", None)


async def serve(session: StreamSession, offset: int, receive: Receive, send: Send,
                headers: list[tuple[bytes, bytes]]) -> None:
    """Send ``session``'s bytes from ``offset`` as a 200 stream until it ends or the client goes
    (which leaves the session and its generation running)."""
    from router.http.sse import wait_disconnect  # router.http.sse imports this module

    async def pump() -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        with contextlib.suppress(OffsetLost):  # checked before the 200; a reader never falls behind
            async for chunk in session.read_from(offset):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    task = asyncio.ensure_future(pump())
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await task


def produce(session: StreamSession, events: AsyncIterator[bytes], close: Callable[[], Awaitable[None]]) -> None:
    """Run ``events`` into ``session`` to its end whatever its readers do; ``close()`` once after."""

    async def run() -> None:
        try:
            async for chunk in events:
                session.append(chunk)
        finally:
            try:
                await close()
            finally:
                session.finish()

    session.start(run())


SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class _Replay:
    def __init__(self, session: StreamSession, offset: int) -> None:
        self.session = session
        self.offset = offset

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve(self.session, self.offset, receive, send, SSE_HEADERS)


def _store(request: Request) -> StreamSessions:
    store: StreamSessions = request.app.state.streams
    return store


def _conv_id(request: Request) -> str:
    cid = request.query_params.get("conv_id", "").strip()
    if not cid:
        raise BadRequest("Missing conversation id: give ?conv_id=<X-Conversation-Id of the stream>", param="conv_id")
    return cid


async def get_stream(request: Request) -> Any:
    """Replay a resumable stream from byte ``from`` (default 0) and follow it to its end."""
    cid = _conv_id(request)
    session = _store(request).get(cid)
    if session is None:
        raise NotFound("Stream not found or expired", code="not_found", param="conv_id")
    raw = request.query_params.get("from", "0").strip() or "0"
    if not raw.isdigit():
        raise BadRequest("Invalid 'from' offset", param="from")
    offset = int(raw)
    if offset < session.dropped:
        raise BadRequest("Stream offset lost, please restart", param="from", code="stream_offset_lost")
    return _Replay(session, offset)


async def lookup(request: Request) -> Response:
    """The resumable streams of the given conversation ids."""
    body = await read_json(request)
    ids = body.get("conversation_ids", [])
    if not isinstance(ids, list):
        raise BadRequest("'conversation_ids' must be an array of strings", param="conversation_ids")
    wanted = [i for i in ids if isinstance(i, str) and i]
    return JSONResponse([s.describe() for s in _store(request).lookup(wanted)])


async def delete_stream(request: Request) -> Response:
    """Stop a resumable stream: its generation is cancelled and its bytes forgotten."""
    _store(request).delete(_conv_id(request))
    return Response(status_code=204)


routes = route_table({
    "GET /v1/stream": get_stream, "DELETE /v1/stream": delete_stream, "POST /v1/streams/lookup": lookup
})
