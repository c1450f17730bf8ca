"""A request's keep_alive (Ollama) / ttl (LM Studio), capped by ``max_keep_alive_s`` (issue 27),
with fake workers: 0 unloads after the request, a value sets the expiry ``ps`` shows, a capped
value is capped visibly, a request without one returns to the config's idle_ttl_s."""

from __future__ import annotations

import math
import time
from typing import Any

import httpx
import pytest

from router.http.errors import BadRequest
from router.serving.keep_alive import parse_duration, requested
from tests.router.conftest import LiveRouter, router_fixture
from tests.router.test_cli_client_fake import cli

CONFIG = """
[server]
models_dir = "."
max_keep_alive_s = 600
[models.m]
path = "m.gguf"
[models.n]
path = "m.gguf"
idle_ttl_s = 120
"""


def test_durations() -> None:
    assert parse_duration("5m") == 300 and parse_duration("1h30m") == 5400 and parse_duration("300ms") == 0.3
    assert parse_duration("-1m") == -60 and parse_duration("0") == 0 and parse_duration("42") == 42
    assert parse_duration("1.5h") == 5400 and parse_duration("2m3s") == 123
    for bad in ("soon", "5 m", "m", "", "5d", "1h-2m"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert requested({"keep_alive": -1}) == ("keep_alive", math.inf)
    assert requested({"keep_alive": "-1m"}) == ("keep_alive", math.inf)
    assert requested({"keep_alive": 0}) == ("keep_alive", 0.0)
    assert requested({"ttl": 30}) == ("ttl", 30.0)
    assert requested({"keep_alive": "10s", "ttl": 99}) == ("keep_alive", 10.0)
    assert requested({"keep_alive": None}) is None and requested({}) is None
    for body in ({"keep_alive": "soon"}, {"keep_alive": True}, {"keep_alive": [1]}, {"ttl": -1}, {"ttl": "5m"}):
        with pytest.raises(BadRequest) as e:
            requested(body)
        assert e.value.param in ("keep_alive", "ttl")


router = router_fixture(CONFIG, ggufs=("m.gguf",))


def _chat(r: LiveRouter, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(r.url + "/v1/chat/completions", timeout=30,
                      json={"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], **extra})


def test_keep_alive_zero_unloads_after_the_request(router: LiveRouter) -> None:
    assert _chat(router, "m", keep_alive=0).status_code == 200
    router.wait_for(lambda: router.admin("m")["state"] == "unloaded", what="m unloaded after keep_alive 0")
    assert "keep_alive" in router.admin("m")["unload_reason"]


def test_keep_alive_sets_the_expiry_ps_shows(router: LiveRouter) -> None:
    assert _chat(router, "m", keep_alive="5m").status_code == 200
    m = router.admin("m")
    assert m["state"] == "ready" and m["keep_alive_s"] == 300
    assert time.time() + 290 < m["expires_at"] <= time.time() + 300
    ps = {line.split()[0]: line for line in cli("ps", "--url", router.url).stdout.splitlines()}
    # rounded to the second: 299.6 s left (ps run at once) reads 5m00s
    assert ps["m"].split()[-2:][0] == "in" and ps["m"].split()[-1].startswith(("4m5", "5m00s"))
    # LM Studio's ttl, on the llama.cpp route
    r = httpx.post(router.url + "/completion", json={"model": "m", "prompt": "x", "n_predict": 2, "ttl": 30},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert time.time() + 20 < router.admin("m")["expires_at"] <= time.time() + 30
    # and on Anthropic's
    r = httpx.post(router.url + "/v1/messages", timeout=30, json={
        "model": "m", "max_tokens": 2, "keep_alive": "45s", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    assert time.time() + 35 < router.admin("m")["expires_at"] <= time.time() + 45
    # a request without one: the config's idle_ttl_s again (none for m: never)
    assert _chat(router, "m").status_code == 200
    m = router.admin("m")
    assert m["keep_alive_s"] is None and m["expires_at"] is None and m["state"] == "ready"


def test_a_longer_keep_alive_is_capped_visibly(router: LiveRouter) -> None:
    r = _chat(router, "n", keep_alive="2h")
    assert r.status_code == 200 and "keep_alive:capped to 600s" in r.headers["x-modelyard-set-aside"]
    assert time.time() + 590 < router.admin("n")["expires_at"] <= time.time() + 600
    r = _chat(router, "n", keep_alive=-1)  # "forever" becomes the cap
    assert "keep_alive:capped to 600s" in r.headers["x-modelyard-set-aside"] and router.admin("n")["keep_alive_s"] == 600
    r = _chat(router, "n", keep_alive=60)  # within the cap: as asked, nothing set aside
    assert r.status_code == 200 and "x-modelyard-set-aside" not in r.headers
    assert time.time() + 50 < router.admin("n")["expires_at"] <= time.time() + 60
    assert _chat(router, "n").status_code == 200  # back to its idle_ttl_s
    assert time.time() + 110 < router.admin("n")["expires_at"] <= time.time() + 120


def test_a_bad_keep_alive_is_a_400_naming_it(router: LiveRouter) -> None:
    r = _chat(router, "m", keep_alive="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
    r = _chat(router, "m", ttl=-5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttl"
