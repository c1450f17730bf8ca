"""A module's route table, written as ``{"METHOD /path": handler}`` (:func:`route_table`): what
each dialect and operator module gives ``router.app`` (its ``routes``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router.http.sse import SSEResponse

#: A route's handler.
Endpoint = Callable[[Request], Awaitable[Response | SSEResponse]]


def route_table(rows: Mapping[str, Endpoint]) -> list[Route]:
    """Starlette routes from ``{"METHOD /path": handler}``, in that order (a request takes the
    first route that matches its path and method; a GET route answers HEAD too)."""
    out = []
    for spec, handler in rows.items():
        method, path = spec.split(" ", 1)
        out.append(Route(path, handler, methods=[method]))
    return out
