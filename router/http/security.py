"""Browser-origin protection: what a web page in the user's browser may make the router do.

A keyless router on loopback would otherwise obey any page the user visits: a
``text/plain`` POST needs no CORS preflight, and with DNS rebinding a page's
own host name resolves to 127.0.0.1 so it can read the answers too (Ollama's
CVE-2024-28224). :class:`BrowserGuard` (pure ASGI; wraps ``send`` only, never
``receive``) refuses, before any route or key check runs:

* a ``Host`` that is not a loopback name (``localhost``, ``*.localhost``,
  127.0.0.0/8, ``[::1]``) or listed in ``server.allowed_hosts`` — when the router
  is bound to loopback (bound elsewhere, only when ``allowed_hosts`` is set):
  403 ``host_not_allowed``;
* an ``Origin`` other than the router's own (``http://<Host>``) that is not listed
  in ``server.cors_origins``: 403 ``origin_not_allowed``. Requests without
  ``Origin`` (curl, SDKs) are not affected;
* a request the browser marks ``Sec-Fetch-Site: cross-site`` (Fetch Metadata; every
  current browser sends it) whose ``Origin`` is not listed in ``server.cors_origins``:
  403 ``cross_site_request`` — this is what stops an ``<img src=".../props?model=...">``
  or a ``no-cors`` fetch, which carry no ``Origin`` at all.

A GET that would load a model (llama.cpp's autoload: ``/props``, ``/slots``,
``/health?model=``) loads it only for a same-origin or same-site browser request
or a caller that is not a browser (no ``Sec-Fetch-Site``, and no ``Referer`` of another
host — what an older browser without Fetch Metadata sends): :func:`may_load_on_get`;
a cross-site one from a listed origin gets its answer as with ``autoload=false``.

Listed origins get CORS headers (``Access-Control-Allow-Origin`` with their own
origin, ``Vary: Origin``) on every answer, and a CORS preflight (``OPTIONS`` with
``Access-Control-Request-Method``) from them is answered 204 here; no other
origin ever gets a CORS header. Third rule, applied where a body is read
(:func:`check_json_content_type`, from ``router.http.params.read_json``): a JSON route
takes only a JSON ``Content-Type`` (415 otherwise), so no "simple" cross-site
form or ``text/plain`` request reaches a handler.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.config import ServerConfig, is_loopback
from router.http.errors import Forbidden, UnsupportedMediaType, error_response

log = logging.getLogger("modelyard.security")

#: Methods and request headers a listed origin may use (the API's own). A preflight also allows
#: the request headers it names (``Access-Control-Request-Headers``): the SDKs' own (the Anthropic
#: SDK's ``x-api-key`` / ``anthropic-version``, the OpenAI SDK's ``x-stainless-*``) would otherwise fail
#: it — the origin is listed, so what it sends is the operator's choice.
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"
CORS_MAX_AGE_S = 600
#: Response headers a listed origin's page may read (beyond CORS's safelisted ones).
CORS_EXPOSE = "X-Modelyard-Set-Aside, Retry-After, X-Request-Id"
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")


def preflight_headers(requested: str) -> str:
    """``Access-Control-Allow-Headers`` of a preflight: the API's own and each well-formed header
    name the preflight asked for (at most 32)."""
    names = [n.strip() for n in requested.split(",")][:32]
    extra = [n for n in names if _HEADER_NAME.match(n) and n.lower() not in ("authorization", "content-type")]
    return ", ".join([CORS_HEADERS, *extra])


def host_name(host_header: str) -> str:
    """The name part of a ``Host`` header value, lower-cased, without port or brackets."""
    h = host_header.strip().lower()
    if h.startswith("["):  # [::1]:8080
        end = h.find("]")
        return h[1:end] if end > 0 else h
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def loopback_name(name: str) -> bool:
    """``localhost``, any ``*.localhost`` (RFC 6761: browsers resolve it to loopback) or a
    loopback address."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` or any ``application/*+json``, parameters (charset) allowed."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def check_json_content_type(headers: Headers) -> None:
    """Raises UnsupportedMediaType (415) unless the request says its body is JSON."""
    ct = headers.get("content-type")
    if not is_json_media_type(ct):
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {ct!r}" if ct else
            "Content-Type must be application/json (the header is missing)")


