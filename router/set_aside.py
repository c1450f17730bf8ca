"""What a request asked for that this server cannot do, served without it — visibly.

A real harness sends some fields on every request that no local model server can
honour: a hosted built-in tool (``web_search``, ``code_interpreter``, ...), a JSON
Schema keyword the grammar cannot enforce. Refusing them would make the harness
unusable; dropping them silently would answer a different question than the one
asked. So the request is served without them and says so:

* a WARNING on the ``modelyard.set_aside`` logger naming the route and each item;
* the response header ``X-Modelyard-Set-Aside``: a comma-separated list of
  ``<where>:<what>`` items in the order they were set aside, e.g.
  ``tools[3]:web_search, tools[4]:code_interpreter`` (``where`` is the request
  field's path, ``what`` the thing set aside there).

A dialect calls :func:`set_aside` while it reads the request (before the first
byte); the :class:`SetAsideHeader` middleware adds the header to whatever response
the request gets (JSON or the SSE stream's head). The one header name and format
live here, for every dialect.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("modelyard.set_aside")

#: The response header naming what was set aside.
HEADER = "X-Modelyard-Set-Aside"
_SCOPE_KEY = "modelyard.set_aside"


def header_value(items: list[str]) -> str:
    """The header's value for ``items`` (``"<where>:<what>"`` each): comma-separated, in order,
    duplicates dropped."""
    return ", ".join(dict.fromkeys(items))


def set_aside(request: Any, where: str, what: str, why: str = "") -> None:
    """Record that the request's ``where`` (a field path, e.g. ``tools[3]``) asked for ``what``
    (e.g. ``web_search``), which is served without: logged at WARNING and named in the
    response's :data:`HEADER`. ``request``: the Starlette request (its ASGI scope carries the
    list). ``why``: a short reason for the log line."""
    item = f"{where}:{what}"
    items = request.scope.setdefault(_SCOPE_KEY, [])
    if item in items:
        return
    items.append(item)
    log.warning("%s %s: set aside %s%s", request.scope.get("method", "?"), request.scope.get("path", "?"),
                item, f" ({why})" if why else "")


def set_aside_items(request: Any) -> list[str]:
    """The items set aside so far for ``request`` (in order)."""
    return list(request.scope.get(_SCOPE_KEY, []))


class SetAsideHeader:
    """ASGI middleware: adds :data:`HEADER` to a response when its request set something
    aside (see :func:`set_aside`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        items: list[str] = scope.setdefault(_SCOPE_KEY, [])

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start" and items:
                headers = list(message.get("headers", []))
                headers.append((HEADER.lower().encode("latin-1"),
                                header_value(items).encode("latin-1", "replace")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)
