"""Crash backoff (router.workers.backoff) against fake workers, with an injected clock.

A crashed model restarts on the next request once its backoff has passed; before
that requests get 503 ``restart_backoff`` with a Retry-After equal to the remaining
wait; the wait doubles per failure within ``crash_window_s`` up to
``restart_backoff_max_s``; ``max_crashes`` failures within the window make the model
``failed`` until an operator loads it. /admin/models tells never loaded, unloaded
and crashed apart (exit code, signal, time, count). Time moves only by the test.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from router.workers.backoff import CrashHistory, CrashPolicy, Failure
from router.workers.pool import Pool
from router.workers.lifecycle import WorkerState
from tests.router.inproc import FakeClock, InProc, chat, until

CONFIG = """
[server]
models_dir = "."
[defaults]
ping_interval_s = 0
restart_backoff_s = 10
restart_backoff_max_s = 30
max_crashes = 4
crash_window_s = 100
[models.m]
path = "m.gguf"
[models.other]
path = "m.gguf"
"""


# ----------------------------------------------------------------------------- the policy alone


def test_policy_doubles_up_to_the_cap() -> None:
    p = CrashPolicy(base_s=1.0, max_s=5.0, max_crashes=10, window_s=60)
    assert [p.delay(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert CrashPolicy(base_s=0.0).delay(3) == 0.0


def test_history_window_gate_and_operator_reset() -> None:
    h = CrashHistory(CrashPolicy(base_s=2.0, max_s=100.0, max_crashes=3, window_s=50))
    f = Failure("crashed", "worker crashed", -9, 0.0)
    h.record(0.0, f)
    assert h.remaining(0.0) == 2.0 and h.retry_after(0.5) == 2 and h.retry_after(1.0) == 1
    assert h.remaining(2.0) == 0.0
    h.record(10.0, f)
    assert h.remaining(10.0) == 4.0
    h.record(70.0, f)  # the first two are out of the window: this is failure 1 again
    assert h.in_window(70.0) == 1 and h.remaining(70.0) == 2.0 and not h.given_up
    h.record(71.0, f)
    h.record(72.0, f)
    assert h.given_up and h.in_window(72.0) == 3 and h.total == 5 and h.crashes == 5
    h.operator_reset()
    assert not h.given_up and h.in_window(72.0) == 0 and h.remaining(72.0) == 0.0 and h.total == 5
    assert f.signal == "SIGKILL" and Failure("crashed", "", 3, 0.0).signal is None


# ----------------------------------------------------------------------------- through the router


async def _crash(pool: Pool, name: str) -> int:
    """SIGKILL the ready worker of ``name``; returns its pid once the model is failed."""
    slot = pool.get(name)
    assert slot.state is WorkerState.READY and slot.worker is not None and slot.worker.pid is not None
    pid = slot.worker.pid
    os.kill(pid, signal.SIGKILL)
    await until(lambda: slot.state is WorkerState.FAILED, "the crash to be noticed")
    return pid


async def _admin(c, name: str) -> dict:  # type: ignore[no-untyped-def]
    data = (await c.get("/admin/models")).json()["data"]
    return next(m for m in data if m["id"] == name)


def test_backoff_retry_after_doubling_cap_and_giving_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    clock = FakeClock()

    async def go() -> None:
        async with env.app(CONFIG, clock=clock) as (pool, c):
            assert (await _admin(c, "m"))["condition"] == "never_loaded"
            assert (await c.post("/v1/chat/completions", json=chat("m"))).status_code == 200
            pid = await _crash(pool, "m")
            st = await _admin(c, "m")
            assert st["state"] == "failed" and st["condition"] == "crashed"
            assert st["failures"]["count"] == 1 and st["failures"]["crashes"] == 1
            assert st["failures"]["last"]["signal"] == "SIGKILL" and st["failures"]["last"]["exit_code"] == -9
            assert st["failures"]["last"]["at"] > 0 and st["failures"]["restart_in_s"] == 10.0

            r = await c.post("/v1/chat/completions", json=chat("m"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "restart_backoff"
            assert r.headers["retry-after"] == "10"
            clock.advance(4)
            r = await c.post("/v1/chat/completions", json=chat("m"))
            assert r.status_code == 503 and r.headers["retry-after"] == "6"
            assert (await c.get("/health", params={"model": "m"})).headers["retry-after"] == "6"
            assert pool.get("m").loader.spawn_count == 1  # nothing was started during the backoff
            assert (await c.post("/v1/chat/completions", json=chat("other"))).status_code == 200  # others unaffected
            clock.advance(6)
            r = await c.post("/v1/chat/completions", json=chat("m"))
            assert r.status_code == 200
            assert pool.get("m").worker.pid != pid and pool.get("m").loader.spawn_count == 2

            await _crash(pool, "m")  # second within the window: 20 s
            r = await c.post("/v1/chat/completions", json=chat("m"))
            assert r.status_code == 503 and r.headers["retry-after"] == "20"
            clock.advance(20)
            assert (await c.post("/v1/chat/completions", json=chat("m"))).status_code == 200
            await _crash(pool, "m")  # third: 40 s, capped at 30
            r = await c.post("/v1/chat/completions", json=chat("m"))
            assert r.headers["retry-after"] == "30"
            clock.advance(30)
            assert (await c.post("/v1/chat/completions", json=chat("m"))).status_code == 200
            await _crash(pool, "m")  # fourth within 100 s: failed until an operator loads it

            st = await _admin(c, "m")
            assert st["condition"] == "failed" and st["failures"]["given_up"] is True
            clock.advance(1000)  # time alone does not bring it back
            r = await c.post("/v1/chat/completions", json=chat("m"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_failed"
            assert "retry-after" not in r.headers and "operator" in r.json()["error"]["message"]
            assert pool.get("m").loader.spawn_count == 4
            r = await c.post("/admin/models/load", json={"model": "m"})
            assert r.status_code == 200 and pool.get("m").state is WorkerState.READY
            st = await _admin(c, "m")
            assert st["condition"] == "ready" and st["failures"]["count"] == 4 and st["failures"]["in_window"] == 0
            assert (await c.post("/v1/chat/completions", json=chat("m"))).status_code == 200

    asyncio.run(go())


def test_window_forgets_old_crashes_and_operator_load_skips_the_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    clock = FakeClock()

    async def go() -> None:
        async with env.app(CONFIG, clock=clock) as (pool, c):
            assert (await c.post("/v1/chat/completions", json=chat("m"))).status_code == 200
            await _crash(pool, "m")
            clock.advance(150)  # past crash_window_s: the next crash is the first again
            assert (await c.post("/v1/chat/completions", json=chat("m"))).status_code == 200
            await _crash(pool, "m")
            r = await c.post("/v1/chat/completions", json=chat("m"))
            assert r.headers["retry-after"] == "10"
            # llama.cpp's POST /models/load is an operator's: no wait
            assert (await c.post("/models/load", json={"model": "m"})).json() == {"success": True}
            await until(lambda: pool.get("m").state is WorkerState.READY, "operator load")
            assert (await c.post("/v1/chat/completions", json=chat("m"))).status_code == 200

    asyncio.run(go())


def test_failed_loads_back_off_too_and_unloaded_is_not_crashed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    clock = FakeClock()
    env.set_fake({"m": {"crash_at_load": True}})

    async def go() -> None:
        async with env.app(CONFIG, clock=clock) as (pool, c):
            r = await c.post("/v1/chat/completions", json=chat("m"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
            assert r.headers["retry-after"] == "10"
            st = await _admin(c, "m")
            assert st["condition"] == "load_failed" and st["failures"]["last"]["exit_code"] == 3
            r = await c.post("/v1/chat/completions", json=chat("m"))
            assert r.json()["error"]["code"] == "restart_backoff" and pool.get("m").loader.spawn_count == 1
            env.set_fake({})
            clock.advance(10)
            assert (await c.post("/v1/chat/completions", json=chat("m"))).status_code == 200
            assert (await c.post("/admin/models/unload", json={"model": "other"})).status_code == 200
            assert (await _admin(c, "other"))["condition"] == "never_loaded"
            assert (await c.post("/v1/chat/completions", json=chat("other"))).status_code == 200
            assert (await c.post("/admin/models/unload", json={"model": "other"})).status_code == 200
            st = await _admin(c, "other")
            assert st["condition"] == "unloaded" and st["failures"]["count"] == 0

    asyncio.run(go())
