"""The Starlette application: routes, the one error mapping, and the worker pool's lifetime.

``create_app(config)`` builds it; the pool is created at startup (lifespan) and
closed at shutdown, which stops every worker. Each app has its own metrics
registry (``router.metrics``), served at ``GET /metrics``. Errors: an :class:`ApiError`
anywhere becomes its OpenAI-shaped body and status; an unknown route or method
too; anything else is a true bug and becomes a 500 with the same shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psutil
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from router.operator import status_page
from router.operator import admin
from router.dialects import anthropic_api, decode_api, llamacpp_api, llamacpp_router, openai_api, openai_responses, openapi
from router.dialects import ollama_api
from router.dialects.background import BackgroundStore
from router.http import stream_sessions
from router.http.stream_sessions import StreamSessions
from router.http.access_log import AccessLog
from router.http.auth import BearerAuth
from router.cli_args import version
from router.config import Config
from router.http.errors import ApiError, InternalError, MethodNotAllowed, NotFound, error_response
from router.metrics import CONTENT_TYPE, Metrics, RequestMetrics
from router.http.http_server import FramingGuard, RequestAdmission
from router.workers.pool import Pool
from router.serving.presets import PresetSlot
from router.dialects.response_store import ResponseStore
from router.http.responses import JSONResponse
from router.http.security import BrowserGuard
from router.http.set_aside import SetAsideHeader

log = logging.getLogger("modelyard.app")


#: When this router process started, unix seconds (/metrics' ``Process-Start-Time-Unix``).
PROCESS_START_UNIX = int(psutil.Process().create_time())

#: How long /metrics waits for each ready worker's Pong (KV figures), s.
METRICS_PROBE_TIMEOUT_S = 1.0


async def health(request: Request) -> Response:
    """Liveness of the router itself (never loads a model, never needs a key): ``status``,
    each model's state (``models``) and weights mode (``weights``, from the config); with
    ``?model=NAME``, that model's readiness, as llama.cpp's router (key required)."""
    name = request.query_params.get("model")
    if name is not None:
        return await llamacpp_router.model_health(request, name)
    pool: Pool = request.app.state.pool
    return JSONResponse({"status": "ok", "models": {n: s.state.value for n, s in pool.slots.items()},
                         "weights": {n: s.model.weights_mode for n, s in pool.slots.items()}})


async def root(request: Request) -> Response:
    """``GET /`` and ``HEAD /`` (also ``/api/hello``): the service answers (harnesses'
    connectivity checks — Claude Code 2.1 sends ``HEAD /api/hello`` before its first request).
    Never loads a model; behind the api key when one is set. A browser's ``GET /`` (Accept:
    text/html) goes to the status page."""
    if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
        return RedirectResponse("/ui", status_code=307)  # a browser: the status page (router.operator.status_page)
    pool: Pool = request.app.state.pool
    return JSONResponse({"status": "ok", "service": "modelyard", "version": version(),
                         "models": list(pool.slots)})


async def metrics(request: Request) -> Response:
    """Prometheus text exposition; ready workers are pinged first so KV figures are fresh."""
    pool: Pool = request.app.state.pool
    await asyncio.gather(*(s.probe(METRICS_PROBE_TIMEOUT_S) for s in pool.slots.values()))
    m: Metrics = request.app.state.metrics
    # llama-server's header: when this process started (unix s); a scraper sees a restart by it
    return Response(m.render(), media_type=CONTENT_TYPE,
                    headers={"Process-Start-Time-Unix": str(PROCESS_START_UNIX)})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if exc.status == 503:  # refused before it ran: a rejection, by its code
        m: Metrics = request.app.state.metrics
        m.rejections.labels(getattr(request.state, "model", ""), exc.code or "unavailable").inc()
    return error_response(exc, request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(NotFound(f"no route {request.method} {request.url.path}", code="not_found"),
                              request.url.path)
    if exc.status_code == 405:
        resp = error_response(MethodNotAllowed(f"method {request.method} not allowed on {request.url.path}"),
                              request.url.path)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp
    err = ApiError(str(exc.detail), code=None)
    err.status = exc.status_code  # type: ignore[misc]
    return error_response(err, request.url.path)


async def _bug(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(InternalError(f"internal error: {type(exc).__name__}"), request.url.path)


def create_app(config: Config, *, worker_module: str | None = None,
               pool_options: dict[str, Any] | None = None) -> Starlette:
    """The router app for ``config``. ``worker_module`` overrides ``python -m worker``
    (also settable with the MODELYARD_WORKER_MODULE environment variable);
    ``pool_options`` go to :class:`Pool` (tests inject a clock and memory figures)."""

    registry = Metrics(config.models)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.pool = Pool(config, worker_module=worker_module, metrics=registry,
                              preset_view=PresetSlot,  # type: ignore[arg-type]  # a slot's view, duck-typed
                              **(pool_options or {}))
        lag_probe = asyncio.get_running_loop().create_task(registry.watch_event_loop(), name="loop-lag")
        sampler = asyncio.get_running_loop().create_task(status_page.sample_forever(app), name="ui-sampler")
        try:
            yield
        finally:
            lag_probe.cancel()
            sampler.cancel()
            app.state.streams.close()  # resumable streams' generations are cancelled
            await app.state.background.close()  # its runs end (Cancel) before the workers stop
            await app.state.pool.close()

    routes: list[BaseRoute] = [Route("/", root, methods=["GET", "HEAD"]), Route("/api/hello", root, methods=["GET", "HEAD"]),
              Route("/health", health, methods=["GET"]), Route("/v1/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              *openai_api.routes, *openai_responses.routes, *decode_api.routes, *anthropic_api.routes, *llamacpp_api.routes, *llamacpp_router.routes, *ollama_api.routes, *stream_sessions.routes, *admin.routes,
              *openapi.routes, *status_page.routes]
    app = Starlette(
        routes=routes,
        # outermost first: the access log and X-Request-Id, admission (requests in progress), what was set
        # aside (router.http.set_aside), request framing, metrics, then browser-origin rules (and CORS preflights), then keys
        middleware=[Middleware(AccessLog, routes=routes), Middleware(RequestAdmission, server=config.server),
                    Middleware(SetAsideHeader), Middleware(FramingGuard),
                    Middleware(RequestMetrics, metrics=registry, routes=routes),
                    Middleware(BrowserGuard, server=config.server),
                    Middleware(BearerAuth, server=config.server)],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _bug},
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.responses = ResponseStore(config.server.responses_store_max, config.server.responses_store_ttl_s)
    srv = config.server
    app.state.background = BackgroundStore(srv.background_max, srv.background_ttl_s,
                                           int(srv.background_max_mib * 2**20),
                                           per_key=srv.background_per_key, unread_s=srv.background_unread_s)
    app.state.metrics = registry
    app.state.streams = StreamSessions()
    return app
