"""Browser-origin protection (fake workers): a web page cannot drive a keyless loopback router.

A foreign ``Host`` (DNS rebinding) and a foreign ``Origin`` (CSRF) get 403 before
any route runs; listed origins get CORS headers (and preflights), no other one
does; a JSON route takes only a JSON ``Content-Type`` (415). Every refusal is
OpenAI-shaped and leaves the models untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from router.config import ConfigError, load_config
from router.http.security import host_name, is_json_media_type, loopback_name
from tests.router.conftest import LiveRouter, dummy_gguf, router_fixture

pytestmark = pytest.mark.reliability  # issue 11's probes (README: -m reliability)

CONFIG = """
[server]
models_dir = "."
allowed_hosts = ["modelyard.internal"]
cors_origins = ["http://localhost:3000", "https://App.Example.com/"]
[models.m]
path = "m.gguf"
ping_interval_s = 0
"""

LISTED = "http://localhost:3000"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


router = router_fixture(CONFIG, ggufs=("m.gguf",))


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert err["type"] == "invalid_request_error"
    return err


def _no_cors(r: httpx.Response) -> None:
    assert not any(k.lower().startswith("access-control-") for k in r.headers), r.headers


def test_the_attack_of_the_probe_is_refused(router: LiveRouter) -> None:
    """The issue's probe: a text/plain POST with a foreign Host unloaded a model and ran a chat."""
    assert httpx.post(router.url + "/admin/models/load", json={"model": "m"}, timeout=30).status_code == 200
    generates = len(router.fake_events("generate"))
    for path, body in (("/admin/models/unload", b'{"model": "m"}'), ("/v1/chat/completions", b'{"model": "m"}')):
        r = httpx.post(router.url + path, content=body, timeout=30,
                       headers={"Host": "attacker.example:8080", "Content-Type": "text/plain"})
        _error(r, 403, "host_not_allowed")
        # the same page without DNS rebinding: its Origin is foreign
        r = httpx.post(router.url + path, content=body, timeout=30,
                       headers={"Origin": "http://attacker.example", "Content-Type": "text/plain"})
        _error(r, 403, "origin_not_allowed")
        _no_cors(r)
        # even from the user's own shell a text/plain body is not JSON
        r = httpx.post(router.url + path, content=body, timeout=30, headers={"Content-Type": "text/plain"})
        _error(r, 415, "unsupported_media_type")
    assert router.admin("m")["state"] == "ready"
    assert len(router.fake_events("generate")) == generates


@pytest.mark.parametrize("host", ["localhost", "localhost:{port}", "127.0.0.1:{port}", "127.0.0.2",
                                  "[::1]:{port}", "app.localhost:{port}", "LOCALHOST.", "modelyard.internal:{port}"])
def test_loopback_and_listed_hosts_are_accepted(router: LiveRouter, host: str) -> None:
    r = httpx.get(router.url + "/v1/models", headers={"Host": host.format(port=router.port)}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["attacker.example", "192.168.1.10:8080", "localhost.attacker.example",
                                  "127.0.0.1.nip.io", "[::2]:80"])
def test_foreign_hosts_get_403_on_every_route(router: LiveRouter, host: str) -> None:
    for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("GET", "/admin/models"), ("GET", "/no-such-route")):
        r = httpx.request(method, router.url + path, headers={"Host": host}, json={"model": "m", "prompt": "x"},
                          timeout=30)
        _error(r, 403, "host_not_allowed")


def test_listed_origins_get_cors_headers_and_preflights(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=CHAT, headers={"Origin": LISTED}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == LISTED and r.headers["vary"] == "Origin"
    # listed case-insensitively, with the trailing slash of the config ignored
    r = httpx.get(router.url + "/v1/models", headers={"Origin": "https://app.example.com"}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
    # errors carry them too (the page can read why)
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": "nope"}, headers={"Origin": LISTED},
                   timeout=30)
    _error(r, 404, "model_not_found")
    assert r.headers["access-control-allow-origin"] == LISTED
    pre = httpx.options(router.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": LISTED, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == LISTED
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                 pre.headers["access-control-allow-headers"].split(",")}


def test_a_listed_origin_may_send_the_sdks_headers_and_read_ours(router: LiveRouter) -> None:
    """The Anthropic SDK in a browser sends x-api-key / anthropic-version, the OpenAI SDK its
    x-stainless-* headers: a preflight naming them is answered with them allowed (it was
    Authorization and Content-Type only, so the browser refused the call); DELETE is one of the
    API's methods; the page may read X-Modelyard-Set-Aside, Retry-After and X-Request-Id."""
    pre = httpx.options(router.url + "/v1/messages", timeout=30, headers={
        "Origin": LISTED, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "x-api-key,anthropic-version,content-type,x-stainless-os,bad header"})
    assert pre.status_code == 204
    allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
    assert {"x-api-key", "anthropic-version", "content-type", "authorization", "x-stainless-os"} <= allowed
    assert "bad header" not in allowed
    assert "DELETE" in pre.headers["access-control-allow-methods"]
    r = httpx.get(router.url + "/v1/models", headers={"Origin": LISTED}, timeout=30)
    exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"x-modelyard-set-aside", "retry-after", "x-request-id"} <= exposed