#: ``Sec-Fetch-Site`` values of requests a page of another site made the browser send.
CROSS_SITE = "cross-site"


def may_load_on_get(headers: Headers) -> bool:
    """Whether a GET may have a side effect (load a model): not a cross-site browser request —
    ``Sec-Fetch-Site: cross-site``, or, from a browser without Fetch Metadata (Safari before
    16.4), a ``Referer`` on another host than the request's own (a browser sends the page's
    origin with a cross-site subresource request; curl and SDKs send none)."""
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site.strip().lower() != CROSS_SITE
    referer, host = headers.get("referer"), headers.get("host")
    if referer and host:
        ref_host = urlsplit(referer.strip()).netloc.lower()
        return not ref_host or ref_host == host.strip().lower()
    return True


class BrowserGuard:
    """Host allowlist, Origin check and CORS for listed origins (see the module docstring)."""

    def __init__(self, app: ASGIApp, server: ServerConfig) -> None:
        self.app = app
        self.check_host = is_loopback(server.host) or bool(server.allowed_hosts)
        self.any_host = "*" in server.allowed_hosts
        self.hosts = frozenset(h.lower() for h in server.allowed_hosts)
        self.any_origin = "*" in server.cors_origins
        self.origins = frozenset(o.lower() for o in server.cors_origins)

    def host_allowed(self, host: str | None) -> bool:
        if not self.check_host or self.any_host or host is None:  # no Host: not a browser (HTTP/1.0)
            return True
        name = host_name(host)
        return loopback_name(name) or name in self.hosts

    def origin_listed(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/").lower() in self.origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not self.host_allowed(host):
            log.info("refused %s %s: Host %r is not allowed", scope["method"], scope["path"], host)
            err = Forbidden(f"Host {host!r} is not allowed (a loopback name, or one listed in "
                            "server.allowed_hosts)", code="host_not_allowed")
            await error_response(err, scope.get("path", ""))(scope, receive, send)
            return
        origin = headers.get("origin")
        if (headers.get("sec-fetch-site", "").strip().lower() == CROSS_SITE
                and not (origin is not None and self.origin_listed(origin))):
            log.info("refused %s %s: a cross-site browser request (Sec-Fetch-Site: cross-site) from %s",
                     scope["method"], scope["path"], repr(origin) if origin else "a page with no Origin")
            err = Forbidden("a cross-site browser request is not allowed (Sec-Fetch-Site: cross-site; list the "
                            "page's origin in server.cors_origins)", code="cross_site_request")
            await error_response(err, scope.get("path", ""))(scope, receive, send)
            return
        if origin is None or (host is not None and origin in (f"http://{host}", f"https://{host}")):
            await self.app(scope, receive, send)  # not cross-origin
            return
        if not self.origin_listed(origin):
            log.info("refused %s %s: Origin %r is not listed in server.cors_origins", scope["method"],
                     scope["path"], origin)
            err = Forbidden(f"Origin {origin!r} is not allowed (list it in server.cors_origins)",
                            code="origin_not_allowed")
            await error_response(err, scope.get("path", ""))(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await Response(status_code=204, headers={
                **self._cors(origin),
                "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": preflight_headers(headers.get("access-control-request-headers", "")),
                "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
            })(scope, receive, send)
            return
        cors = self._cors(origin)

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                h = MutableHeaders(scope=message)
                for k, v in cors.items():
                    h[k] = v
            await send(message)

        await self.app(scope, receive, send_with_cors)

    @staticmethod
    def _cors(origin: str) -> dict[str, str]:
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Expose-Headers": CORS_EXPOSE}
