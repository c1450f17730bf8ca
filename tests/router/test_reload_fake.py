"""SIGHUP re-reads config.toml (fake workers): added models appear, removed ones drain and
stop, changed ones reload once their running requests finish (new requests wait and get
the new worker), unchanged ones keep their worker; an invalid config is refused with the
error logged and the old one kept."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx

from tests.router.conftest import LiveRouter, dummy_gguf

BASE = """
[server]
models_dir = "."
[defaults]
ping_interval_s = 0.2
[models.a]
path = "m.gguf"
aliases = ["a1"]
[models.b]
path = "m.gguf"
n_ctx = 256
[models.c]
path = "m.gguf"
"""

NEW = """
[server]
models_dir = "."
[defaults]
ping_interval_s = 0.2
[models.a]
path = "m.gguf"
aliases = ["a1"]
[models.b]
path = "m.gguf"
n_ctx = 128
[models.d]
path = "m.gguf"
"""


def ask(r: LiveRouter, model: str, content: str = "hi") -> httpx.Response:
    return httpx.post(r.url + "/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3})


async def aask(c: httpx.AsyncClient, model: str, content: str = "hi") -> httpx.Response:
    return await c.post("/v1/chat/completions",
                        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3})


def ids(r: LiveRouter) -> set[str]:
    return {m["id"] for m in httpx.get(r.url + "/admin/models", timeout=10).json()["data"]}


def test_sighup_adds_removes_and_reloads(tmp_path: Path) -> None:
    dummy_gguf(tmp_path, "m.gguf")
    r = LiveRouter(tmp_path, BASE)
    try:
        for m in "abc":
            assert ask(r, m).status_code == 200
        pid_a, pid_b = r.admin("a")["pid"], r.admin("b")["pid"]
        assert r.admin("b")["n_ctx"] == 256

        async def go() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=r.url, timeout=60) as c:
                with r.hold():
                    running = asyncio.create_task(aask(c, "b", "[hold@1] long"))
                    await r.until(lambda: len(r.admin("b")["in_flight"]) == 1, what="b running")
                    r.config_path.write_text(NEW)
                    r.proc.send_signal(signal.SIGHUP)
                    await r.until(lambda: "config reloaded" in r.log(), what="the reload")
                    assert r.admin("b")["state"] == "draining"  # it finishes what runs, then reloads
                    waiting = asyncio.create_task(aask(c, "b"))  # waits for the new worker, no 503
                    await r.until(lambda: r.admin("b")["queue_depth"] == 1, what="a request waiting for b")
                return await running, await waiting

        done, after = asyncio.run(go())
        assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert after.status_code == 200
        b = r.admin("b")
        assert b["pid"] != pid_b and b["n_ctx"] == 128 and b["spawn_count"] == 2
        assert r.admin("a")["pid"] == pid_a  # unchanged: kept its worker
        assert ask(r, "a1").status_code == 200
        assert ask(r, "d").status_code == 200  # added
        gone = ask(r, "c")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        r.wait_for(lambda: "c" not in ids(r), what="c drained, stopped and forgotten")
        assert {m["id"] for m in httpx.get(r.url + "/v1/models", timeout=10).json()["data"]} >= {"a", "a1", "b", "d"}
        assert 'modelyard_model_loads_total{model="d"} 1.0' in httpx.get(r.url + "/metrics", timeout=10).text

        # an invalid config is refused, the running one kept
        r.config_path.write_text(NEW + "[models.e]\npath = 'missing.gguf'\n")
        r.proc.send_signal(signal.SIGHUP)
        r.wait_for(lambda: "the config was not reloaded" in r.log(), what="the refusal")
        assert "models.e.path" in r.log()
        assert ask(r, "d").status_code == 200 and r.admin("a")["pid"] == pid_a and "e" not in ids(r)
    finally:
        r.stop()
        r.kill()