def test_unlisted_origins_get_403_and_no_cors(router: LiveRouter) -> None:
    for origin in ("http://attacker.example", "null", "http://localhost:3001", "file://"):
        pre = httpx.options(router.url + "/v1/chat/completions", timeout=30, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        _error(pre, 403, "origin_not_allowed")
        _no_cors(pre)
        r = httpx.get(router.url + "/v1/models", headers={"Origin": origin}, timeout=30)
        _error(r, 403, "origin_not_allowed")
        _no_cors(r)


def test_same_origin_and_no_origin_are_not_cross_origin(router: LiveRouter) -> None:
    r = httpx.get(router.url + "/v1/models", headers={"Origin": router.url}, timeout=30)
    assert r.status_code == 200
    _no_cors(r)
    r = httpx.get(router.url + "/v1/models", timeout=30)
    assert r.status_code == 200
    _no_cors(r)


@pytest.mark.parametrize("ctype,status", [
    ("application/json", 200), ("application/json; charset=utf-8", 200), ("Application/JSON", 200),
    ("application/vnd.api+json", 200), ("text/plain", 415), ("application/x-www-form-urlencoded", 415),
    ("multipart/form-data; boundary=x", 415), (None, 415), ("", 415),
])
def test_json_routes_need_a_json_content_type(router: LiveRouter, ctype: str | None, status: int) -> None:
    headers = {} if ctype is None else {"Content-Type": ctype}
    r = httpx.post(router.url + "/tokenize", content=b'{"model": "m", "content": "a b"}', headers=headers,
                   timeout=30)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        _error(r, 415, "unsupported_media_type")


# ----------------------------------------------------------------------------- units and config


@pytest.mark.parametrize("value,name", [("LocalHost:8080", "localhost"), ("[::1]:80", "::1"), ("::1", "::1"),
                                        ("example.com.", "example.com"), ("127.0.0.1", "127.0.0.1")])
def test_host_name(value: str, name: str) -> None:
    assert host_name(value) == name


def test_loopback_names_and_media_types() -> None:
    assert loopback_name("localhost") and loopback_name("a.b.localhost") and loopback_name("127.9.9.9")
    assert not loopback_name("localhost.evil") and not loopback_name("0.0.0.0") and not loopback_name("10.0.0.1")
    assert is_json_media_type("application/json;charset=UTF-8") and not is_json_media_type("text/json")


def _cfg(tmp: Path, server: str) -> Path:
    dummy_gguf(tmp, "m.gguf")
    p = tmp / "c.toml"
    p.write_text(f'[server]\nmodels_dir = "."\n{server}\n[models.m]\npath = "m.gguf"\n')
    return p


def test_security_keys_defaults(tmp_path: Path) -> None:
    s = load_config(_cfg(tmp_path, "")).server
    assert s.allowed_hosts == () and s.cors_origins == ()
    s = load_config(_cfg(tmp_path, 'allowed_hosts = ["My.Host"]\ncors_origins = ["http://a:1/", "*"]')).server
    assert s.allowed_hosts == ("my.host",) and s.cors_origins == ("http://a:1", "*")


@pytest.mark.parametrize("line,key", [
    ('allowed_hosts = "localhost"', "server.allowed_hosts"),
    ('allowed_hosts = ["http://x"]', "server.allowed_hosts"),
    ('allowed_hosts = ["x:80"]', "server.allowed_hosts"),
    ('allowed_hosts = [""]', "server.allowed_hosts"),
    ('cors_origins = ["localhost:3000"]', "server.cors_origins"),
    ('cors_origins = ["http://a/path"]', "server.cors_origins"),
    ('cors_origins = [1]', "server.cors_origins"),
])
def test_security_keys_errors_name_the_key(tmp_path: Path, line: str, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_cfg(tmp_path, line))
    assert e.value.key == key


def test_redact_paths_keeps_file_names_and_urls() -> None:
    from router.http.errors import redact_paths

    msg = "cannot open '/home/u/models/x.gguf': [Errno 2] No such file: /tmp/y.gguf; see http://a/b/c"
    assert redact_paths(msg) == "cannot open '.../x.gguf': [Errno 2] No such file: .../y.gguf; see http://a/b/c"
