"""Bearer-key checks, as pure ASGI middleware (does not wrap ``receive``, so
client-disconnect detection downstream keeps working).

* ``server.api_key`` set: every route but ``/health`` (and llama-server's ``/v1/health``) needs ``Authorization: Bearer <api_key>``
  (or ``x-api-key: <api_key>``, as Anthropic's clients send it; a Bearer header wins when both come)
  (``/health?model=NAME`` needs it too: it may start loading the model).
* ``/ui`` and ``/ui/static/*`` (the status page's files, which hold no data) need no key.
* ``server.admin_key`` set: ``/admin/*`` and llama.cpp's ``/models/load`` and
  ``/models/unload`` need ``Authorization: Bearer <admin_key>`` (without an
  admin_key, they are guarded by the api_key like the rest).
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Receive, Scope, Send

from router.config import ServerConfig
from router.http.errors import Unauthorized, error_response


class BearerAuth:
    def __init__(self, app: ASGIApp, server: ServerConfig) -> None:
        self.app = app
        self.api_key = server.api_key
        self.admin_key = server.admin_key

    def _required(self, path: str, query: bytes) -> str | None:
        if path in ("/ui", "/ui/") or path.startswith("/ui/static/"):
            return None  # the status page's own files: no data (its data routes, /ui/api/*, need the key)
        if path in ("/health", "/v1/health") and "model" not in parse_qs(query.decode("latin-1"), keep_blank_values=True):
            return None
        if path == "/admin" or path.startswith("/admin/") or path in ("/models/load", "/models/unload"):
            return self.admin_key or self.api_key
        return self.api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = self._required(scope.get("path", ""), scope.get("query_string", b""))
        if key is not None:
            given = None
            for name, value in scope.get("headers", []):
                if name == b"authorization":
                    scheme, _, token = value.decode("latin-1").partition(" ")
                    if scheme.lower() == "bearer":
                        given = token.strip()
                    break
            if given is None:  # Anthropic's clients send the key as x-api-key
                given = next((v.decode("latin-1").strip() for n, v in scope.get("headers", [])
                              if n == b"x-api-key"), None)
            if given is None or not hmac.compare_digest(given.encode(), key.encode()):
                err = Unauthorized("missing or invalid API key (expected 'Authorization: Bearer <key>' "
                                   "or 'x-api-key: <key>')")
                await error_response(err, scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)
