"""README claims that had no test (fake workers): drain_timeout_s cancelling the running
requests of an unload, 409 for a load during an operator unload, the port closing at
SIGTERM while running requests finish, and /v1/completions without max_tokens
generating until end-of-generation or n_ctx."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import LiveRouter, dummy_gguf, router_fixture

CONFIG = """
[server]
models_dir = "."
shutdown_timeout_s = 30
[defaults]
ping_interval_s = 0
[models.dt]
path = "m.gguf"
drain_timeout_s = 0.5
[models.busy]
path = "m.gguf"
[models.free]
path = "m.gguf"
"""


router = router_fixture(CONFIG, ggufs=("m.gguf",))


def _stream_lines(c: httpx.AsyncClient, body: dict[str, object], lines: list[str]) -> "asyncio.Task[None]":
    async def go() -> None:
        async with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            async for line in s.aiter_lines():
                if line.startswith("data: {"):
                    lines.append(line[6:])
    return asyncio.ensure_future(go())


def test_drain_timeout_s_cancels_what_still_runs(router: LiveRouter) -> None:
    async def go() -> tuple[list[str], httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            lines: list[str] = []
            with router.hold():  # never released: only the drain timeout ends it
                stream = _stream_lines(c, {"model": "dt", "stream": True,
                                           "messages": [{"role": "user", "content": "[hold@2]"}]}, lines)
                await router.until(lambda: len(lines) >= 3, what="two tokens streamed")
                unload = await c.post("/admin/models/unload", json={"model": "dt"})
                await stream
            return lines, unload

    lines, unload = asyncio.run(go())
    assert unload.status_code == 200 and unload.json()["state"] == "unloaded"
    err = json.loads(lines[-1])["error"]
    assert err["code"] == "cancelled"  # the worker answered the Cancel: not killed
    assert [e for e in router.fake_events("cancel") if e.get("id")] or router.fake_events("cancelled")
    assert "hung" not in (router.admin("dt")["last_error"] or "")


def test_a_load_during_an_operator_unload_is_409(router: LiveRouter) -> None:
    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            lines: list[str] = []
            with router.hold():
                stream = _stream_lines(c, {"model": "busy", "stream": True,
                                           "messages": [{"role": "user", "content": "[hold@1]"}]}, lines)
                await router.until(lambda: len(lines) >= 2, what="streaming")
                unload = asyncio.ensure_future(c.post("/admin/models/unload", json={"model": "busy"}))
                await router.until(lambda: router.admin("busy")["state"] == "draining", what="draining")
                admin_load = await c.post("/admin/models/load", json={"model": "busy"})
                llama_load = await c.post("/models/load", json={"model": "busy"})
            await stream
            return admin_load, llama_load, await unload

    admin_load, llama_load, unload = asyncio.run(go())
    for r in (admin_load, llama_load):
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_unloading", r.text
    assert unload.status_code == 200
    assert httpx.post(router.url + "/admin/models/load", json={"model": "busy"}, timeout=30).status_code == 200


@pytest.mark.parametrize("prompt, finish, n", [("count", "stop", 12), ("[len=1000] x", "length", None)])
def test_completions_without_max_tokens_run_to_eos_or_n_ctx(router: LiveRouter, prompt: str, finish: str,
                                                            n: int | None) -> None:
    r = httpx.post(router.url + "/v1/completions", json={"model": "free", "prompt": prompt}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == finish
    usage = body["usage"]
    if n is not None:
        assert usage["completion_tokens"] == n  # the fake's end-of-generation after 12 tokens, not OpenAI's 16
    else:
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 256  # the fake's n_ctx


def test_the_port_closes_at_sigterm_while_running_requests_finish(tmp_path: Path) -> None:
    dummy_gguf(tmp_path, "m.gguf")
    r = LiveRouter(tmp_path, CONFIG)
    try:
        async def go() -> tuple[list[str], bool]:
            async with httpx.AsyncClient(base_url=r.url, timeout=60) as c:
                lines: list[str] = []
                with r.hold():
                    stream = _stream_lines(c, {"model": "free", "stream": True,
                                               "messages": [{"role": "user", "content": "[hold@1]"}]}, lines)
                    await r.until(lambda: len(lines) >= 2, what="streaming")
                    r.proc.send_signal(signal.SIGTERM)

                    def refused() -> bool:
                        try:
                            socket.create_connection(("127.0.0.1", r.port), timeout=1).close()
                            return False
                        except ConnectionRefusedError:
                            return True

                    closed = await r.until(refused, what="the port closed")
                    still_running = r.proc.poll() is None  # the stream is still held: the router lives on
                await stream  # released: it finishes
                return lines, bool(closed and still_running)

        lines, closed_while_running = asyncio.run(go())
        assert closed_while_running
        assert json.loads(lines[-1])["choices"][0]["finish_reason"] == "stop"
        assert r.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        r.kill()
