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
#: Longest ``what`` of one item (a client-chosen text, e.g. a server tool's ``type``).
MAX_WHAT_CHARS = 120


def _printable(text: str, limit: int) -> str:
    """``text`` as printable ASCII within ``limit`` characters: what a client chose (a tool's
    ``type``, ...) goes into a response header and a log line, where a control character (CR,
    LF) would break the response (h11 refuses the header: the client got an empty reply) or
    forge a log line. Other characters are written as Python escapes (``\\r``, ``\\xe9``)."""
    out = "".join(c if " " <= c <= "~" else c.encode("unicode_escape").decode("ascii") for c in text)
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _items(state: Any) -> list[str]:
    if isinstance(state, dict):
        listed: list[str] = state.setdefault("set_aside", [])
        return listed
    items: list[str] | None = getattr(state, "set_aside", None)
    if items is None:
        items = []
        state.set_aside = items
    return items


#: Items of one request logged one by one; beyond, one line says more were set aside (a request
#: of 20,000 server tools logged 20,000 warnings).
MAX_LOGGED = 32


def _seen(state: Any) -> set[str]:
    if isinstance(state, dict):
        known: set[str] = state.setdefault("set_aside_seen", set())
        return known
    seen: set[str] | None = getattr(state, "set_aside_seen", None)
    if seen is None:
        seen = set()
        state.set_aside_seen = seen
    return seen


def set_aside(state: Any, field: str, what: str, why: str) -> None:
    """Record that ``what`` (of request field ``field``) was set aside because ``why``.

    ``state``: the request's ``request.state`` (or the ASGI scope's ``state`` dict).
    Duplicates are recorded once (a set: a list scan per item was quadratic on the event loop,
    20,000 items 2.6 s); the first :data:`MAX_LOGGED` new items are logged as warnings, then
    one line that more follow."""
    item = f"{_printable(field, MAX_WHAT_CHARS)}:{_printable(what, MAX_WHAT_CHARS)}"
    items, seen = _items(state), _seen(state)
    if item in seen:
        return
    seen.add(item)
    items.append(item)
    if len(items) > MAX_LOGGED + 1:
        return
    rid = state.get("request_id", "") if isinstance(state, dict) else getattr(state, "request_id", "")
    if len(items) == MAX_LOGGED + 1:
        log.warning("request %s: more than %d items set aside; the rest are not logged one by one (the %s "
                    "header names them, within %d characters)", rid or "-", MAX_LOGGED, HEADER, MAX_HEADER_CHARS)
        return
    log.warning("request %s: set aside %s (%s)", rid or "-", item, _printable(why, 400))


def recorded(state: Any) -> list[str]:
    """The items set aside so far for this request (in order)."""
    return list(_items(state))


def header_value(items: list[str]) -> str:
    """``items`` as the header's value, within :data:`MAX_HEADER_CHARS` (printable ASCII)."""
    out: list[str] = []
    size = 0
    for i, it in enumerate(items):
        it = _printable(it, MAX_HEADER_CHARS).replace(",", ";")
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
