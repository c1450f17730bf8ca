"""The status page: ``GET /ui`` (static files shipped in the package, ``router/ui/``; no build
step, nothing fetched from elsewhere) and the data it reads.

* ``GET /ui`` — the page (``index.html``); ``GET /ui/static/{app.js,style.css}`` — its script and
  style. These hold no data and need no key (a browser cannot send one when it navigates); they
  are served under a Content-Security-Policy that lets the page talk to this router only.
* ``GET /ui/api/status`` (api key when one is set) — one JSON snapshot: ``models`` (as
  ``/admin/models``, files by their name only, plus ``gguf``), ``requests`` (the last
  ``router.http.access_log.RECENT`` access-log records, the page's own polling left out), ``history``
  (:class:`MetricsHistory`: per model, tokens/s, mean TTFT and queue depth every
  :data:`SAMPLE_S` s over the last :data:`HISTORY_S` s, from the router's own metrics),
  ``server`` (version, whether the api / admin keys are set).
* ``GET /ui/api/events`` (api key) — ``/admin/events`` for the page (same stream and query).

Load and unload buttons call ``POST /admin/models/load`` / ``unload`` with the admin key (the api
key when no admin key is set) — ``router.http.auth`` decides. Host and Origin rules
(``router.http.security``) apply to every one of these routes as to the API.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response

from router.operator import admin
from router.http.access_log import recent_requests
from router.cli_args import version
from router.http.errors import NotFound
from router.http.responses import JSONResponse
from router.http.routes import route_table

UI_DIR = Path(__file__).resolve().parent / "ui"
#: The page's files and their media types (nothing else is served from UI_DIR).
STATIC = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
#: Seconds between two samples of the plots, and how far back they go.
SAMPLE_S = 2.0
HISTORY_S = 600.0

_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
}


@dataclass
class MetricsHistory:
    """Per-model series sampled from the router's metrics registry every :data:`SAMPLE_S` s:
    ``tok_s`` (tokens streamed per second over the interval: the first tokens, counted by the
    TTFT histogram, plus the others, counted by the inter-token-latency histogram — as they
    come, where ``modelyard_generation_tokens`` counts a whole answer at its end), ``ttft_ms``
    (mean time to first token of the requests whose first token came in the interval; None
    without one) and ``queue`` (requests waiting, at the sample). ``t`` holds unix times."""

    maxlen: int = int(HISTORY_S / SAMPLE_S)
    t: collections.deque[float] = field(default_factory=collections.deque)
    series: dict[str, dict[str, collections.deque[float | None]]] = field(default_factory=dict)
    _last: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # model -> tokens, ttft sum, count
    _last_t: float | None = None

    def sample(self, registry: Any, queues: dict[str, int], now: float | None = None) -> None:
        now = time.time() if now is None else now
        tokens: dict[str, float] = {}
        ttft_sum: dict[str, float] = {}
        ttft_n: dict[str, float] = {}
        for fam in registry.collect():
            for s in fam.samples:
                m = s.labels.get("model")
                if m is None:
                    continue
                if s.name == "modelyard_inter_token_latency_seconds_count":
                    tokens[m] = tokens.get(m, 0.0) + s.value
                elif s.name == "modelyard_time_to_first_token_seconds_sum":
                    ttft_sum[m] = s.value
                elif s.name == "modelyard_time_to_first_token_seconds_count":
                    ttft_n[m] = s.value
                    tokens[m] = tokens.get(m, 0.0) + s.value  # each first token
        dt = now - self._last_t if self._last_t is not None else None
        self.t.append(now)
        for m in sorted(set(queues) | set(self.series)):
            cur = (tokens.get(m, 0.0), ttft_sum.get(m, 0.0), ttft_n.get(m, 0.0))
            prev = self._last.get(m)
            s = self.series.setdefault(m, {"tok_s": collections.deque(), "ttft_ms": collections.deque(),
                                           "queue": collections.deque()})
            while len(s["tok_s"]) < len(self.t) - 1:  # a model added later: empty past
                for d in s.values():
                    d.appendleft(None)
            tok_s = ttft = None
            if prev is not None and dt:
                tok_s = max(0.0, cur[0] - prev[0]) / dt
                n = cur[2] - prev[2]
                ttft = (cur[1] - prev[1]) / n * 1000 if n > 0 else None
            s["tok_s"].append(tok_s)
            s["ttft_ms"].append(ttft)
            s["queue"].append(float(queues[m]) if m in queues else None)
            self._last[m] = cur
        self._last_t = now
        while len(self.t) > self.maxlen:
            self.t.popleft()
            for s in self.series.values():
                for d in s.values():
                    if d:
                        d.popleft()

    def describe(self) -> dict[str, Any]:
        return {"interval_s": SAMPLE_S, "t": list(self.t),
                "models": {m: {k: list(v) for k, v in s.items()} for m, s in self.series.items()}}


async def sample_forever(app: Any) -> None:
    """The lifespan's sampler task (cancelled at shutdown)."""
    hist = history(app.state)
    while True:
        pool = getattr(app.state, "pool", None)
        if pool is not None:
            hist.sample(app.state.metrics.registry, {n: s.queue_depth for n, s in pool.slots.items()})
        await asyncio.sleep(SAMPLE_S)


def history(state: Any) -> MetricsHistory:
    h = getattr(state, "metrics_history", None)
    if h is None:
        h = MetricsHistory()
        state.metrics_history = h
    return h


async def page(request: Request) -> Response:
    return FileResponse(UI_DIR / "index.html", media_type="text/html; charset=utf-8", headers=_HEADERS)


async def static(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in STATIC:
        raise NotFound(f"no file {name!r} in the status page", code="not_found")
    return FileResponse(UI_DIR / name, media_type=STATIC[name], headers=_HEADERS)


async def redirect(request: Request) -> Response:
    return RedirectResponse("/ui", status_code=307)


def _for_page(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row)
    row["file"] = Path(row.pop("path", "") or "").name  # clients learn file names, never paths
    page: dict[str, Any] = admin.redacted(row)  # last_error, failure reasons: files by name only
    return page


async def status(request: Request) -> Response:
    pool = request.app.state.pool
    srv = request.app.state.config.server
    rows = [_for_page(r) for r in await admin.model_rows(pool)]
    return JSONResponse({
        "now": time.time(),
        "server": {"version": version(), "api_key_required": bool(srv.api_key),
                   "admin_key_required": bool(srv.admin_key)},
        "models": rows,
        "spare": admin.redacted(pool.launcher.describe_spare()),
        "invalid": admin.discovered(request).invalid,
        "presets": admin.preset_rows(pool),
        "requests": list(recent_requests(request.app.state))[::-1],
        "history": history(request.app.state).describe(),
    }, headers={"Cache-Control": "no-store"})


async def events(request: Request) -> Response:
    return await admin.events(request)


routes = route_table({
    "GET /ui": page, "GET /ui/": redirect, "GET /ui/static/{name}": static, "GET /ui/api/status": status,
    "GET /ui/api/events": events
})
