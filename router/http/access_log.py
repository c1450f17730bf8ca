"""One structured access-log line per HTTP request, and its ``X-Request-Id``.

:class:`AccessLog` is the outermost middleware. It takes the request's
``X-Request-Id`` when it is a sane token (1..128 of ``A-Z a-z 0-9 . _ : / + = -``),
else makes one (``req-`` + 24 hex digits); the id is returned in the response's
``X-Request-Id`` header, kept in ``request.state.request_id`` (the generation
routes pass it to the worker as ``Generate.trace_id``, which the worker logs), and
written in the line. When the answer has been sent (or the client has gone) it logs,
on the ``modelyard.access`` logger at INFO, ``key=value`` pairs::

    request_id=req-... method=POST route=/v1/chat/completions model=SmolLM2-135M-Instruct
    status=200 prompt_tokens=31 cached_tokens=0 completion_tokens=12 ttft_ms=48.1
    duration_ms=212.9 disconnected=false stalled=false client=127.0.0.1

``model`` is the configured name a handler resolved (``-`` if none); the token
figures and ``ttft_ms`` come from the generation (``-`` for other routes);
``status`` 499 means the client left (or was cut off for not reading:
``stream_stall_timeout_s``) before the answer was complete — nginx's "client
closed request" — even when a 200 stream had begun; ``disconnected`` is true then
too, and ``stalled`` is true when the router cut the client off for reading nothing.
For a generation the client left, ``completion_tokens`` counts the tokens
relayed to it (``prompt_tokens`` is ``-``: the worker's Done never came).
"""

from __future__ import annotations

import collections
import logging
import re
import time
import uuid
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("modelyard.access")

HEADER = b"x-request-id"
_SANE = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


#: Access-log records kept in memory for the status page (``recent_requests``).
RECENT = 100


def recent_requests(state: Any) -> collections.deque[dict[str, Any]]:
    """The app's ring of the last :data:`RECENT` access-log records (each the logged fields
    and ``at``, unix time); see :func:`shown_in_recent`."""
    ring = getattr(state, "recent_requests", None)
    if ring is None:
        ring = collections.deque(maxlen=RECENT)
        state.recent_requests = ring
    return ring


def shown_in_recent(route: str) -> bool:
    """Kept for the status page: not its own polling (``/ui...``) nor probes and scrapes
    (``/health``, ``/metrics``), which would push the requests an operator looks for out."""
    return not (route.startswith("/ui") or route in ("/health", "/metrics"))


def request_id_of(scope: Scope) -> str:
    """The client's X-Request-Id when it is a sane token, else a new one."""
    for k, v in scope.get("headers", []):
        if k == HEADER:
            try:
                text: str = v.decode("ascii")
            except UnicodeDecodeError:
                break
            if _SANE.match(text):
                return text
            break
    return f"req-{uuid.uuid4().hex[:24]}"


def access_record(state: Any) -> dict[str, Any]:
    """The request's access-log figures (``request.state``), made on first use; the
    generation fills ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``, ``ttft_ms``."""
    rec = getattr(state, "access", None)
    if rec is None:
        rec = {}
        state.access = rec
    return rec


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.1f}"
    s = str(v)
    return s if s and not any(c.isspace() or c in '"=' for c in s) else '"' + s.replace('"', "'") + '"'



def route_template(routes: list[BaseRoute], scope: Scope, fallback: str) -> str:
    """The path template (e.g. ``/slots/{id_slot}``) of the first route matching ``scope``,
    else ``fallback`` — the one matching rule of the access log and the metrics labels."""
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return str(getattr(route, "path", fallback))
    return fallback

class AccessLog:
    def __init__(self, app: ASGIApp, routes: list[BaseRoute]) -> None:
        self.app = app
        self.routes = routes

    def _template(self, scope: Scope) -> str:
        return route_template(self.routes, scope, scope.get("path", "other"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        rid = request_id_of(scope)
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        status = [0]
        complete = [False]
        disconnected = [False]

        async def receive_wrapper() -> Message:
            msg = await receive()
            if msg["type"] == "http.disconnect" and not complete[0]:
                disconnected[0] = True
            return msg

        async def send_wrapper(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status[0] = int(msg["status"])
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid.encode("ascii"))]}
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                complete[0] = True
            try:
                await send(msg)
            except OSError:
                disconnected[0] = True
                raise

        failed = True
        try:
            await self.app(scope, receive_wrapper, send_wrapper)
            failed = False
        finally:
            code = status[0] or (500 if failed else 499)
            if status[0] and disconnected[0] and not complete[0] and not state.get("open_ended"):
                code = 499  # a started answer the client did not take in full (a followed stream ends so)
            rec = state.get("access", {})
            client = scope.get("client")
            fields = {
                "request_id": rid, "method": scope.get("method"), "route": self._template(scope),
                "model": state.get("model") or None, "status": code,
                "prompt_tokens": rec.get("prompt_tokens"), "cached_tokens": rec.get("cached_tokens"),
                "completion_tokens": rec.get("completion_tokens"), "ttft_ms": rec.get("ttft_ms"),
                "duration_ms": (time.monotonic() - t0) * 1000,
                "disconnected": disconnected[0] or (code != 499 and not complete[0] and not failed),
                "stalled": bool(state.get("stalled")),
                "client": client[0] if client else None,
            }
            log.info("%s", " ".join(f"{k}={_fmt(v)}" for k, v in fields.items()))
            app = scope.get("app")
            if app is not None and shown_in_recent(str(fields["route"])):
                recent_requests(app.state).append({"at": time.time(), **fields})
