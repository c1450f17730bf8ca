"""Operator routes: ``GET /admin/models``, ``POST /admin/models/load``, ``POST /admin/models/unload``,
``GET /admin/events`` (SSE: one ``snapshot`` event per model, then every model event as
it happens — ``router.events`` — until the client leaves or the router stops; a
``: keep-alive`` comment every 15 s of silence).

``load`` answers 200 once the worker is ready (with its load time, ms); ``unload``
drains — the running request finishes, waiting and new requests get 503 — then
stops the worker (Shutdown, grace period, kill) and answers 200.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.metrics import label_request
from router.params import get_str, read_json
from router.pool import Pool
from router.responses import JSONResponse
from router.sse import SSEResponse, sse_event, until_disconnect

#: Seconds of silence on /admin/events before a keep-alive comment.
KEEPALIVE_S = 15.0


def _pool(request: Request) -> Pool:
    pool: Pool = request.app.state.pool
    return pool


async def list_models(request: Request) -> Response:
    """Every configured model: state, pid, queue depth, in-flight ids, load time, last use, last error."""
    pool = _pool(request)
    return JSONResponse({"object": "list", "data": [s.describe() for s in pool.slots.values()]})


async def load(request: Request) -> Response:
    body = await read_json(request)
    slot = _pool(request).get(get_str(body, "model"))
    label_request(request, slot.model.name)
    t0 = time.monotonic()
    load_ms = await until_disconnect(request.receive, slot.load())
    return JSONResponse({"model": slot.model.name, "state": slot.state.value, "load_ms": load_ms,
                         "wait_ms": (time.monotonic() - t0) * 1000, "pid": slot.describe()["pid"]})


async def unload(request: Request) -> Response:
    body = await read_json(request)
    slot = _pool(request).get(get_str(body, "model"))
    label_request(request, slot.model.name)
    t0 = time.monotonic()
    await slot.unload()  # not cancelled by the client leaving: an unload, once asked, completes
    return JSONResponse({"model": slot.model.name, "state": slot.state.value,
                         "unload_ms": (time.monotonic() - t0) * 1000})


async def events(request: Request) -> Response:
    """Model events as SSE: ``event: <kind>`` and ``data: <json>``."""
    pool = _pool(request)
    q = pool.events.subscribe()

    def frame(ev: dict) -> bytes:  # type: ignore[type-arg]
        return f"event: {ev['event']}\n".encode() + sse_event(ev)

    async def gen() -> AsyncIterator[bytes]:
        for s in pool.slots.values():
            yield frame({"seq": 0, "at": time.time(), "model": s.model.name, "event": "snapshot",
                         "state": s.state.value, "condition": s.condition(), "pid": s.describe()["pid"]})
        while True:
            try:
                ev = await asyncio.wait_for(q.get(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if ev is None:
                return
            yield frame(ev)

    return SSEResponse(gen(), on_close=lambda: pool.events.unsubscribe(q))  # type: ignore[return-value]


routes = [
    Route("/admin/events", events, methods=["GET"]),
    Route("/admin/models", list_models, methods=["GET"]),
    Route("/admin/models/load", load, methods=["POST"]),
    Route("/admin/models/unload", unload, methods=["POST"]),
]
