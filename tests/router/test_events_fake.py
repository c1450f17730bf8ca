"""Model events (router.workers.events, GET /admin/events) against fake workers: every state
change, load progress (spawned, connected, still loading, ready), waiting for room,
eviction, unloading, crashes and giving up — in the order they happened; the SSE
stream's framing, its snapshot, and its end when the router stops."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

import router.workers.loading
from tests.router.conftest import LiveRouter, dummy_gguf
from tests.router.inproc import FakeClock, InProc, chat, until

CONFIG = """
[server]
models_dir = "."
max_loaded = 1
[defaults]
ping_interval_s = 0
restart_backoff_s = 100
restart_backoff_max_s = 100
max_crashes = 2
[models.a]
path = "m.gguf"
[models.b]
path = "m.gguf"
"""


def kinds(evs: list[dict[str, Any]], model: str) -> list[str]:
    out = []
    for e in evs:
        if e["model"] != model:
            continue
        if e["event"] == "state":
            out.append(f"{e['from']}->{e['to']}")
        elif e["event"] == "loading":
            out.append(f"loading:{e['stage']}")
        else:
            out.append(e["event"])
    return out


def test_events_tell_the_whole_story_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    monkeypatch.setattr(router.workers.loading, "LOAD_PROGRESS_INTERVAL_S", 0.02)
    env.set_fake({"a": {"hold_load": True}})
    clock = FakeClock()

    async def go() -> None:
        async with env.app(CONFIG, clock=clock) as (pool, c):
            q = pool.events.subscribe()
            got: list[dict[str, Any]] = []

            def drain() -> list[dict[str, Any]]:
                while not q.empty():
                    ev = q.get_nowait()
                    assert ev is not None
                    got.append(ev)
                return got

            with env.hold():  # a's load stays in progress until a 'still loading' has been said
                ar = asyncio.create_task(c.post("/v1/chat/completions", json=chat("a")))
                await until(lambda: "loading:still_loading" in kinds(drain(), "a"), "a slow load's progress")
            assert (await ar).status_code == 200
            assert (await c.post("/v1/chat/completions", json=chat("b"))).status_code == 200
            b = pool.get("b")
            assert b.worker is not None and b.worker.pid is not None
            os.kill(b.worker.pid, signal.SIGKILL)
            await until(lambda: "crashed" in kinds(drain(), "b"), "b's crash")
            clock.advance(100)  # the backoff is over: the next request restarts b
            assert (await c.post("/v1/chat/completions", json=chat("b"))).status_code == 200
            os.kill(pool.get("b").worker.pid, signal.SIGKILL)  # the second within the window: failed
            await until(lambda: "failed" in kinds(drain(), "b"), "b given up")
            drain()

            ka = kinds(got, "a")
            i = ka.index("unloaded->loading")
            assert ka[i:i + 2] == ["unloaded->loading", "loading:spawned"]
            j = ka.index("loading->ready")
            assert ka[j + 1] == "loading:ready" and j > i
            assert set(ka[i + 2:j]) == {"loading:connected", "loading:still_loading"}
            assert ka[j + 2:] == ["evicted", "ready->draining", "unloading", "draining->unloaded"]
            kb = kinds(got, "b")
            assert kb[:2] == ["waiting", "unloaded->loading"]  # b waited for a's place
            k = kb.index("crashed")
            assert kb[k + 1] == "ready->failed"
            assert kb[-3:] == ["crashed", "failed", "ready->failed"]
            ev = next(e for e in got if e["event"] == "crashed")
            assert ev["exit_code"] == -9 and ev["signal"] == "SIGKILL" and ev["restart_in_s"] == 100
            ev = next(e for e in got if e["event"] == "evicted")
            assert ev["model"] == "a" and ev["for"] == "b"
            assert next(e for e in got if e["event"] == "waiting")["why"].startswith("waiting for room (max_loaded=1)")
            seqs = [e["seq"] for e in got]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            ready = next(e for e in got if e["event"] == "loading" and e["stage"] == "ready")
            assert ready["rss_bytes"] > 0 and "load_ms" in ready

    asyncio.run(go())


def test_worker_load_steps_reach_events_and_console(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    env = InProc(tmp_path, monkeypatch)
    monkeypatch.setattr(router.workers.loading, "LOAD_PROGRESS_INTERVAL_S", 0.02)
    env.set_fake({"a": {"hold_load": True, "load_steps": 7}})
    caplog.set_level("INFO", logger="modelyard")

    async def go() -> None:
        async with env.app(CONFIG) as (pool, c):
            q = pool.events.subscribe()
            got: list[dict[str, Any]] = []

            def drain() -> list[dict[str, Any]]:
                while not q.empty():
                    ev = q.get_nowait()
                    assert ev is not None
                    got.append(ev)
                return got

            with env.hold():  # the load is held after its last step: a tick must name that step
                ar = asyncio.create_task(c.post("/v1/chat/completions", json=chat("a")))
                await until(lambda: any(e.get("last") == "preparing_tensors 7/7" for e in drain()),
                            "a still-loading tick naming the last step")
            assert (await ar).status_code == 200
            drain()
            steps = [(e["stage"], e["done"], e["total"]) for e in got if e["event"] == "loading" and "total" in e]
            assert steps == [("reading_gguf", 0, 1), ("reading_gguf", 1, 1)] + [
                ("preparing_tensors", i, 7) for i in range(1, 8)]
            stages = [e["stage"] for e in got if e["event"] == "loading"]
            assert stages.index("connected") < stages.index("reading_gguf") and stages[-1] == "ready"

    asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model a:")]
    assert any("reading gguf 0/1" in x for x in lines) and any("preparing tensors 7/7" in x for x in lines)
    assert any("still loading" in x and "preparing tensors 7/7" in x for x in lines)
    assert not any("preparing tensors 3/7" in x for x in lines)  # the console: a stage's start and end


def test_sse_stream_snapshot_framing_and_end_at_shutdown(tmp_path: Path) -> None:
    dummy_gguf(tmp_path, "m.gguf")
    r = LiveRouter(tmp_path, CONFIG.replace("max_loaded = 1", "admin_key = \"adm\""))
    raw: list[str] = []
    ended = threading.Event()

    def read() -> None:
        try:
            with httpx.stream("GET", r.url + "/admin/events", headers={"Authorization": "Bearer adm"},
                              timeout=60) as resp:
                assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                for line in resp.iter_lines():
                    raw.append(line)
        finally:
            ended.set()

    try:
        assert httpx.get(r.url + "/admin/events", timeout=10).status_code == 401  # the admin key guards it
        t = threading.Thread(target=read, daemon=True)
        t.start()
        r.wait_for(lambda: sum(1 for x in raw if x == "event: snapshot") == 2, what="the snapshot")
        httpx.post(r.url + "/v1/chat/completions", json=chat("a"), timeout=30).raise_for_status()
        r.wait_for(lambda: any('"stage":"ready"' in x for x in raw), what="a ready")
        data = [json.loads(x[6:]) for x in raw if x.startswith("data: ")]
        events = [x[7:] for x in raw if x.startswith("event: ")]
        assert events == [d["event"] for d in data]  # each event: an event line, then its data
        assert data[0]["state"] == "unloaded" and data[0]["condition"] == "never_loaded"
        assert r.stop() in (0, -signal.SIGTERM)
        assert ended.wait(30)  # the stream ended with the router, it did not hold the shutdown
    finally:
        r.kill()


def test_a_fingerprint_announced_after_ready_reaches_system_fingerprint(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker still hashing its file sends Ready with no fingerprint, then again with it: requests
    are served at once (no system_fingerprint), and the fingerprint shows once announced."""
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"a": {"late_fingerprint": True}})

    async def go() -> None:
        async with env.app(CONFIG) as (pool, c):
            with env.hold():  # the worker's "hash" stays in progress
                r = await c.post("/v1/chat/completions", json=chat("a"))
                assert r.status_code == 200 and r.json()["system_fingerprint"] is None
            await until(lambda: pool.get("a").worker.ready.fingerprint == "f" * 64, "the router took it")
            r = await c.post("/v1/chat/completions", json=chat("a"))
            assert r.status_code == 200 and r.json()["system_fingerprint"] == "fp_" + "f" * 12

    asyncio.run(go())
