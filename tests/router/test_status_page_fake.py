"""The status page's routes (issue 27), with fake workers: files without a key and under a
CSP that keeps the page on this router, data only with the api key, Host and Origin rules,
recent requests without the page's own polling, and the plots' sampling of the metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from router.metrics import Metrics
from router.operator.status_page import MetricsHistory
from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
api_key = "k-api"
admin_key = "k-admin"
[models.m]
path = "m.gguf"
idle_ttl_s = 60
"""
API = {"Authorization": "Bearer k-api"}


router = router_fixture(CONFIG, ggufs=("m.gguf",))


def test_files_need_no_key_and_hold_no_data(router: LiveRouter) -> None:
    with router.http() as http:
        page = http.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
        assert "m.gguf" not in page.text and '"m"' not in page.text
        for name, media in (("app.js", "text/javascript"), ("style.css", "text/css")):
            f = http.get(f"/ui/static/{name}")
            assert f.status_code == 200 and f.headers["content-type"].startswith(media)
        # nothing else is served from the package
        assert http.get("/ui/static/..%2Fstatus_page.py").status_code == 404
        assert http.get("/ui/static/index.html").status_code == 404
        assert http.get("/ui/", follow_redirects=False).headers["location"] == "/ui"
        # no CDN: the page loads its script and style from this router only
        assert "http" not in page.text.replace("http-equiv", "")


def test_a_browser_opening_the_root_goes_to_the_page(router: LiveRouter) -> None:
    with router.http(headers=API) as http:
        html = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"  # Chromium's Accept
        r = http.get("/", headers={"Accept": html}, follow_redirects=False)
        assert r.status_code == 307 and r.headers["location"] == "/ui"
        assert http.get("/").json()["status"] == "ok"  # other clients keep the JSON answer
        assert http.head("/").status_code == 200


def test_data_needs_the_api_key(router: LiveRouter) -> None:
    with router.http() as http:
        assert http.get("/ui/api/status").status_code == 401
        assert http.get("/ui/api/events?follow=false").status_code == 401
        s = http.get("/ui/api/status", headers=API)
        assert s.status_code == 200
        data = s.json()
        assert data["server"] == {"version": data["server"]["version"], "api_key_required": True,
                                  "admin_key_required": True}
        [m] = data["models"]
        assert m["id"] == "m" and m["file"] == "m.gguf" and "path" not in m  # a file by its name only
        assert str(router.tmp) not in s.text  # nowhere an absolute path (errors, reasons)
        assert m["gguf"]["valid"] is False and m["gguf"]["reason"]
        ev = http.get("/ui/api/events?follow=false", headers=API)
        assert ev.status_code == 200 and "event: snapshot" in ev.text
        # load / unload stay admin routes
        assert http.post("/admin/models/load", json={"model": "m"}, headers=API).status_code == 401


def test_the_page_learns_file_names_never_paths(router: LiveRouter) -> None:
    router.set_fake({"m": {"load_error": True}})
    try:
        with router.http(headers={"Authorization": "Bearer k-admin"}) as admin:
            assert admin.post("/admin/models/load", json={"model": "m"}).status_code == 503
            full = admin.get("/admin/models").json()["data"][0]["last_error"]
            assert str(router.tmp) in full  # the operator's view keeps the full text
        with router.http(headers=API) as http:
            status = http.get("/ui/api/status")
            assert ".../m.gguf" in status.json()["models"][0]["last_error"] and str(router.tmp) not in status.text
            events = http.get("/ui/api/events?recent=200&follow=false")
            assert "load_failed" in events.text and str(router.tmp) not in events.text
    finally:
        router.set_fake({})
        httpx.post(router.url + "/admin/models/load", json={"model": "m"}, timeout=30,
                   headers={"Authorization": "Bearer k-admin"})


def test_host_and_origin_rules_apply(router: LiveRouter) -> None:
    with router.http() as http:
        assert http.get("/ui", headers={"Host": "evil.example"}).status_code == 403
        r = http.get("/ui/api/status", headers={**API, "Origin": "http://evil.example"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        own = http.get("/ui/api/status", headers={**API, "Origin": router.url})
        assert own.status_code == 200


def test_recent_requests_leave_out_the_page_and_probes(router: LiveRouter) -> None:
    with router.http(headers=API) as http:
        r = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 3,
                                                   "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        http.get("/health")
        http.get("/metrics")
        http.get("/ui/api/status")
        reqs = http.get("/ui/api/status").json()["requests"]
    routes = [q["route"] for q in reqs]
    assert routes[0] == "/v1/chat/completions"  # newest first
    assert not any(x.startswith("/ui") or x in ("/health", "/metrics") for x in routes)
    q = reqs[0]
    assert q["model"] == "m" and q["status"] == 200 and q["completion_tokens"] == 3 and q["ttft_ms"] > 0
    assert q["request_id"] == r.headers["x-request-id"]


def test_admin_events_replays_recent_events_and_ends_without_follow(router: LiveRouter) -> None:
    with router.http(headers={"Authorization": "Bearer k-admin"}) as http:
        assert http.post("/admin/models/load", json={"model": "m"}).status_code == 200
        ev = http.get("/admin/events?recent=200&follow=false")
        assert ev.status_code == 200
        kinds = [line.split(": ", 1)[1] for line in ev.text.splitlines() if line.startswith("event: ")]
        assert kinds[0] == "snapshot" and "state" in kinds[1:] and "loading" in kinds
        seqs = [json.loads(x[5:])["seq"] for x in ev.text.splitlines() if x.startswith("data:")]
        assert seqs[0] == seqs[-1] and seqs[0] >= 1  # the snapshot is the state as of the last event
        assert http.get("/admin/events?recent=201&follow=false").status_code == 400
        assert http.get("/admin/events?recent=x&follow=false").status_code == 400


def test_history_turns_counters_into_rates() -> None:
    m = Metrics(["a", "b"])
    h = MetricsHistory()
    h.sample(m.registry, {"a": 0, "b": 2}, now=100.0)
    m.ttft.labels("a").observe(0.2)  # two streams' first tokens ...
    m.ttft.labels("a").observe(0.4)
    for _ in range(48):  # ... and 48 more tokens
        m.itl.labels("a").observe(0.01)
    m.generation_tokens.labels("a").inc(50)  # counted at the answers' end: not what the plot reads
    h.sample(m.registry, {"a": 1, "b": 0}, now=102.0)
    h.sample(m.registry, {"a": 0, "b": 0}, now=104.0)
    d = h.describe()
    assert d["t"] == [100.0, 102.0, 104.0]
    a = d["models"]["a"]
    assert a["tok_s"] == [None, 25.0, 0.0]
    assert a["ttft_ms"][0] is None and a["ttft_ms"][1] == pytest.approx(300.0) and a["ttft_ms"][2] is None
    assert a["queue"] == [0.0, 1.0, 0.0] and d["models"]["b"]["queue"] == [2.0, 0.0, 0.0]
    # a model added by a reload gets an empty past; the window is bounded
    m.add_model("c")
    h.sample(m.registry, {"a": 0, "b": 0, "c": 3}, now=106.0)
    assert h.describe()["models"]["c"]["queue"] == [None, None, None, 3.0]
    small = MetricsHistory(maxlen=2)
    for t in range(5):
        small.sample(m.registry, {"a": t}, now=float(t))
    assert small.describe()["t"] == [3.0, 4.0] and small.describe()["models"]["a"]["queue"] == [3.0, 4.0]
