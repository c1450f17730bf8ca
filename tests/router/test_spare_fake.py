"""The warm spare (``[server] warm_spare``, router.workers.launchers.local) against fake workers:
the first load takes it (the model is assigned then, never before) and a new one starts; it is
reported in /admin/models and the status page; off means no spare process at all; a spare that
dies is replaced with a growing backoff; a failed assignment is the model's load failure and a
new spare still comes; the router's SIGTERM and SIGKILL leave no spare behind; placement counts
the spare's memory as the next load's."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.router.conftest import LiveRouter, alive, dummy_gguf

CONFIG = """
[server]
models_dir = "."
warm_spare = true
[models.a]
path = "a.gguf"
[models.b]
path = "b.gguf"
"""


def spare(r: LiveRouter) -> dict[str, Any]:
    body = httpx.get(f"{r.url}/admin/models", timeout=10).json()
    return body["spare"]


def warm_spare(r: LiveRouter, not_pid: int | None = None, timeout: float = 30) -> dict[str, Any]:
    return r.wait_for(lambda: (s := spare(r))["state"] == "warm" and s["pid"] not in (None, not_pid) and s,
                      timeout, "a warm spare")


def complete(r: LiveRouter, model: str) -> httpx.Response:
    return httpx.post(f"{r.url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=30)


@pytest.fixture
def router(tmp_path: Path) -> Any:
    dummy_gguf(tmp_path, "a.gguf", "b.gguf")
    r = LiveRouter(tmp_path, CONFIG)
    yield r
    r.stop()
    r.kill()


def test_the_first_load_takes_the_warm_spare_and_a_new_one_starts(router: LiveRouter) -> None:
    r = router
    s1 = warm_spare(r)
    assert s1["enabled"] and s1["rss_bytes"] > 0 and s1["started"] == 1 and s1["taken"] == 0
    assert [p.pid for p in r.workers()] == [s1["pid"]]  # the spare is the only worker process
    assert r.fake_events("spare_hello") and r.fake_events("assigned") == []  # no model before a request
    assert r.admin("a")["state"] == "unloaded"

    assert complete(r, "a").status_code == 200
    a = r.admin("a")
    assert a["pid"] == s1["pid"] and a["from_spare"] is True and a["host"] == "localhost"
    assert [e["model"] for e in r.fake_events("assigned")] == ["a"]
    assert r.fake_events("hello") == []  # no worker was started for the model itself

    s2 = warm_spare(r, not_pid=s1["pid"])  # the replacement, once a's start is over
    assert s2["started"] == 2 and s2["taken"] == 1
    assert complete(r, "b").status_code == 200
    assert r.admin("b")["pid"] == s2["pid"] and r.admin("b")["from_spare"] is True
    warm_spare(r, not_pid=s2["pid"])
    assert len(alive(r.workers())) == 3  # a, b and the third spare

    status = httpx.get(f"{r.url}/ui/api/status", timeout=10).json()
    assert status["spare"]["state"] == "warm" and status["spare"]["taken"] == 2


def test_a_model_still_loads_while_the_spare_is_warming(router: LiveRouter) -> None:
    """A spare that has not said Hello is not taken: the model starts its own process."""
    r = router
    first = warm_spare(r)
    r.set_fake({"(spare)": {"spare_hold": True}})
    with r.hold():
        assert complete(r, "a").status_code == 200  # takes the warm one
        r.wait_for(lambda: spare(r)["started"] == 2, 30, "a replacement starting")
        assert spare(r)["state"] == "starting"
        assert complete(r, "b").status_code == 200  # the replacement is held before Hello
        assert r.admin("b")["from_spare"] is False and r.admin("a")["pid"] == first["pid"]
    warm_spare(r, not_pid=first["pid"])


def test_warm_spare_false_starts_no_spare(tmp_path: Path) -> None:
    dummy_gguf(tmp_path, "a.gguf", "b.gguf")
    r = LiveRouter(tmp_path, CONFIG.replace("warm_spare = true", "warm_spare = false"))
    try:
        s = spare(r)
        assert s["enabled"] is False and s["state"] == "off" and s["pid"] is None
        time.sleep(0.5)  # what would have started by now: nothing may
        assert r.workers() == [] and r.fake_events("start") == []
        assert complete(r, "a").status_code == 200
        assert r.admin("a")["from_spare"] is False and len(r.fake_events("hello")) == 1
        assert len(r.workers()) == 1
    finally:
        r.stop()


def test_a_spare_that_dies_is_replaced_with_a_growing_backoff(router: LiveRouter) -> None:
    r = router
    s1 = warm_spare(r)
    r.set_fake({"(spare)": {"spare_crash": True}})
    os.kill(s1["pid"], signal.SIGKILL)
    r.wait_for(lambda: len(r.fake_events("spare_crash")) >= 2, 30, "two crashed replacements")
    t_second = time.monotonic()
    s = r.wait_for(lambda: (s := spare(r))["consecutive_failures"] >= 3 and s, 10, "the third failure")
    # failures 1 (killed), 2 and 3 (crashed): the next start waits 2**(3-1) = 4 s
    assert s["state"] == "backoff" and 0 < s["retry_in_s"] <= 4.0 and "exited with code 4" in s["last_error"]
    assert time.monotonic() - t_second < 4.0 and len(r.fake_events("spare_crash")) == 2  # no busy loop
    r.set_fake({})
    s2 = warm_spare(r, not_pid=s1["pid"], timeout=30)
    assert s2["consecutive_failures"] == 3  # a streak ends when a spare is taken or stays up for a while
    assert complete(r, "a").status_code == 200 and r.admin("a")["pid"] == s2["pid"]
    assert spare(r)["consecutive_failures"] == 0


def test_a_failed_assignment_is_the_models_load_failure_and_a_new_spare_comes(router: LiveRouter) -> None:
    r = router
    s1 = warm_spare(r)
    r.set_fake({"a": {"load_error": True}})
    resp = complete(r, "a")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "model_load_failed"
    assert r.admin("a")["condition"] == "load_failed"
    s2 = warm_spare(r, not_pid=s1["pid"])
    assert s2["consecutive_failures"] == 0  # the model failed, not the spare
    r.set_fake({})
    assert complete(r, "b").status_code == 200 and r.admin("b")["pid"] == s2["pid"]


def test_sigterm_stops_the_spare(router: LiveRouter) -> None:
    r = router
    pid = warm_spare(r)["pid"]
    proc = psutil.Process(pid)
    assert r.stop() in (0, -signal.SIGTERM)
    deadline = time.monotonic() + 10
    while alive([proc]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive([proc]) == []
    assert r.fake_events("shutdown")  # asked politely first


@pytest.mark.reliability
def test_sigkill_of_the_router_leaves_no_spare(router: LiveRouter) -> None:
    r = router
    assert complete(r, "a").status_code == 200
    spare_pid = warm_spare(r, not_pid=r.admin("a")["pid"])["pid"]
    procs = alive(r.workers())
    assert spare_pid in [p.pid for p in procs] and len(procs) == 2
    os.kill(r.proc.pid, signal.SIGKILL)
    r.proc.wait(10)
    t0 = time.monotonic()
    while alive(procs) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert alive(procs) == []


# ----------------------------------------------------------------------------- placement's memory


class SpareMemory:
    """Made-up figures: a model's live worker takes ``rss[model]``, the warm spare (not yet
    taken) ``rss["(spare)"]``; available is ``total`` minus both."""

    def __init__(self, total: int, rss: dict[str, int]) -> None:
        self.total, self.rss_of = total, rss
        self.pool: Any = None

    def rss(self, pid: int | None, model: str) -> int | None:
        return self.rss_of[model] if pid is not None else None

    def available(self) -> int:
        from router.workers.lifecycle import WorkerState

        used = sum(self.rss_of[s.model.name] for s in self.pool.slots.values()
                   if s.state in (WorkerState.LOADING, WorkerState.READY, WorkerState.DRAINING))
        spare = self.pool.launcher._spare
        return self.total - used - (self.rss_of["(spare)"] if spare is not None and spare.alive else 0)


def test_placement_counts_the_spare_as_the_next_loads_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The spare's RSS is taken memory, but the next load takes the spare: a model that fits
    only with it loads (into it), and its seat then carries that memory as its worker's."""
    import asyncio

    from tests.router.inproc import InProc, until

    MiB = 2**20
    env = InProc(tmp_path, monkeypatch)
    cfg = ('[server]\nmodels_dir = "."\nwarm_spare = true\n[defaults]\nping_interval_s = 0\nkv_budget_mib = 100\n'
           '[models.a]\npath = "m.gguf"\n')
    mem = SpareMemory(total=0, rss={"(spare)": 150 * MiB, "a": 150 * MiB})

    async def go() -> None:
        async with env.app(cfg, memory=mem) as (pool, c):
            mem.pool = pool
            await until(lambda: pool.launcher.spare_pid() is not None, "a warm spare")
            need = pool.slots["a"].estimate().total
            mem.total = need + 150 * MiB - MiB  # without the spare's memory: 1 MiB short
            assert mem.available() == need - MiB and pool.spare_bytes() == 150 * MiB
            r = await c.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert pool.slots["a"].worker is not None and pool.slots["a"].worker.from_spare
            seat = pool.slots["a"].seat()
            assert seat is not None and seat.rss == 150 * MiB
            # taken: it is a's now, never counted twice (a replacement counts once it is warm)
            assert pool.launcher.spare_pid() != pool.slots["a"].worker.pid

    asyncio.run(go())
