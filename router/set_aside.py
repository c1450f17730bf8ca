"""What a request asked for that the server served without: set aside visibly.

Real harnesses send, on every request, things a local model cannot do: a hosted
built-in tool (``web_search``, ``code_interpreter``, ...), a JSON Schema keyword the
constraint engine cannot enforce (``propertyNames``, ``if``/``then``, ``not``, ...).
Refusing them would fail every request of that harness; dropping them silently would
answer a different question without saying so. So such a request is served without
them, and each item set aside is

* logged once (a warning on ``modelyard.set_aside``, with the request id), and
* named in the response header :data:`HEADER` (``X-Modelyard-Set-Aside``): a
  comma-separated list of ``<request field>:<what>`` items, e.g.
  ``tools[3]:web_search, tools:propertyNames``.

Items are recorded on the request's ASGI state (``scope["state"]["set_aside"]``) by
:func:`set_aside` anywhere before the response starts; :class:`SetAsideHeader` (a
middleware) writes the header on ``http.response.start``. A field that changes the
answer and *could* be honoured is never set aside: it is honoured or refused (400).
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("modelyard.set_aside")

#: The response header naming what was set aside (absent when nothing was).
HEADER = "X-Modelyard-Set-Aside"
#: Longest header value written (items beyond it are summarised as ``+N more``).
MAX_HEADER_CHARS = 2048


def _items(state: Any) -> list[str]:
    if isinstance(state, dict):
        return state.setdefault("set_aside", [])
    items = getattr(state, "set_aside", None)
    if items is None:
        items = []
        state.set_aside = items
    return items


def set_aside(state: Any, field: str, what: str, why: str) -> None:
    """Record that ``what`` (of request field ``field``) was set aside because ``why``.

    ``state``: the request's ``request.state`` (or the ASGI scope's ``state`` dict).
    Duplicates are recorded once; each new item is logged as a warning."""
    item = f"{field}:{what}"
    items = _items(state)
    if item in items:
        return
    items.append(item)
    rid = state.get("request_id", "") if isinstance(state, dict) else getattr(state, "request_id", "")
    log.warning("request %s: set aside %s (%s)", rid or "-", item, why)


def recorded(state: Any) -> list[str]:
    """The items set aside so far for this request (in order)."""
    return list(_items(state))


def header_value(items: list[str]) -> str:
    """``items`` as the header's value, within :data:`MAX_HEADER_CHARS` (latin-1 safe)."""
    out: list[str] = []
    size = 0
    for i, it in enumerate(items):
        it = it.encode("latin-1", "replace").decode("latin-1").replace(",", ";")
        if size + len(it) + 2 > MAX_HEADER_CHARS:
            out.append(f"+{len(items) - i} more")
            break
        out.append(it)
        size += len(it) + 2
    return ", ".join(out)


class SetAsideHeader:
    """ASGI middleware: adds :data:`HEADER` to a response whose request set something aside."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def send_with_header(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                items = state.get("set_aside") if isinstance(state, dict) else None
                if items:
                    value = header_value(items).encode("latin-1")
                    msg = {**msg, "headers": [*msg.get("headers", []), (HEADER.lower().encode("latin-1"), value)]}
            await send(msg)

        await self.app(scope, receive, send_with_header)
