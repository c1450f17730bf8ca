"""Idle unload (``idle_ttl_s``) against fake workers on one live router.

A model with ``idle_ttl_s`` is unloaded once nothing has run or waited for that
long, never while a request runs or waits; a request that arrives while an idle
unload is stopping the worker waits and loads the model again (no 503); an
operator unload during an idle unload wins (waiting requests get 503); a model
without ``idle_ttl_s`` stays loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.router.conftest import LiveRouter, dummy_gguf

TTL = 0.5

CONFIG = f"""
[server]
models_dir = "."
[defaults]
ping_interval_s = 0.2
[models.idle]
path = "m.gguf"
idle_ttl_s = {TTL}
[models.slowstop]
path = "m.gguf"
idle_ttl_s = {TTL}
shutdown_grace_s = 60
[models.keep]
path = "m.gguf"
"""


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    dummy_gguf(module_tmp, "m.gguf")
    r = LiveRouter(module_tmp, CONFIG)
    # slowstop's idle unload lasts as long as the test holds its Shutdown: a window to arrive in
    r.set_fake({"slowstop": {"hold_shutdown": True}})
    yield r
    r.stop()


def ask(router: LiveRouter, model: str, content: str = "hi") -> httpx.Response:
    return httpx.post(router.url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2})


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_an_idle_model_is_unloaded_and_loads_again_on_demand(router: LiveRouter) -> None:
    assert ask(router, "idle").status_code == 200
    pid = router.admin("idle")["pid"]
    st = router.wait_for(lambda: (s := router.admin("idle"))["state"] == "unloaded" and s, what="idle unload")
    assert st["unload_reason"] == f"idle for {TTL:g} s (idle_ttl_s)" and st["pid"] is None
    assert st["idle_ttl_s"] == TTL and st["last_used"] is not None
    router.wait_for(lambda: gone(pid), what="idle worker exited")
    assert router.fake_events("shutdown", pid=pid)  # asked politely: Shutdown, not a kill
    r = ask(router, "idle")
    assert r.status_code == 200 and router.admin("idle")["spawn_count"] == 2


def test_never_unloaded_while_a_request_runs_or_waits(router: LiveRouter) -> None:
    async def go() -> tuple[list[httpx.Response], list[str]]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            body: dict[str, Any] = {"model": "idle", "max_tokens": 2}
            with router.hold():
                running = asyncio.create_task(c.post("/v1/chat/completions", json={
                    **body, "messages": [{"role": "user", "content": "[hold]"}]}))
                await router.until(lambda: router.admin("idle")["in_flight"], what="running")
                waiting = asyncio.create_task(c.post("/v1/chat/completions", json={
                    **body, "messages": [{"role": "user", "content": "next"}]}))
                await router.until(lambda: router.admin("idle")["queue_depth"] == 1, what="waiting")
                states = []
                for _ in range(4):  # several TTLs pass with one running and one waiting
                    await asyncio.sleep(TTL)
                    states.append(router.admin("idle")["state"])
            return [await running, await waiting], states

    rs, states = asyncio.run(go())
    assert [r.status_code for r in rs] == [200, 200]
    assert states == ["ready"] * 4
    # and TTL after the last request finished, it goes
    router.wait_for(lambda: router.admin("idle")["state"] == "unloaded", what="idle unload after the burst")


def _waiter(c: httpx.AsyncClient) -> asyncio.Task[httpx.Response]:
    return asyncio.create_task(c.post("/v1/chat/completions", json={
        "model": "slowstop", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}))


def test_a_request_during_an_idle_unload_waits_and_reloads(router: LiveRouter) -> None:
    async def go() -> tuple[httpx.Response, dict[str, Any], int]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            with router.hold():
                assert (await c.post("/v1/completions", json={"model": "slowstop", "prompt": "x",
                                                               "max_tokens": 1})).status_code == 200
                pid = router.admin("slowstop")["pid"]
                await router.until(lambda: router.admin("slowstop")["state"] == "draining", what="idle unload")
                waiting = _waiter(c)  # arrives while the old worker is being stopped
                during = await router.until(lambda: (s := router.admin("slowstop"))["queue_depth"] == 1 and s,
                                            what="admitted, waiting")
            return await waiting, during, pid

    r, during, pid = asyncio.run(go())
    assert during["state"] == "draining" and during["unload_reason"] == f"idle for {TTL:g} s (idle_ttl_s)"
    assert r.status_code == 200, r.text
    st = router.admin("slowstop")
    assert st["spawn_count"] == 2 and st["pid"] != pid
    assert gone(pid)


def test_an_operator_unload_during_an_idle_unload_refuses_the_waiting(router: LiveRouter) -> None:
    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            with router.hold():
                if router.admin("slowstop")["state"] != "ready":
                    assert (await c.post("/admin/models/load", json={"model": "slowstop"})).status_code == 200
                await router.until(lambda: router.admin("slowstop")["state"] == "draining", what="idle unload")
                waiting = _waiter(c)
                await router.until(lambda: router.admin("slowstop")["queue_depth"] == 1, what="waiting")
                unload = asyncio.create_task(c.post("/admin/models/unload", json={"model": "slowstop"}))
                refused = await waiting  # at once, while the worker's Shutdown is still held
            return refused, await unload

    waiting, unload = asyncio.run(go())
    assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "model_unloading"
    assert unload.status_code == 200 and unload.json()["state"] == "unloaded"
    st = router.admin("slowstop")
    assert st["state"] == "unloaded" and st["unload_reason"] == "unloaded by request"


def test_without_idle_ttl_a_model_stays_loaded(router: LiveRouter) -> None:
    assert ask(router, "keep").status_code == 200
    pid = router.admin("keep")["pid"]
    time.sleep(TTL * 4)  # a negative check: the loaded model is still there after several TTLs
    st = router.admin("keep")
    assert st["state"] == "ready" and st["pid"] == pid and st["idle_ttl_s"] == 0.0
