"""Server-sent events and client-disconnect watching.

* :func:`until_disconnect` runs a coroutine while listening for the ASGI
  ``http.disconnect`` message; if the client leaves first the coroutine is
  cancelled and :class:`ClientDisconnected` raised. Used while a request waits
  in the queue, during prefill, and for whole non-streaming generations.
* :class:`SSEResponse` sends ``data: <json>\\n\\n`` events (no ``id:`` or
  ``retry:`` fields) from an async iterator, and stops — closing the iterator,
  whose ``finally`` cancels the generation — as soon as the client disconnects;
  with ``X-Conversation-Id`` the stream is resumable instead (``router.http.stream_sessions``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from router.http.errors import ApiError
from router.http.responses import dumps

T = TypeVar("T")


class ClientDisconnected(ApiError, status=499, type="invalid_request_error", code="client_disconnected"):
    """The client closed the connection; nobody will read the answer (nginx's 499)."""


async def wait_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (call only after the body is read)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, aw: Awaitable[T]) -> T:
    """Await ``aw``; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected("client disconnected")


def sse_event(obj: Any) -> bytes:
    """One ``data:`` event carrying ``obj`` as compact JSON (or a literal such as ``[DONE]``)."""
    data = obj.encode() if isinstance(obj, str) else dumps(obj)
    return b"data: " + data + b"\n\n"


def sse_named(event: str, obj: Any) -> bytes:
    """One ``event: <name>`` + ``data:`` event (Anthropic's and the Responses API's framing)."""
    return b"event: " + event.encode() + b"\n" + sse_event(obj)


class SSEResponse:
    """A ``text/event-stream`` ASGI response fed by ``events`` (already-encoded bytes).

    ``on_close()`` (synchronous) is called exactly once when the stream ends for any
    reason: finished, client gone, server shutting down. ``content_type``: the stream's
    media type (a subclass streams another framing the same way: Ollama's NDJSON).
    """

    content_type: bytes = b"text/event-stream; charset=utf-8"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.on_close = on_close
        self.headers = headers or {}
        self._gone = False  # the client has left: the pump stops

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [
            (b"content-type", self.content_type),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()),
        ]
        self._gone = False
        if self.content_type.startswith(b"text/event-stream") and await self._resumable(scope, receive, send,
                                                                                         headers):
            return
        pump = asyncio.ensure_future(self._pump(send, headers))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not pump.done():
                # the client left: the pump stops at its next event even if an iterator below it
                # swallowed the cancellation (Python 3.11's asyncio.wait_for can, when the awaited
                # frame is ready at the same moment — a stream that never waits would then be
                # pumped to its end into a closed connection, holding its KV slot)
                self._gone = True
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await pump
            else:
                with contextlib.suppress(OSError):
                    pump.result()
        finally:
            watcher.cancel()
            if not pump.done():
                pump.cancel()
            try:
                await self._aclose()
            finally:
                self.on_close()

    async def _resumable(self, scope: Scope, receive: Receive, send: Send,
                         headers: list[tuple[bytes, bytes]]) -> bool:
        """With ``X-Conversation-Id`` (llama-server's resumable streams, ``router.http.stream_sessions``):
        the events run into the conversation's session to their end whatever this connection
        does, and this response reads them from there. False: no session (a plain stream)."""
        from router.http import stream_sessions  # it imports router.http.params, which imports this module

        cid = stream_sessions.conversation_id(scope)
        store = stream_sessions.store_of(scope) if cid else None
        session = store.create(cid) if store is not None else None
        if session is None:
            return False

        async def close() -> None:
            try:
                await self._aclose()
            finally:
                self.on_close()

        stream_sessions.produce(session, self.events, close)
        await stream_sessions.serve(session, 0, receive, send, headers)
        return True

    async def _aclose(self) -> None:
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await aclose()

    async def _pump(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for chunk in self.events:
            if self._gone:
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
