"""One structured access-log line per request and X-Request-Id (router.http.access_log),
against fake workers: the id is taken from the request (or made), returned, written in
the line, and carried to the worker in Generate.trace_id."""

from __future__ import annotations

import re

import httpx

from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
[models.m]
path = "m.gguf"
aliases = ["alias-m"]
"""


router = router_fixture(CONFIG, ggufs=("m.gguf",), fake={"m": {"length": 5, "token_delay_s": 0.01}})


def lines_for(router: LiveRouter, rid: str) -> list[dict[str, str]]:
    out = []
    for line in router.log_path.read_text(errors="replace").splitlines():
        if "modelyard.access" in line and f"request_id={rid} " in line:
            out.append(dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line.split("modelyard.access: ", 1)[1])))
    return out


def one_line(router: LiveRouter, rid: str) -> dict[str, str]:
    return router.wait_for(lambda: lines_for(router, rid), what=f"access line of {rid}")[0]


def test_generation_line_with_the_clients_id_carried_to_the_worker(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", timeout=30, headers={"X-Request-Id": "trace-abc.123"},
                   json={"model": "alias-m", "messages": [{"role": "user", "content": "one two three"}]})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-abc.123"
    rec = one_line(router, "trace-abc.123")
    usage = r.json()["usage"]
    assert rec["method"] == "POST" and rec["route"] == "/v1/chat/completions" and rec["model"] == "m"
    assert rec["status"] == "200" and rec["disconnected"] == "false" and rec["client"] == "127.0.0.1"
    assert int(rec["prompt_tokens"]) == usage["prompt_tokens"] and int(rec["completion_tokens"]) == 5
    assert rec["cached_tokens"] == "0" and float(rec["ttft_ms"]) > 0 and float(rec["duration_ms"]) >= float(rec["ttft_ms"])
    gen = [e for e in router.fake_events("generate") if e.get("trace_id") == "trace-abc.123"]
    assert len(gen) == 1
    assert len(lines_for(router, "trace-abc.123")) == 1


def test_an_id_is_made_when_missing_or_unfit(router: LiveRouter) -> None:
    for headers in ({}, {"X-Request-Id": "has spaces in it"}, {"X-Request-Id": "x" * 200}):
        r = httpx.get(router.url + "/v1/models", headers=headers, timeout=10)
        rid = r.headers["x-request-id"]
        assert re.fullmatch(r"req-[0-9a-f]{24}", rid), rid
        rec = one_line(router, rid)
        assert rec["status"] == "200" and rec["model"] == "-" and rec["prompt_tokens"] == "-"


def test_errors_and_unknown_routes_are_logged_too(router: LiveRouter) -> None:
    r = httpx.get(router.url + "/nope", headers={"X-Request-Id": "r-404"}, timeout=10)
    assert r.status_code == 404 and r.headers["x-request-id"] == "r-404"
    assert one_line(router, "r-404")["status"] == "404"
    r = httpx.post(router.url + "/v1/chat/completions", headers={"X-Request-Id": "r-400"}, timeout=10,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 17})
    assert r.status_code == 400 and one_line(router, "r-400")["model"] == "m"


def test_a_client_leaving_mid_stream_is_logged_as_disconnected(router: LiveRouter) -> None:
    with httpx.Client(base_url=router.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "r-gone"}, json={
                "model": "m", "stream": True, "messages": [{"role": "user", "content": "[slow=0.2] [len=100] hi"}]}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content":" w' in line:
                    break  # leave after the first token's event (the role chunk comes before it)
    rec = one_line(router, "r-gone")
    # nginx's 499 "client closed request", though a 200 stream had begun; the tokens it was sent
    assert rec["disconnected"] == "true" and rec["status"] == "499"
    assert int(rec["completion_tokens"]) >= 1 and rec["prompt_tokens"] == "-"
    assert "Traceback" not in router.log_path.read_text()


def test_several_prompts_are_one_line_with_their_figures_summed(router: LiveRouter) -> None:
    """/completion with several prompts is one request: one line, every prompt's tokens summed."""
    for stream in (False, True):
        rid = f"multi-{int(stream)}"
        r = httpx.post(router.url + "/completion", timeout=30, headers={"X-Request-Id": rid},
                       json={"model": "m", "prompt": ["one two", "three four five"], "n_predict": 3, "stream": stream})
        assert r.status_code == 200, r.text
        rec = one_line(router, rid)
        assert int(rec["completion_tokens"]) == 6 and int(rec["cached_tokens"]) == 0
        if not stream:
            assert int(rec["prompt_tokens"]) == sum(o["tokens_evaluated"] for o in r.json())
        assert len(lines_for(router, rid)) == 1
