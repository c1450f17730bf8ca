"""Operator routes: ``GET /admin/models``, ``POST /admin/models/load``, ``POST /admin/models/unload``,
``GET /admin/events`` (SSE: one ``snapshot`` event per model, then every model event as
it happens — ``router.workers.events`` — until the client leaves or the router stops; a
``: keep-alive`` comment every 15 s of silence).

``load`` answers 200 once the worker is ready (with its load time, ms); ``unload``
drains — the running request finishes, waiting and new requests get 503 — then
stops the worker (Shutdown, grace period, kill) and answers 200.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from router import gguf_meta
from router.workers import discovery
from router.http.errors import BadRequest, redact_paths
from router.workers.events import HISTORY
from router.metrics import label_request
from router.http.params import get_str, read_json
from router.serving import models
from router.serving.models import OperatorPool
from router.http.responses import JSONResponse
from router.http.sse import SSEResponse, sse_event, until_disconnect
from router.http.routes import route_table

#: Seconds of silence on /admin/events before a keep-alive comment.
KEEPALIVE_S = 15.0


def _pool(request: Request) -> OperatorPool:
    pool: OperatorPool = request.app.state.pool
    return pool


async def list_models(request: Request) -> Response:
    """Every configured model: state, pid, queue depth, in-flight ids, load time, last use, last error,
    idle expiry (``expires_at``), and what its GGUF header says (``gguf``: ``router.gguf_meta.ModelInfo``);
    and the launcher's warm spare (``spare``: ``router.workers.launchers.Launcher.describe_spare``)."""
    pool = _pool(request)
    return JSONResponse({"object": "list", "data": await model_rows(pool),
                         "presets": preset_rows(pool), "invalid": discovered(request).invalid,
                         "spare": pool.launcher.describe_spare()})


def preset_rows(pool: OperatorPool) -> list[dict[str, Any]]:
    """Every ``[presets.NAME]``: its model and the defaults it sets (router.serving.presets)."""
    out = []
    for name, p in pool.config.presets.items():
        base = pool.config.models.get(p.name)
        out.append({"id": name, "model": p.name, "aliases": list(p.aliases),
                    "state": pool.slots[p.name].state.value if p.name in pool.slots else None,
                    "sampling": {k: v for k, v in p.sampling.items() if base is None or base.sampling.get(k) != v},
                    "n_predict": p.n_predict, "system_prompt": p.system_prompt})
    return out


def discovered(request: Request) -> discovery.Scan:
    """The last scan of models_dir (``router.workers.discovery``; empty when discovery is off)."""
    found: discovery.Scan = getattr(request.app.state, "discovery", None) or discovery.Scan()
    return found


async def rescan(request: Request) -> Response:
    """Scan models_dir again: new GGUF files are served, removed ones drain and go (as a
    SIGHUP does, without re-reading the config file). 400 when ``discover_models`` is off."""
    pool = _pool(request)
    if not pool.config.server.discover_models:
        raise BadRequest("models_dir is not scanned: set [server] discover_models = true", code="discovery_off")
    found = await asyncio.to_thread(discovery.scan, pool.config)
    request.app.state.discovery = found
    changes = pool.reload(discovery.apply(pool.config, found))
    return JSONResponse({**{k: v for k, v in changes.items() if k != "server_kept"}, **found.describe()})


async def model_rows(pool: OperatorPool) -> list[dict[str, Any]]:
    """``describe()`` of every model with its GGUF header facts (read in a thread: a large
    vocabulary takes a while the first time; cached after)."""
    slots = list(pool.slots.values())  # one snapshot: a config reload may change the pool meanwhile
    rows = [s.describe() for s in slots]
    paths = [s.model.path for s in slots]
    infos = await asyncio.to_thread(lambda: [gguf_meta.model_info(p).describe() for p in paths])
    for row, info, s in zip(rows, infos, slots):
        row["gguf"] = info
        row["source"] = "models_dir" if s.model.discovered else "config"
    return rows


async def load(request: Request) -> Response:
    body = await read_json(request)
    slot = _pool(request).get(get_str(body, "model"))
    label_request(request, slot.model.name)
    t0 = time.monotonic()
    load_ms = await until_disconnect(request.receive, models.load(slot))  # replicas = N: each one loads
    row = slot.describe()
    return JSONResponse({"model": slot.model.name, "state": row["state"], "load_ms": load_ms,
                         "wait_ms": (time.monotonic() - t0) * 1000, "pid": row["pid"],
                         **({"replicas": row["replicas"]} if "replicas" in row else {})})


async def unload(request: Request) -> Response:
    body = await read_json(request)
    slot = _pool(request).get(get_str(body, "model"))
    label_request(request, slot.model.name)
    t0 = time.monotonic()
    # replicas = N: each one unloads; not cancelled by the client leaving: an unload, once asked, completes
    await models.unload(slot)
    return JSONResponse({"model": slot.model.name, "state": slot.describe()["state"],
                         "unload_ms": (time.monotonic() - t0) * 1000})


async def events(request: Request) -> Response:
    """Model events as SSE: ``event: <kind>`` and ``data: <json>``. Query: ``recent=N`` replays
    the last N events (at most ``events.HISTORY``) after the snapshot; ``follow=false`` ends
    the stream there instead of following."""
    pool = _pool(request)
    request.state.open_ended = True  # the client ends it: not a 499 in the access log
    recent = _query_int(request, "recent", 0, 0, HISTORY)
    follow = request.query_params.get("follow", "true").lower() not in ("0", "false", "no")
    q = pool.events.subscribe()
    past = pool.events.recent(recent)
    seq = pool.events.seq

    redact = not request.url.path.startswith("/admin")  # the status page's copy: files by name only

    def frame(ev: dict) -> bytes:  # type: ignore[type-arg]
        if redact:
            ev = redacted(ev)
        return f"event: {ev['event']}\n".encode() + sse_event(ev)

    async def gen() -> AsyncIterator[bytes]:
        for s in pool.slots.values():  # seq: the last event before it (the state as of that event)
            yield frame({"seq": seq, "at": time.time(), "model": s.model.name, "event": "snapshot",
                         "state": s.state.value, "condition": s.condition(), "pid": s.describe()["pid"]})
        for ev in past:
            yield frame(ev)
        if not follow:
            return
        while True:
            try:
                nxt = await asyncio.wait_for(q.get(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if nxt is None:
                return
            yield frame(nxt)

    return SSEResponse(gen(), on_close=lambda: pool.events.unsubscribe(q))  # type: ignore[return-value]


def redacted(obj: Any) -> Any:
    """``obj`` (JSON-like) with every absolute path in its strings cut to its last component:
    what a client that is not the operator sees (``/ui/api/*``; ``/admin`` keeps the full text)."""
    if isinstance(obj, str):
        return redact_paths(obj)
    if isinstance(obj, dict):
        return {k: redacted(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redacted(v) for v in obj]
    return obj


def _query_int(request: Request, key: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(key)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise BadRequest(f"{key} must be an integer, got {raw!r}", param=key) from None
    if not lo <= v <= hi:
        raise BadRequest(f"{key} must be {lo}..{hi}, got {v}", param=key)
    return v


routes = route_table({
    "GET /admin/events": events, "GET /admin/models": list_models, "POST /admin/models/load": load,
    "POST /admin/models/unload": unload, "POST /admin/models/rescan": rescan
})
