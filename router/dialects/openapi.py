"""``GET /openapi.json``: an OpenAPI 3.1 document of the public routes, made from the app's routes table.

Nothing here lists routes: :func:`document` walks ``app.routes`` (the one table the
router serves), so a route added there is in the document and a route removed is
gone. Each operation gets its path parameters (from the route's own path
convertors), a JSON request body for POST (an object; ``model`` names one of the
configured models), the route's docstring summary, and the error envelope every
route answers with. Operator routes (``/admin/...``) and this document itself are
left out: they are not part of the client API.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.convertors import FloatConvertor, IntegerConvertor
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from router.dialects.shared import build_info
from router.http.responses import JSONResponse

#: Path prefixes of routes that are not part of the client API.
PRIVATE_PREFIXES = ("/admin/", "/openapi.json", "/ui")  # /ui: the status page (router.operator.status_page)

_PARAM = re.compile(r"{([^}:]+)(?::[^}]+)?}")

_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "code": {}, "param": {}}}},
}


def _summary(endpoint: Any) -> str:
    doc = (getattr(endpoint, "__doc__", None) or "").strip()
    return doc.splitlines()[0].rstrip(".") if doc else endpoint.__name__.replace("_", " ")


def _param_schema(route: Route, name: str) -> dict[str, Any]:
    conv = route.param_convertors.get(name)
    if isinstance(conv, IntegerConvertor):
        return {"type": "integer", "minimum": 0}
    if isinstance(conv, FloatConvertor):
        return {"type": "number", "minimum": 0}
    return {"type": "string", "minLength": 1}


def document(routes: list[BaseRoute], models: list[str]) -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-ready dict) of ``routes``; ``models``: the configured
    model names (the enumeration of the bodies' ``model`` field)."""
    paths: dict[str, dict[str, Any]] = {}
    body = {"type": "object", "properties": {"model": {"type": "string", "enum": models}}}
    for route in routes:
        if not isinstance(route, Route) or route.path.startswith(PRIVATE_PREFIXES):
            continue
        path = _PARAM.sub(r"{\1}", route.path)
        params = [{"name": n, "in": "path", "required": True, "schema": _param_schema(route, n)}
                  for n in route.param_convertors]
        for method in sorted((route.methods or set()) - {"HEAD"}):
            op: dict[str, Any] = {
                "operationId": f"{method.lower()}_{route.endpoint.__module__.rsplit('.', 1)[-1]}"
                               f"_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '') or 'root'}",
                "summary": _summary(route.endpoint),
                "responses": {
                    "200": {"description": "the answer (JSON, or an SSE stream for `stream: true`)"},
                    "default": {"description": "an error", "content": {"application/json": {"schema": _ERROR}}},
                },
            }
            if params:
                op["parameters"] = params
            if method == "POST":
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
            paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "modelyard", "version": build_info().removeprefix("modelyard").strip() or "0",
                 "description": "OpenAI, Anthropic, llama.cpp server and Ollama APIs in front of local GGUF models."},
        "paths": paths,
    }


async def openapi_json(request: Request) -> Response:
    """The OpenAPI document of this router's public routes; ``model`` lists every name a client may
    use now (names, aliases, presets, models found in models_dir since the last rescan)."""
    pool = getattr(request.app.state, "pool", None)
    names = pool.config.ids() if pool is not None else list(request.app.state.config.models)
    return JSONResponse(document(request.app.routes, names))


routes = [Route("/openapi.json", openapi_json, methods=["GET"])]
