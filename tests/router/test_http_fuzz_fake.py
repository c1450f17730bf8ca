"""HTTP fuzz over raw sockets (hypothesis): random methods, paths, headers, framings and
bodies never get a 5xx, and the router answers exactly as before afterwards (same
worker, same temperature-0 text). The JSON-body fuzz of every generation route is in
test_api_fake.py (``test_random_bodies_never_get_a_500``); this one is the transport.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.router.conftest import LiveRouter, router_fixture

pytestmark = pytest.mark.reliability

CONFIG = """
[server]
models_dir = "."
header_timeout_s = 0.5
body_timeout_s = 0.5
[models.m]
path = "m.gguf"
"""

#: Bound of one exchange: a hang fails the example instead of blocking the suite.
WAIT_S = 15.0

PATHS = ["/v1/chat/completions", "/v1/completions", "/completion", "/tokenize", "/detokenize", "/apply-template",
         "/v1/messages", "/v1/responses", "/v1/models", "/health", "/metrics", "/admin/models", "/props", "/slots",
         "/models", "/nope", "/v1/chat/completions/../../etc/passwd", "//", "/%00", "/v1/models?x=%ff"]
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt": "x",
        "content": "abc", "tokens": [100, 101]}

_token = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"),
                 min_size=1, max_size=12)
_value = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
_headers = st.lists(st.one_of(
    st.tuples(st.just("Host"), st.sampled_from(["127.0.0.1", "localhost:8080", "evil.example", "", "[::1]",
                                                "127.0.0.1:99999", "a" * 300])),
    st.tuples(st.just("Content-Type"), st.sampled_from(["application/json", "text/plain", "application/json; x=y",
                                                        "multipart/form-data", "", "application/JSON"])),
    st.tuples(st.just("Content-Length"), st.sampled_from(["0", "5", "-1", "99999999999", "abc", "3, 4"])),
    st.tuples(st.just("Transfer-Encoding"), st.sampled_from(["chunked", "gzip", "chunked, chunked", "x"])),
    st.tuples(st.just("Origin"), st.sampled_from(["http://evil.example", "null", "http://127.0.0.1:1"])),
    st.tuples(st.just("Authorization"), st.sampled_from(["Bearer x", "Basic", ""])),
    st.tuples(st.just("Expect"), st.just("100-continue")),
    st.tuples(_token, _value),
), max_size=6)
_body = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda d: json.dumps(d).encode(), st.dictionaries(st.sampled_from(sorted(BODY)),
                                                                st.sampled_from(list(BODY.values())), max_size=4)),
    st.just(json.dumps(BODY).encode()),
    st.just(b"0\r\n\r\n"), st.just(b"5\r\nhello\r\n0\r\n\r\n"), st.just(b"zz\r\n"),
)


#: What the fuzz got, by status ("closed": no answer), printed at the end.
SEEN: dict[str, int] = {}


router = router_fixture(CONFIG, ggufs=("m.gguf",))


def _reference(router: LiveRouter) -> tuple[str, Any]:
    r = httpx.post(router.url + "/v1/chat/completions", timeout=30, json={
        "model": "m", "messages": [{"role": "user", "content": "same"}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], router.admin("m")["pid"]


def _exchange(router: LiveRouter, raw: bytes) -> bytes:
    """Send ``raw``; everything the router answers until it closes the connection."""
    with socket.create_connection(("127.0.0.1", router.port), timeout=WAIT_S) as s:
        try:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the router closed first (it may refuse early): read what it said
            pass
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return out
            if not chunk:
                return out
            out += chunk


@pytest.fixture(scope="module")
def before(router: LiveRouter) -> tuple[str, Any]:
    return _reference(router)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH", "BREW"]),
       path=st.one_of(st.sampled_from(PATHS), st.builds(lambda t: "/" + t, _token)),
       version=st.sampled_from(["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2.0", "HTTP/1.1 junk"]),
       headers=_headers, body=_body)
@example(method="POST", path="/v1/chat/completions", version="HTTP/1.1",  # an interim 100, then a 400
         headers=[("Content-Type", "application/json"), ("Expect", "100-continue")],
         body=b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}')
def test_random_requests_never_get_a_5xx(router: LiveRouter, before: tuple[str, Any], method: str, path: str,
                                         version: str, headers: list[tuple[str, str]], body: bytes) -> None:
    lines = [f"{method} {path} {version}"]
    if not any(k.lower() == "host" for k, _ in headers):
        lines.append("Host: 127.0.0.1")
    lines += [f"{k}: {v}" for k, v in headers]
    lines.append("Connection: close")
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    out = _exchange(router, raw)
    if not out:
        SEEN["closed"] = SEEN.get("closed", 0) + 1
        return  # closed without an answer (a head it cannot parse may just be dropped): not a 5xx
    while True:  # past any interim 100 Continue to the final answer
        status_line, _, rest = out.partition(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 "), out[:200]
        status = int(status_line.split()[1])
        # an interim answer is a head alone: the next answer starts after its blank line (a
        # partition of ``rest`` would skip the whole head of the next one, as it starts with CRLF)
        if status >= 200 or b"\r\n\r\n" not in out or not out.partition(b"\r\n\r\n")[2]:
            break
        out = out.partition(b"\r\n\r\n")[2]
    SEEN[str(status)] = SEEN.get(str(status), 0) + 1
    assert status < 500, out[:600]


def test_the_router_answers_as_before_after_the_fuzz(router: LiveRouter, before: tuple[str, Any]) -> None:
    print(f"\n[fuzz] answers by status: {dict(sorted(SEEN.items()))}")
    assert _reference(router) == before  # same text, same worker pid
    assert "Traceback" not in router.log_path.read_text(errors="replace")
