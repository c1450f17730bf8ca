"""Issue 23's six reproductions, each a probe of a kind of attack (fake workers, raw sockets).

1. sockets that send nothing never starve real requests: they do not count against
   ``max_connections`` (requests in progress do), and a refused request gets a 503 with
   ``Retry-After`` and its dialect's error body;
2. a client that reads nothing of a slow, small-token stream (kernel buffers that never
   fill) is measured at the router's send queue: ``/slots`` shows its slot waiting for the
   reader, and after ``stream_stall_timeout_s`` the slot is given up (``status=499
   stalled=true``);
3. budgets: ``n`` x ``max_tokens`` beyond the model's ceiling is a 400; background work is
   bounded per model and per key, and a running background generation nobody collects
   expires;
4. a cross-site GET (``Sec-Fetch-Site: cross-site``, an ``<img>`` tag) never loads a model;
5. no body the router returns (errors and state of every client route) names a path on the
   host, with models configured by absolute path and a failing load;
6. HTTP framing: a malformed chunked body is a 400, an impossible Content-Length a 413 at
   once, and count_tokens with 500 tools is a count.

Every wait is on an observed event (a log line, a socket state, a fake worker event),
never on a sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.router.conftest import ROOT, LiveRouter, dummy_gguf

pytestmark = pytest.mark.reliability  # issue 23's probes (README: -m reliability)

MAX_CONNECTIONS = 8
CONFIG = """
[server]
models_dir = "{tmp}"
header_timeout_s = 20.0
body_timeout_s = 3.0
max_connections = {max_conn}
stream_stall_timeout_s = 3.0
cors_origins = ["http://app.example"]
background_per_key = 3
background_unread_s = 1.0
[models.m]
path = "m.gguf"
ping_interval_s = 0
[models.long]
path = "{tmp}/m.gguf"
ping_interval_s = 0
[models.bg]
path = "m.gguf"
parallel = 2
ping_interval_s = 0
[models.bg4]
path = "m.gguf"
parallel = 4
ping_interval_s = 0
[models.wide]
path = "m.gguf"
n_ctx = 8192
ping_interval_s = 0
[models.side]
path = "m.gguf"
ping_interval_s = 0
[models.bad]
path = "{tmp}/bad.gguf"
ping_interval_s = 0
max_crashes = 1
"""

#: ``long`` streams ~220 bytes per token, 12,000 tokens (2.6 MB: less than the kernel's buffers
#: take from a reader that never reads) at a pace a reader could follow.
FAKE = {
    "long": {"token_delay_s": 0.001, "length": 12_000, "n_ctx": 20_000, "report_slots": True},
    "bg": {"max_jobs": 2},
    "bg4": {"max_jobs": 4},
    "wide": {"n_ctx": 8192, "max_jobs": 4},
    "bad": {"load_error": True},
}

WAIT_S = 60.0
CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    dummy_gguf(module_tmp, "m.gguf", "bad.gguf")
    r = LiveRouter(module_tmp, CONFIG.format(tmp=module_tmp, max_conn=MAX_CONNECTIONS))
    r.set_fake(FAKE)
    yield r
    r.stop()


def _connect(r: LiveRouter) -> socket.socket:
    return socket.create_connection(("127.0.0.1", r.port), timeout=WAIT_S)


def _read_to_eof(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _established(r: LiveRouter) -> int:
    """Connections the router process holds on its port (accepted by the kernel for it)."""
    conns = psutil.Process(r.proc.pid).net_connections(kind="tcp")
    return sum(1 for c in conns if c.laddr and c.laddr.port == r.port and c.status == psutil.CONN_ESTABLISHED)


def _post_head(path: str, body_len: int | None = None, **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if body_len is not None:
        lines.append(f"Content-Length: {body_len}")
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _access_line(r: LiveRouter, rid: str) -> str:
    return str(r.wait_for(lambda: next((ln for ln in r.log_path.read_text(errors="replace").splitlines()
                                        if f"request_id={rid} " in ln), None), WAIT_S, f"the access line of {rid}"))


# ----------------------------------------------------------------------------- 1. idle sockets


def test_sockets_that_send_nothing_do_not_starve_requests(router: LiveRouter) -> None:
    """The probe: more idle sockets than max_connections made /health a plain 503."""
    base = _established(router)
    evicted0 = router.log_path.read_text(errors="replace").count("closing the idle connection")
    idle = [_connect(router) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        # each is accepted, and held (or closed for being idle beyond max_connections)
        router.wait_for(lambda: (_established(router) + router.log_path.read_text(errors="replace")
                                 .count("closing the idle connection") - evicted0) >= base + len(idle),
                        what="the idle sockets accepted")
        r = httpx.get(router.url + "/health", timeout=WAIT_S)
        assert r.status_code == 200, r.text
        r = httpx.post(router.url + "/v1/chat/completions", json=CHAT, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == " w100 w101"
    finally:
        for s in idle:
            s.close()


def test_requests_in_progress_beyond_max_connections_get_a_dialect_503(router: LiveRouter) -> None:
    """The bound that remains counts requests in progress; a refused one gets a 503 with
    Retry-After and the dialect's error body (OpenAI's, Anthropic's on /v1/messages)."""
    held: list[socket.socket] = []
    body = json.dumps({"model": "bg4", "stream": True, "max_tokens": 5,
                       "messages": [{"role": "user", "content": "[hold]"}]}).encode()
    with router.hold():
        try:
            for _ in range(MAX_CONNECTIONS):  # each a request in progress: a stream held by its worker
                s = _connect(router)
                s.sendall(_post_head("/v1/chat/completions", len(body)) + body)
                held.append(s)
            # a request that waits in a queue is in progress too: poll until all are in
            router.wait_for(lambda: (httpx.get(router.url + "/health", timeout=WAIT_S).status_code == 503),
                            what="the router full of requests in progress")
            r = httpx.get(router.url + "/health", timeout=WAIT_S)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            err = r.json()["error"]
            assert err["code"] == "too_many_requests_in_progress" and "max_connections" in err["message"]
            r = httpx.post(router.url + "/v1/messages", timeout=WAIT_S,
                           json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503 and r.headers["retry-after"]
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
        finally:
            for s in held:
                s.close()
    router.wait_for(lambda: httpx.get(router.url + "/health", timeout=WAIT_S).status_code == 200,
                    what="the router serving again")


# ----------------------------------------------------------------------------- 2. readers that never read


def test_a_reader_that_never_reads_a_slow_stream_gives_its_slot_up(router: LiveRouter) -> None:
    with router.http() as c:
        c.post("/admin/models/load", json={"model": "long"}).raise_for_status()
    before = len(router.log_path.read_bytes())
    body = json.dumps({"model": "long", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    with _connect(router) as s:  # default socket buffers: the kernel would take the whole answer
        s.sendall(_post_head("/v1/chat/completions", len(body), X_Request_Id="r-unread") + body)

        def stalled_slot() -> dict[str, Any] | None:
            slots = httpx.get(router.url + "/slots", params={"model": "long"}, timeout=WAIT_S).json()
            return next((x for x in slots if x.get("reader_stalled_s") is not None), None)

        slot = router.wait_for(stalled_slot, WAIT_S, "/slots showing the slot waiting for its reader")
        assert slot["is_processing"] and slot["id_task"]
        access = _access_line(router, "r-unread")
        assert "status=499" in access and "stalled=true" in access
        assert 0 < int(access.split("completion_tokens=")[1].split()[0]) < 12_000  # given up, not finished
        router.wait_for(lambda: router.fake_events("cancel", id=slot["id_task"]),
                        what="the generation cancelled on its worker")
        log = router.log_path.read_bytes()[before:].decode(errors="replace")
        assert "stream_stall_timeout_s=3" in log and "r-unread" in log and "Traceback" not in log
    slots = httpx.get(router.url + "/slots", params={"model": "long"}, timeout=WAIT_S).json()
    router.wait_for(lambda: not any(x["is_processing"] for x in
                                    httpx.get(router.url + "/slots", params={"model": "long"}, timeout=WAIT_S).json()),
                    what="the slot free")
    assert all(x.get("reader_stalled_s") is None for x in slots)


# ----------------------------------------------------------------------------- 3. budgets


def test_n_times_max_tokens_beyond_the_request_ceiling_is_a_400(router: LiveRouter) -> None:
    big = {"model": "wide", "n": 16, "max_tokens": 8192, "messages": [{"role": "user", "content": "hi"}]}
    for path in ("/v1/decode", "/v1/chat/completions"):
        r = httpx.post(router.url + path, json=big, timeout=WAIT_S)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "request_too_large_for_model" and err["param"] == "n", err
        assert "max_request_tokens" in err["message"]
    ok = {**big, "n": 2, "max_tokens": 8}
    r = httpx.post(router.url + "/v1/chat/completions", json=ok, timeout=WAIT_S)
    assert r.status_code == 200, r.text


def test_background_work_is_bounded_per_model_and_per_key_and_expires_unread(router: LiveRouter) -> None:
    held = {"messages": [{"role": "user", "content": "[hold]"}], "max_tokens": 4}
    ids: list[str] = []
    with router.hold(), httpx.Client(base_url=router.url, timeout=WAIT_S) as c, contextlib.ExitStack() as readers:

        def start(model: str) -> httpx.Response:
            r = c.post("/v1/decode", json={"model": model, **held}, headers={"X-Request-Id": f"bgjob-{len(ids)}"})
            if r.status_code == 200:  # a reader collects it (attached: it never expires meanwhile)
                ids.append(r.json()["id"])
                readers.enter_context(c.stream("GET", f"/v1/decode/{ids[-1]}"))
            return r

        assert start("bg").status_code == 200
        # bg has parallel = 2: background work may hold one slot, never all of them
        r = start("bg")
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        assert r.json()["error"]["code"] == "background_model_busy"
        # per key (no key: the keyless clients' share): background_per_key = 3
        assert start("bg4").status_code == 200 and start("bg4").status_code == 200
        r = start("bg4")
        assert r.status_code == 503 and r.json()["error"]["code"] == "background_key_busy", r.text
        assert len(ids) == 3
        readers.close()
        # nobody collects them any more: after background_unread_s they are cancelled and forgotten
        gen_ids = [router.wait_for(lambda k=k: router.fake_events("generate", trace_id=f"bgjob-{k}"),
                                   what="the job on its worker")[0]["id"] for k in range(3)]
        router.wait_for(lambda: all(router.fake_events("cancel", id=g) for g in gen_ids),
                        what="the uncollected jobs cancelled")
        assert all(c.get(f"/v1/decode/{i}").status_code == 404 for i in ids)
        assert "nobody collected it for background_unread_s=1" in router.log()
        router.wait_for(lambda: router.admin("bg")["in_flight"] == [] and router.admin("bg4")["in_flight"] == [],
                        what="their slots freed")
    r = httpx.post(router.url + "/v1/decode", json={"model": "bg", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    job = r.json()["id"]
    got = router.wait_for(lambda: (x := httpx.get(f"{router.url}/v1/decode/{job}", params={"stream": "false"},
                                                  timeout=WAIT_S).json())["status"] == "completed" and x,
                          what="a collected job completing")
    assert got["result"]["choices"][0]["message"]["content"] == " w100 w101"


# ----------------------------------------------------------------------------- 4. cross-site GETs


def test_a_cross_site_get_never_loads_a_model(router: LiveRouter) -> None:
    img = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"}
    for path in ("/props", "/health", "/slots"):
        r = httpx.get(router.url + path, params={"model": "side"}, headers=img, timeout=WAIT_S)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "cross_site_request"
    # a cross-site page of a listed origin gets its answer, but no side effect from a GET
    r = httpx.get(router.url + "/props", params={"model": "side"}, timeout=WAIT_S,
                  headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors", "Origin": "http://app.example"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_loaded", r.text
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    assert router.admin("side")["state"] == "unloaded"
    # a browser without Fetch Metadata (older Safari): a Referer of another site says the same
    r = httpx.get(router.url + "/props", params={"model": "side"}, timeout=WAIT_S,
                  headers={"Referer": "http://evil.example/page.html", "Accept": "image/webp,*/*"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_loaded", r.text
    assert router.admin("side")["state"] == "unloaded"
    # the user's own tools (no Sec-Fetch-*: curl, SDKs) and same-origin pages still load it
    r = httpx.get(router.url + "/props", params={"model": "side"}, timeout=WAIT_S,
                  headers={"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"})
    assert r.status_code == 200, r.text
    assert router.admin("side")["state"] == "ready"


# ----------------------------------------------------------------------------- 5. host paths


def _host_paths(router: LiveRouter) -> list[str]:
    uid = os.getuid()
    out = {str(router.tmp), str(router.tmp.resolve()), str(ROOT), os.path.expanduser("~"),
           os.environ.get("XDG_RUNTIME_DIR", f"/tmp/modelyard-{uid}") + "/", f"/tmp/modelyard-{uid}"}
    return sorted(p for p in out if p and p != "/")


def _bodies(router: LiveRouter) -> list[tuple[str, str]]:
    """(what, body) of every client route, asked about every model (a failed one included)."""
    from router.app import create_app
    from router.config import load_config

    app = create_app(load_config(router.config_path))
    params = {"model_id": "bad", "id_slot": "0", "decode_id": "decode_x", "response_id": "resp_x"}
    out = []
    with router.http() as c:
        for route in app.routes:
            path = getattr(route, "path", "")
            if path.startswith("/admin") or not path:
                continue  # the operator's view keeps the full text (README)
            url = re.sub(r"\{(\w+)(:\w+)?\}", lambda m: params.get(m.group(1), "x"), path)
            for method in sorted(getattr(route, "methods", None) or {"GET"}):
                if method == "HEAD":
                    continue
                for model in ("bad", "m"):
                    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                            "prompt": "hi", "input": "hi", "content": "hi", "tokens": [1],
                                            "max_tokens": 2, "filename": "x.bin"}
                    r = c.request(method, url, params={"model": model, "follow": "false"},  # event streams end
                                  json=None if method in ("GET", "DELETE") else body)
                    out.append((f"{method} {url} model={model} -> {r.status_code}", r.text))
    return out


def test_nothing_returned_names_a_host_path(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json={**CHAT, "model": "bad"}, timeout=WAIT_S)
    assert r.status_code == 503, r.text  # the load failed: its error names the GGUF file
    router.wait_for(lambda: router.admin("bad")["state"] == "failed", what="bad failed")
    with router.http() as c:  # a worker up, so its command line is in /models
        c.post("/admin/models/load", json={"model": "m"})
    router.wait_for(lambda: router.admin("m")["state"] == "ready", what="m ready")
    models = httpx.get(router.url + "/models", timeout=WAIT_S).json()["data"]
    bad = next(m for m in models if m["id"] == "bad")
    assert bad["status"]["failed"] and "bad.gguf" in bad["status"]["error"]
    args = next(m for m in models if m["id"] == "m")["status"]["args"]
    assert args and not any(re.search(r"tcp://[\d.]+:\d+|ipc:///", a) for a in args), args
    paths = _host_paths(router)
    bodies = _bodies(router)
    assert len(bodies) > 40
    leaks = [(what, p) for what, text in bodies for p in paths if p in text]
    assert not leaks, leaks[:10]


# ----------------------------------------------------------------------------- 6. framing


def test_a_malformed_chunked_body_is_a_documented_400(router: LiveRouter) -> None:
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    with _connect(router) as s:
        s.sendall(head + b"zz\r\n{}\r\n0\r\n\r\n")
        raw = _read_to_eof(s)
    head_out, _, body = raw.partition(b"\r\n\r\n")
    assert head_out.startswith(b"HTTP/1.1 400"), raw
    assert b"connection: close" in head_out.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_framing", err


@pytest.mark.parametrize("length", [10**19, 10**12, 8 * 2**20 + 1])
def test_an_impossible_content_length_is_a_413_at_once(router: LiveRouter, length: int) -> None:
    with _connect(router) as s:
        s.sendall(_post_head("/v1/chat/completions", length))
        raw = _read_to_eof(s)  # body_timeout_s = 3 would make it a 408
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), raw
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_count_tokens_with_500_tools_is_a_count(router: LiveRouter) -> None:
    tools = [{"name": f"tool_{i}", "description": f"does thing {i}",
              "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}
             for i in range(500)]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    r = httpx.post(router.url + "/v1/messages/count_tokens", json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    n = r.json()["input_tokens"]
    assert n > 256  # beyond the model's n_ctx: counted, not refused
    small = httpx.post(router.url + "/v1/messages/count_tokens", json={**body, "tools": tools[:1]}, timeout=WAIT_S)
    assert small.status_code == 200 and small.json()["input_tokens"] < n


# ----------------------------------------------------------------------------- the rules themselves


def test_the_request_ceiling_rules() -> None:
    from types import SimpleNamespace

    from protocol import Generate
    from router.serving.budget import RequestTooLarge, check_request_budget

    def slot(n_ctx: int | None, cap: int = 0, budget: int = 0) -> Any:
        ready = SimpleNamespace(n_ctx=n_ctx, kv_budget_tokens=budget) if budget else None
        return SimpleNamespace(model=SimpleNamespace(name="x", n_ctx=n_ctx, max_request_tokens=cap),
                               ready_info=ready)

    g = Generate(id="g", prompt="hi")
    assert check_request_budget(slot(8192), replace(g, n=4)).max_tokens == 2048  # each choice its share
    assert check_request_budget(slot(8192), replace(g, n=4, max_tokens=2048)).max_tokens == 2048
    with pytest.raises(RequestTooLarge) as e:
        check_request_budget(slot(8192), replace(g, n=4, max_tokens=2049))
    assert e.value.param == "n" and "4 x 2049 = 8196" in e.value.message
    with pytest.raises(RequestTooLarge):  # the worker's KV budget is smaller than n_ctx
        check_request_budget(slot(8192, budget=4000), replace(g, n=2, max_tokens=2001))
    assert check_request_budget(slot(8192, cap=100), replace(g, max_tokens=500)).max_tokens == 100
    assert check_request_budget(slot(8192), replace(g, max_tokens=50_000)).max_tokens == 50_000  # the worker's rule
    assert check_request_budget(slot(None), replace(g, n=16, max_tokens=8192)).max_tokens == 8192  # checked later


def test_redaction_covers_paths_and_worker_endpoints() -> None:
    from router.http.errors import redact_paths

    text = ("load failed: /home/u/models/m.gguf (worker --endpoint ipc:///run/user/1/modelyard/9-x/w1.sock, "
            "tcp://127.0.0.1:40123)")
    out = redact_paths(text)
    assert out == "load failed: .../m.gguf (worker --endpoint ipc://..., tcp://...)"
    from router.app import create_app
    from router.config import parse_config

    app = create_app(parse_config({"models": {"m": {"path": __file__}}}, base_dir=Path("/")))
    for route in app.routes:  # an error naming one of the API's routes keeps it
        path = getattr(route, "path", "")
        assert redact_paths(f"no route GET {path}") == f"no route GET {path}", path
