"""Worker lifecycle, admission and cancellation against fake workers (one live router).

Covers: one spawn per burst of first requests, 503 queue_full with Retry-After,
cancel on disconnect (queued, prefill, mid-stream, non-streaming), worker crash
and SIGKILL mid-stream, load failure / timeout, hung workers, unload draining,
and that a worker is never handed two generations at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.router.conftest import LiveRouter, alive, dummy_gguf
from tests.timing import report

MODELS = ["burst", "q2", "dc", "crash", "broken", "slowload", "hang", "deaf", "drain", "stubborn", "lazy", "plain"]

SWITCHES: dict[str, Any] = {
    "burst": {"load_delay_s": 0.5},
    "q2": {"hold_load": True, "token_delay_s": 0.01, "length": 40},
    "dc": {"token_delay_s": 0.05, "length": 200},
    "crash": {"token_delay_s": 0.02, "length": 100},
    "hang": {"token_delay_s": 0.02},
    "deaf": {"ignore_cancel": True, "token_delay_s": 0.05, "length": 200},
    "drain": {"token_delay_s": 0.05, "length": 40},
    "stubborn": {"ignore_shutdown": True},
    "lazy": {"hold_load": True},
}


def _config() -> str:
    lines = ["[server]", 'models_dir = "."', "[defaults]", "max_queue = 4", "ping_interval_s = 0.2",
             "ping_timeout_s = 1.0", "cancel_timeout_s = 5.0", "shutdown_grace_s = 1.0",
             # restarts at once here; the crash backoff has its own tests (test_backoff_fake.py)
             "restart_backoff_s = 0", "max_crashes = 1000"]
    extra = {"burst": ["max_queue = 30"], "q2": ["max_queue = 2"], "deaf": ["cancel_timeout_s = 0.5"],
             "slowload": ["load_timeout_s = 0.5"], "hang": ["ping_timeout_s = 0.5"],
             "stubborn": ["shutdown_grace_s = 0.3"]}
    for m in MODELS:
        lines += [f"[models.{m}]", 'path = "m.gguf"', *extra.get(m, [])]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    dummy_gguf(module_tmp, "m.gguf")
    r = LiveRouter(module_tmp, _config())
    r.set_fake(SWITCHES)
    yield r
    # never two generations at once on any worker, across the whole module
    assert [e for e in r.fake_events("generate") if e["busy"]] == []
    r.stop()


def chat(model: str, content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **kw}


def worker_pid(router: LiveRouter, model: str) -> int:
    return int(router.wait_for(lambda: router.admin(model)["pid"], what=f"{model} pid"))


def spawns(router: LiveRouter, model: str) -> int:
    return sum(1 for e in router.fake_events("start") if e["argv"][1] == model)


async def _post(client: httpx.AsyncClient, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    return await client.post(path, json=body)


def test_burst_of_first_requests_spawns_one_worker(router: LiveRouter) -> None:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            return await asyncio.gather(*(_post(c, chat("burst", max_tokens=2)) for _ in range(20)))

    rs = asyncio.run(go())
    assert [r.status_code for r in rs] == [200] * 20
    assert spawns(router, "burst") == 1
    assert router.admin("burst")["spawn_count"] == 1


def admitted(router: LiveRouter, model: str) -> int:
    st = router.admin(model)
    return len(st["in_flight"]) + int(st["queue_depth"])


def test_queue_full_gets_503_at_once_counting_those_waiting_for_load(router: LiveRouter) -> None:
    # max_queue 2: one running + two waiting (here: all three waiting for a held load); the 4th is refused
    async def go() -> tuple[list[httpx.Response], dict[str, Any], float]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            with router.hold():
                first = [asyncio.create_task(_post(c, chat("q2", max_tokens=5))) for _ in range(3)]
                await router.until(lambda: admitted(router, "q2") == 3, what="three admitted")
                t0 = time.monotonic()
                fourth = await _post(c, chat("q2", max_tokens=5))
                dt = time.monotonic() - t0
                during = router.admin("q2")  # still loading: the 503 did not wait for anything
            return [*(await asyncio.gather(*first)), fourth], during, dt

    rs, during, dt = asyncio.run(go())
    assert during["state"] == "loading" and during["queue_depth"] == 3
    assert [r.status_code for r in rs[:3]] == [200, 200, 200]
    r = rs[3]
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "server_error",
                                 "param": None, "code": "queue_full"}
    report("503 queue_full answered", dt, 1.0)


def test_queue_full_while_ready(router: LiveRouter) -> None:
    async def go() -> tuple[list[httpx.Response], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            with router.hold():
                first = [asyncio.create_task(_post(c, chat("q2", "[hold]", max_tokens=3))) for _ in range(3)]
                await router.until(lambda: admitted(router, "q2") == 3, what="one running + two waiting")
                fourth = await _post(c, chat("q2", max_tokens=1))
                during = router.admin("q2")
            return [*(await asyncio.gather(*first)), fourth], during

    rs, during = asyncio.run(go())
    assert during["state"] == "ready" and len(during["in_flight"]) == 1 and during["queue_depth"] == 2
    assert [r.status_code for r in rs] == [200, 200, 200, 503]
    assert rs[3].json()["error"]["code"] == "queue_full"


def test_streaming_disconnect_mid_generation_frees_the_worker(router: LiveRouter) -> None:
    with httpx.Client(base_url=router.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=chat("dc", stream=True)) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    n += 1
                if n == 4:
                    break
        t0 = time.monotonic()
        r2 = c.post("/v1/chat/completions", json=chat("dc", max_tokens=1))
        dt = time.monotonic() - t0
    assert r2.status_code == 200
    print(f"\nnext request after a mid-stream disconnect done in {dt * 1000:.1f} ms")
    cancelled = router.fake_events("done", finish_reason="cancelled")
    assert cancelled and cancelled[-1]["n"] < 200  # stopped, not run to its 200 tokens


def test_non_streaming_disconnect_cancels(router: LiveRouter) -> None:
    n_cancel = len(router.fake_events("cancel"))
    with router.hold():  # the generation cannot finish before the client gives up
        with httpx.Client(base_url=router.url, timeout=0.4) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/chat/completions", json=chat("dc", "nonstream [hold]"))
        router.wait_for(lambda: len(router.fake_events("cancel")) > n_cancel, what="cancel")
        router.wait_for(lambda: router.admin("dc")["in_flight"] == [], what="worker free")


def test_disconnect_while_queued_leaves_the_queue(router: LiveRouter) -> None:
    async def go() -> tuple[httpx.Response, list[int]]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            with router.hold():
                a = asyncio.create_task(_post(c, chat("dc", "A [hold]", max_tokens=4)))
                await router.until(lambda: len(router.admin("dc")["in_flight"]) == 1, what="A running")
                b = asyncio.create_task(_post(c, chat("dc", "B-queued", max_tokens=2)))
                depth = [await router.until(lambda: router.admin("dc")["queue_depth"], what="B queued")]
                b.cancel()  # closes B's connection while it waits
                await router.until(lambda: router.admin("dc")["queue_depth"] == 0, what="B gone from the queue")
                depth.append(router.admin("dc")["queue_depth"])
            return await a, depth

    ra, depth = asyncio.run(go())
    assert ra.status_code == 200
    assert depth == [1, 0]
    assert not [e for e in router.fake_events("generate") if e["messages"][0]["content"] == "B-queued"]


@pytest.mark.reliability
def test_sigkill_mid_stream_gives_sse_error_and_next_request_succeeds(router: LiveRouter) -> None:
    with httpx.Client(base_url=router.url, timeout=30) as c:
        c.post("/admin/models/load", json={"model": "crash"}).raise_for_status()
        pid = worker_pid(router, "crash")
        events: list[Any] = []
        with c.stream("POST", "/v1/chat/completions", json=chat("crash", stream=True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    os.kill(pid, signal.SIGKILL)
        last = json.loads(events[-1])
        assert last["error"]["code"] == "worker_crashed"
        assert "signal 9" in last["error"]["message"]
        state = router.admin("crash")
        assert state["state"] == "failed" and state["last_exit_code"] == -9
        r2 = c.post("/v1/chat/completions", json=chat("crash", max_tokens=2))
        assert r2.status_code == 200 and r2.json()["choices"][0]["message"]["content"] == " w100 w101"
        assert worker_pid(router, "crash") != pid


@pytest.mark.reliability
def test_crash_mid_request_fails_it_and_the_waiting_one_runs_on_the_restarted_worker(router: LiveRouter) -> None:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            with router.hold():  # A cannot reach its crash until B is waiting behind it
                a = asyncio.create_task(_post(c, chat("crash", "[hold] [crash]", max_tokens=5)))
                await router.until(lambda: len(router.admin("crash")["in_flight"]) == 1, what="A running")
                b = asyncio.create_task(_post(c, chat("crash", "waiting", max_tokens=5)))
                await router.until(lambda: router.admin("crash")["queue_depth"] == 1, what="B waiting")
            return list(await asyncio.gather(a, b))

    before = spawns(router, "crash")
    ra, rb = asyncio.run(go())
    assert ra.status_code == 502 and ra.json()["error"]["code"] == "worker_crashed"
    # B had only waited: it runs on the restarted worker instead of failing
    assert rb.status_code == 200, rb.text
    assert rb.json()["choices"][0]["message"]["content"] == " w100 w101 w102 w103 w104"
    assert spawns(router, "crash") == before + 1
    assert router.admin("crash")["failures"]["last"]["exit_code"] == 9
    r = httpx.post(router.url + "/v1/chat/completions", json=chat("crash", max_tokens=1), timeout=30)
    assert r.status_code == 200


def test_load_failure_is_503_and_kept_as_failed_then_recovers(router: LiveRouter) -> None:
    router.set_fake({**SWITCHES, "broken": {"load_error": True}})
    r = httpx.post(router.url + "/v1/completions", json={"model": "broken", "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    assert "fake load failure" in r.json()["error"]["message"]
    st = router.admin("broken")
    assert st["state"] == "failed" and "fake load failure" in st["last_error"] and st["last_exit_code"] == 1
    # the client sees the file's name, never its absolute path (the operator's /admin and log keep it)
    gguf = st["path"]
    assert gguf.startswith("/") and gguf in st["last_error"]
    assert gguf not in r.text and f".../{Path(gguf).name}" in r.json()["error"]["message"]
    again = httpx.post(router.url + "/tokenize", json={"model": "broken", "content": "x"}, timeout=30)
    assert again.status_code == 503 and gguf not in again.text
    router.set_fake({**SWITCHES, "broken": {"crash_at_load": True}})
    r = httpx.post(router.url + "/admin/models/load", json={"model": "broken"}, timeout=30)
    assert r.status_code == 503 and router.admin("broken")["last_exit_code"] == 3
    router.set_fake(SWITCHES)
    r = httpx.post(router.url + "/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200
    assert router.admin("broken")["state"] == "ready"


def test_load_timeout(router: LiveRouter) -> None:
    router.set_fake({**SWITCHES, "slowload": {"hang_at_load": True}})
    r = httpx.post(router.url + "/v1/completions", json={"model": "slowload", "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and "load_timeout_s" in r.json()["error"]["message"]
    st = router.admin("slowload")
    assert st["state"] == "failed" and st["pid"] is None
    router.set_fake(SWITCHES)


@pytest.mark.reliability
def test_hung_worker_is_killed_and_the_stream_gets_an_error(router: LiveRouter) -> None:
    with httpx.Client(base_url=router.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=chat("hang", "[hang]", stream=True)) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    err = json.loads(data[-1])["error"]
    assert err["code"] == "worker_crashed" and "hung" in err["message"]
    assert router.admin("hang")["state"] == "failed"
    r2 = httpx.post(router.url + "/v1/chat/completions", json=chat("hang", max_tokens=1), timeout=30)
    assert r2.status_code == 200


def test_worker_ignoring_cancel_is_killed_after_cancel_timeout(router: LiveRouter) -> None:
    with httpx.Client(base_url=router.url, timeout=30) as c:
        c.post("/admin/models/load", json={"model": "deaf"}).raise_for_status()
        pid = worker_pid(router, "deaf")
        with c.stream("POST", "/v1/chat/completions", json=chat("deaf", stream=True)) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 3:
                    break
        router.wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
                        timeout=5, what="deaf worker killed")
        assert "Cancel" in (router.admin("deaf")["last_error"] or "")
        assert c.post("/v1/chat/completions", json=chat("deaf", max_tokens=1)).status_code == 200


def test_unload_while_running_lets_it_finish(router: LiveRouter) -> None:
    httpx.post(router.url + "/admin/models/load", json={"model": "drain"}, timeout=30).raise_for_status()
    pid = worker_pid(router, "drain")

    async def go() -> tuple[list[str], str | None, httpx.Response, httpx.Response, str]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            texts: list[str] = []
            finish: str | None = None

            async def stream() -> None:
                nonlocal finish
                async with c.stream("POST", "/v1/chat/completions", json=chat("drain", "[hold]", stream=True)) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            d = json.loads(line[6:])
                            texts.append(d["choices"][0]["delta"].get("content") or "")
                            finish = d["choices"][0]["finish_reason"] or finish

            with router.hold():
                running = asyncio.create_task(stream())
                await router.until(lambda: len(router.admin("drain")["in_flight"]) == 1, what="stream running")
                unload = asyncio.create_task(c.post("/admin/models/unload", json={"model": "drain"}))
                state = await router.until(lambda: router.admin("drain")["state"] == "draining" and "draining",
                                           what="draining")
                during = await _post(c, chat("drain"))  # a new request while it drains
            await running
            return texts, finish, await unload, during, state

    texts, finish, unload, during, state = asyncio.run(go())
    assert "".join(texts) == "".join(f" w{100 + i}" for i in range(40))  # the running request finished whole
    assert finish == "stop"
    assert state == "draining"
    assert unload.status_code == 200 and unload.json()["state"] == "unloaded"
    assert during.status_code == 503 and during.json()["error"]["code"] == "model_unloading"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert router.admin("drain")["state"] == "unloaded"


def test_unload_kills_a_worker_ignoring_shutdown(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/admin/models/load", json={"model": "stubborn"}, timeout=30)
    assert r.status_code == 200 and r.json()["load_ms"] >= 0 and r.json()["pid"]
    pid = r.json()["pid"]
    r = httpx.post(router.url + "/admin/models/unload", json={"model": "stubborn"}, timeout=30)
    assert r.status_code == 200
    assert alive([psutil.Process(pid)] if psutil.pid_exists(pid) else []) == []
    assert "Shutdown" in (router.admin("stubborn")["last_error"] or "")


def test_admin_listing(router: LiveRouter) -> None:
    httpx.post(router.url + "/v1/completions", json={"model": "plain", "prompt": "x", "max_tokens": 1}, timeout=30)
    data = httpx.get(router.url + "/admin/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == MODELS
    plain = next(m for m in data if m["id"] == "plain")
    assert plain["state"] == "ready" and plain["pid"] and plain["queue_depth"] == 0 and plain["in_flight"] == []
    assert plain["load_ms"] is not None and plain["last_used"] is not None and plain["last_error"] is None


def test_unload_while_loading_answers_the_waiting_requests(router: LiveRouter) -> None:
    async def go() -> tuple[httpx.Response, httpx.Response, dict[str, Any]]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            with router.hold():  # the load cannot finish while the unload arrives
                waiting = asyncio.create_task(_post(c, chat("lazy", max_tokens=1)))
                during = await router.until(
                    lambda: (st := router.admin("lazy"))["state"] == "loading" and st["queue_depth"] == 1
                    and st["pid"] and st, what="lazy loading with one waiting")
                unload = await c.post("/admin/models/unload", json={"model": "lazy"})
            return await waiting, unload, during

    waiting, unload, during = asyncio.run(go())
    assert during["state"] == "loading" and during["queue_depth"] == 1 and during["pid"]
    assert unload.status_code == 200 and unload.json()["state"] == "unloaded"
    assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "model_unloading"
    assert not psutil.pid_exists(during["pid"]) or psutil.Process(during["pid"]).status() == psutil.STATUS_ZOMBIE
    # and it loads again on demand
    r = httpx.post(router.url + "/v1/chat/completions", json=chat("lazy", max_tokens=1), timeout=30)
    assert r.status_code == 200 and router.admin("lazy")["spawn_count"] == 2


def test_unload_while_loading_answers_the_load_and_tokenize_waiters_as_unloaded(router: LiveRouter) -> None:
    """Requests that wait for the worker without a job slot (admin load, /tokenize) and whose load
    an operator unload ends were told 503 model_load_failed with the model's last error (a stale
    crash, say), not that it was unloaded."""
    r = httpx.post(router.url + "/admin/models/unload", json={"model": "lazy"}, timeout=30)
    assert r.status_code == 200 and router.admin("lazy")["state"] == "unloaded", r.text

    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            with router.hold():  # the load cannot finish while the unload arrives
                load = asyncio.create_task(c.post("/admin/models/load", json={"model": "lazy"}))
                tok = asyncio.create_task(c.post("/tokenize", json={"model": "lazy", "content": "hi"}))
                await router.until(lambda: router.admin("lazy")["state"] == "loading" and router.admin("lazy")["pid"],
                                   what="lazy loading")
                await asyncio.sleep(0.3)  # both are waiting for the load
                unload = await c.post("/admin/models/unload", json={"model": "lazy"})
            return await load, await tok, unload

    load, tok, unload = asyncio.run(go())
    assert unload.status_code == 200, unload.text
    for r in (load, tok):
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unloading", r.text
        assert "unloaded while loading" in r.json()["error"]["message"], r.text


def test_openai_sdk_raises_on_the_mid_stream_error_event(router: LiveRouter) -> None:
    import openai

    got: list[str] = []
    stream = router.client().chat.completions.create(
        model="crash", messages=[{"role": "user", "content": "[slow=0.05] [crash]"}], stream=True)
    with pytest.raises(openai.APIError) as e:
        for ch in stream:
            got.extend(c.delta.content or "" for c in ch.choices)
    assert "".join(got) == " w100"  # the partial text arrived before the error
    assert "worker" in str(e.value)
