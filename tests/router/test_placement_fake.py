"""Placement (router.workers.placement, Pool.place): max_loaded with LRU eviction of idle models,
drain-then-swap, pinning, and memory-aware loading — the decisions alone with made-up
figures, then through the router with fake workers and injected memory figures.
Waiting is on observed state only.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from protocol.weight_bytes import QUANTIZED_FORMS, VNNI_FORMS, host_has_vnni
from router.workers.lifecycle import WorkerState
from router.workers.placement import FILE_FACTOR, MiB, QUANTIZED_RUNTIME_BYTES, RUNTIME_BYTES, Estimate, Seat, decide, estimate
from router.workers.pool import Pool
from tests.router.conftest import GEMMA, SMOLLM2
from tests.router.inproc import InProc, chat, until

# ----------------------------------------------------------------------------- decisions alone

NEED = Estimate(weights=100 * MiB, kv_budget=100 * MiB, source="gguf")


def seat(name: str, *, state: str = "ready", idle: bool = True, pinned: bool = False, t: float = 0.0,
         rss: int = 0, est: int = 0) -> Seat:
    return Seat(name=name, state=state, idle=idle, pinned=pinned, last_active=t, rss=rss, estimate=est)


def test_room_means_load() -> None:
    assert decide("c", NEED, [seat("a")], max_loaded=2, available=None).action == "load"
    assert decide("c", NEED, [seat("a"), seat("b")], max_loaded=0, available=10**12).action == "load"


def test_max_loaded_evicts_the_least_recently_used_idle_model() -> None:
    d = decide("c", NEED, [seat("a", t=5), seat("b", t=3)], max_loaded=2, available=None)
    assert d.action == "wait" and d.evict == ("b",) and "max_loaded=2" in d.why
    # an idle one goes before a busy one, however recently used
    d = decide("c", NEED, [seat("a", t=1, idle=False), seat("b", t=9)], max_loaded=2, available=None)
    assert d.evict == ("b",)
    # all busy: wait for one to become idle (never cut a running generation)
    d = decide("c", NEED, [seat("a", idle=False), seat("b", idle=False)], max_loaded=2, available=None)
    assert d.action == "wait" and d.evict == () and "become idle" in d.why
    # one already draining: its place is coming, nothing more to evict
    d = decide("c", NEED, [seat("a", state="draining"), seat("b")], max_loaded=2, available=None)
    assert d.action == "wait" and d.evict == ()


def test_pinned_models_are_never_evicted() -> None:
    d = decide("c", NEED, [seat("a", pinned=True, t=0), seat("b", t=9)], max_loaded=2, available=None)
    assert d.evict == ("b",)
    d = decide("c", NEED, [seat("a", pinned=True), seat("b", pinned=True)], max_loaded=2, available=None)
    assert d.action == "refuse" and d.code == "max_loaded_reached" and "pinned" in d.why


def test_memory_evicts_enough_lru_idle_models_or_refuses_with_the_figures() -> None:
    seats = [seat("a", t=2, rss=400 * MiB), seat("b", t=1, rss=800 * MiB), seat("p", pinned=True, rss=900 * MiB)]
    d = decide("c", NEED, seats, max_loaded=0, available=50 * MiB)
    assert d.action == "wait" and d.evict == ("b",) and "memory" in d.why
    d = decide("c", NEED, seats, max_loaded=0, available=0)  # 200 MiB short after b: a too
    assert d.evict == ("b",) or d.evict == ("b", "a")
    big = Estimate(weights=2000 * MiB, kv_budget=2048 * MiB, source="measured")
    d = decide("c", big, seats, max_loaded=0, available=1000 * MiB)
    assert d.action == "refuse" and d.code == "insufficient_memory" and d.evict == ()
    assert "4048 MiB" in d.why and "weights 2000 MiB [measured]" in d.why and "KV budget 2048 MiB" in d.why
    assert "1000 MiB is available" in d.why and "free about 1200 MiB" in d.why and "pinned: p" in d.why


def test_memory_counts_what_is_coming_and_what_is_promised() -> None:
    # a draining model gives its RSS back: wait without evicting more
    d = decide("c", NEED, [seat("a", state="draining", rss=300 * MiB), seat("b", rss=500 * MiB)],
               max_loaded=0, available=100 * MiB)
    assert d.action == "wait" and d.evict == ()
    # a loading model will take the rest of its estimate: that is not available
    d = decide("c", NEED, [seat("a", state="loading", idle=False, rss=100 * MiB, est=900 * MiB)],
               max_loaded=0, available=900 * MiB)
    assert d.action == "wait" and d.evict == ()  # it may be evicted once ready and idle
    assert decide("c", NEED, [seat("a", state="loading", idle=False, rss=100 * MiB, est=300 * MiB)],
                  max_loaded=0, available=900 * MiB).action == "load"


def test_estimate_from_the_gguf_and_refined_by_measurement() -> None:
    e = estimate(SMOLLM2, None, None, weights="f32")
    assert e.source == "gguf" and e.kv_budget == 2048 * MiB and e.describe()["weights"] == "f32"
    assert e.weights == 134_515_008 * 4 + RUNTIME_BYTES  # SmolLM2-135M: 134.5 M weights as float32
    assert estimate(GEMMA, 512, None, weights="f32").weights == 268_098_176 * 4 + RUNTIME_BYTES
    assert estimate(SMOLLM2, 512, 2000 * MiB, weights="f32").source == "measured"  # more than computed: raises it
    assert estimate(SMOLLM2, 512, 50 * MiB, weights="f32").source == "gguf"  # lazily mapped weights: never lowers it


def test_a_quantized_estimate_counts_the_in_memory_forms() -> None:
    # the forms a worker on this host builds (the VNNI ones where the CPU has AVX512-VNNI);
    # tests/protocol/test_weight_bytes.py holds these sums to the loaded arrays
    forms = VNNI_FORMS if host_has_vnni() else QUANTIZED_FORMS

    def b(type_name: str, n: int) -> int:
        return n * forms[type_name][2] // forms[type_name][1]

    # SmolLM2 Q4_1: 28.3 M Q8_0 weights, 106.2 M Q4_1, 35 k F32 norms at 4 bytes
    q = estimate(SMOLLM2, 512, None, weights="quantized")
    assert q.source == "gguf" and q.describe()["weights"] == "quantized"
    assert q.weights == b("Q8_0", 28_311_552) + b("Q4_1", 106_168_320) + 35_136 * 4 + RUNTIME_BYTES + QUANTIZED_RUNTIME_BYTES
    f = estimate(SMOLLM2, 512, None, weights="f32")
    ratio = (f.weights - RUNTIME_BYTES) / (q.weights - RUNTIME_BYTES - QUANTIZED_RUNTIME_BYTES)
    # Q4_1: 20 bytes per 32 weights in the VNNI form (the GGUF block's), 40 in the reference one
    assert (5.3 < ratio < 5.9) if forms is VNNI_FORMS else (2.9 < ratio < 3.5)
    g = estimate(GEMMA, 512, None, weights="quantized")  # Q8_0, Q5_0, Q4_K, Q6_K, F32
    assert g.weights == (b("Q8_0", 169_246_720) + b("Q5_0", 63_406_080) + b("Q4_K", 23_592_960)
                         + b("Q6_K", 11_796_480) + 55_936 * 4 + RUNTIME_BYTES + QUANTIZED_RUNTIME_BYTES)
    with pytest.raises(ValueError, match="weights must be one of"):
        estimate(SMOLLM2, 512, None, weights="f16")


def test_an_unreadable_gguf_is_estimated_from_its_size_per_mode(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 1000)  # cut short after the magic: no tensor infos
    for mode in ("f32", "quantized"):
        e = estimate(junk, 512, None, weights=mode)
        extra = QUANTIZED_RUNTIME_BYTES if mode == "quantized" else 0
        assert e.source == "file" and e.weights == int(1004 * FILE_FACTOR[mode]) + RUNTIME_BYTES + extra


# ----------------------------------------------------------------------------- through the router


class FakeMemory:
    """Made-up figures: each live worker of a model takes ``rss[model]``; available is
    ``total`` minus what the live workers take."""

    def __init__(self, total: int, rss: dict[str, int]) -> None:
        self.total = total
        self.rss_of = rss
        self.pool: Pool | None = None

    def rss(self, pid: int | None, model: str) -> int | None:
        return self.rss_of.get(model, 10 * MiB) if pid is not None else None

    def available(self) -> int:
        assert self.pool is not None
        used = 0
        for s in self.pool.slots.values():
            if s.state in (WorkerState.LOADING, WorkerState.READY, WorkerState.DRAINING):
                used += self.rss_of.get(s.model.name, 10 * MiB)
        return self.total - used


def config(max_loaded: int, extra: dict[str, list[str]] | None = None, models: str = "abc") -> str:
    lines = ["[server]", 'models_dir = "."', f"max_loaded = {max_loaded}", "[defaults]", "ping_interval_s = 0",
             "kv_budget_mib = 100"]
    for m in models:
        lines += [f"[models.{m}]", 'path = "m.gguf"', *(extra or {}).get(m, [])]
    return "\n".join(lines) + "\n"


def spawns(env: InProc, model: str) -> int:
    import json
    if not env.fake_log.exists():
        return 0
    return sum(1 for line in env.fake_log.read_text().splitlines()
               if json.loads(line)["event"] == "start" and json.loads(line)["argv"][1] == model)


async def ask(c: httpx.AsyncClient, model: str, content: str = "hi") -> httpx.Response:
    return await c.post("/v1/chat/completions", json=chat(model, content))


def test_third_model_evicts_the_least_recently_used_idle_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config(2)) as (pool, c):
            assert (await ask(c, "a")).status_code == 200
            assert (await ask(c, "b")).status_code == 200
            assert (await ask(c, "a")).status_code == 200  # a is now the more recently used
            assert (await ask(c, "c")).status_code == 200
            assert pool.get("b").state is WorkerState.UNLOADED
            assert pool.get("a").state is WorkerState.READY and pool.get("c").state is WorkerState.READY
            st = next(m for m in (await c.get("/admin/models")).json()["data"] if m["id"] == "b")
            assert "evicted to make room for 'c'" in st["unload_reason"] and st["condition"] == "unloaded"
            metrics = (await c.get("/metrics")).text
            assert 'modelyard_model_evictions_total{model="b"} 1.0' in metrics
            assert 'modelyard_model_evictions_total{model="a"} 0.0' in metrics
            # b again: now a is the least recently used
            assert (await ask(c, "b")).status_code == 200
            assert pool.get("a").state is WorkerState.UNLOADED
            assert sum(s.seat() is not None for s in pool.slots.values()) == 2

    asyncio.run(go())


def test_burst_waits_for_busy_models_drains_then_swaps_and_loads_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config(2)) as (pool, c):
            with env.hold():
                running = [asyncio.create_task(ask(c, m, "[hold@1] go")) for m in "ab"]
                await until(lambda: all(len(pool.get(m).running_ids) == 1 for m in "ab"), "a and b running")
                burst = [asyncio.create_task(ask(c, "c")) for _ in range(6)]
                await until(lambda: pool.get("c").queue_depth == 6, "the burst queued")
                c_st = pool.get("c")
                assert c_st.state is WorkerState.UNLOADED and "become idle" in (c_st.placing.waiting_for or "")
                assert pool.get("a").state is WorkerState.READY and pool.get("b").state is WorkerState.READY
            rs = await asyncio.gather(*running, *burst)
            assert [r.status_code for r in rs] == [200] * 8
            for r in rs[:2]:  # never cut: the running generations finished in full
                assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            assert spawns(env, "c") == 1 and pool.get("c").loader.spawn_count == 1
            assert pool.get("c").state is WorkerState.READY
            assert [pool.get(m).state for m in "ab"].count(WorkerState.UNLOADED) == 1

    asyncio.run(go())


def test_a_request_for_an_evicted_model_waits_and_reloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"a": {"hold_shutdown": True}})  # a's eviction lasts until the test lets go

    async def go() -> None:
        async with env.app(config(2)) as (pool, c):
            assert (await ask(c, "a")).status_code == 200
            assert (await ask(c, "b")).status_code == 200
            with env.hold():
                cr = asyncio.create_task(ask(c, "c"))
                await until(lambda: pool.get("a").state is WorkerState.DRAINING, "a evicted")
                ar = asyncio.create_task(ask(c, "a"))  # not refused: waits, then loads a again
                await until(lambda: pool.get("a").queue_depth == 1, "a's request waiting")
            assert (await cr).status_code == 200 and (await ar).status_code == 200
            assert pool.get("a").loader.spawn_count == 2 and pool.get("b").state is WorkerState.UNLOADED

    asyncio.run(go())


def test_pinned_is_never_evicted_nor_idle_unloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    cfg = config(2, {"a": ["pinned = true", "idle_ttl_s = 0.05"], "b": ["idle_ttl_s = 0.05"]}, models="abc")

    async def go() -> None:
        async with env.app(cfg) as (pool, c):
            assert (await ask(c, "a")).status_code == 200
            assert (await ask(c, "b")).status_code == 200
            await until(lambda: pool.get("b").state is WorkerState.UNLOADED, "b unloaded for idleness")
            assert pool.get("a").state is WorkerState.READY  # same idle_ttl_s, but pinned
            assert (await ask(c, "b")).status_code == 200
            assert (await ask(c, "c")).status_code == 200  # a is the LRU one, but pinned: b goes
            assert pool.get("a").state is WorkerState.READY and pool.get("b").state is WorkerState.UNLOADED
            st = next(m for m in (await c.get("/admin/models")).json()["data"] if m["id"] == "a")
            assert st["placement"]["pinned"] is True

    asyncio.run(go())


def test_all_pinned_refuses_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    cfg = config(1, {"a": ["pinned = true"]}, models="ab")

    async def go() -> None:
        async with env.app(cfg) as (pool, c):
            assert (await ask(c, "a")).status_code == 200
            r = await ask(c, "b")
            assert r.status_code == 503 and r.json()["error"]["code"] == "max_loaded_reached"
            assert "retry-after" in r.headers and pool.get("b").loader.spawn_count == 0

    asyncio.run(go())


def test_memory_evicts_lru_idle_then_refuses_with_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    # each model's estimate: ~96 MiB runtime allowance + its KV budget (the fake GGUF has no weights)
    mem = FakeMemory(total=3000 * MiB, rss={"a": 1200 * MiB, "b": 1200 * MiB, "c": 1200 * MiB})
    cfg = config(0, {"a": ["kv_budget_mib = 1000"], "b": ["kv_budget_mib = 1000"], "c": ["kv_budget_mib = 1000"],
                     "huge": ["kv_budget_mib = 100000"]}, models=["a", "b", "c", "huge"])  # type: ignore[arg-type]

    async def go() -> None:
        async with env.app(cfg, memory=mem) as (pool, c):
            mem.pool = pool
            assert (await ask(c, "a")).status_code == 200
            assert (await ask(c, "b")).status_code == 200  # 3000 - 1200 = 1800 >= ~1096
            assert (await ask(c, "c")).status_code == 200  # 600 available: a (LRU, idle) goes
            assert pool.get("a").state is WorkerState.UNLOADED and "evicted" in (pool.get("a").unloader.unload_reason or "")
            st = next(m for m in (await c.get("/admin/models")).json()["data"] if m["id"] == "b")
            pl = st["placement"]
            assert pl["rss_after_load_bytes"] == 1200 * MiB and pl["rss_peak_bytes"] == 1200 * MiB
            assert pl["estimate"]["source"] == "measured" and pl["estimate"]["weights_bytes"] == 1200 * MiB
            assert pl["estimate"]["kv_budget_bytes"] == 1000 * MiB and st["rss_bytes"] == 1200 * MiB

            r = await ask(c, "huge")
            assert r.status_code == 503 and r.json()["error"]["code"] == "insufficient_memory"
            msg = r.json()["error"]["message"]
            assert "KV budget 100000 MiB" in msg and "600 MiB is available" in msg and "2400 MiB" in msg
            assert pool.get("huge").loader.spawn_count == 0
            assert pool.get("b").state is WorkerState.READY and pool.get("c").state is WorkerState.READY
            metrics = (await c.get("/metrics")).text
            assert 'modelyard_rejections_total{model="huge",reason="insufficient_memory"} 1.0' in metrics

    asyncio.run(go())


def test_a_quantized_model_is_placed_by_what_its_worker_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the same real GGUF (SmolLM2, header read by the router) served twice: quantized, ~228 MiB
    # (VNNI forms) or ~293 MiB (reference forms) + KV 100 MiB, fits in 600 MiB; float32, ~609 MiB +
    # KV, does not even with the other one evicted
    env = InProc(tmp_path, monkeypatch)
    mem = FakeMemory(total=600 * MiB, rss={"q": 200 * MiB, "f": 200 * MiB})
    cfg = (config(0, models="") + f'[models.q]\npath = "{SMOLLM2}"\nweights = "quantized"\n'
           f'[models.f]\npath = "{SMOLLM2}"\nweights = "f32"\n')

    async def go() -> None:
        async with env.app(cfg, memory=mem) as (pool, c):
            mem.pool = pool
            assert (await ask(c, "q")).status_code == 200
            est = pool.get("q").estimate()
            assert est.source == "gguf" and est.mode == "quantized" and 200 * MiB < est.weights < 300 * MiB
            r = await ask(c, "f")
            assert r.status_code == 503 and r.json()["error"]["code"] == "insufficient_memory"
            msg = r.json()["error"]["message"]
            assert "weights 609 MiB [gguf]" in msg and "400 MiB is available" in msg, msg
            assert pool.get("f").loader.spawn_count == 0 and pool.get("q").state is WorkerState.READY

    asyncio.run(go())


def test_operator_load_and_unload_while_waiting_for_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config(1, models="ab")) as (pool, c):
            with env.hold():
                ar = asyncio.create_task(ask(c, "a", "[hold@1] x"))
                await until(lambda: len(pool.get("a").running_ids) == 1, "a running")
                assert (await c.post("/models/load", json={"model": "b"})).json() == {"success": True}
                assert (await c.post("/models/load", json={"model": "b"})).status_code == 400  # asked already
                assert pool.get("b").placing.waiting_for is not None and pool.get("b").loader.spawn_count == 0
                br = asyncio.create_task(ask(c, "b"))
                await until(lambda: pool.get("b").queue_depth == 1, "b's request waiting")
                # an operator unload of b cancels the wanted load: its waiting request gets 503
                assert (await c.post("/admin/models/unload", json={"model": "b"})).status_code == 200
                r = await br
                assert r.status_code == 503 and r.json()["error"]["code"] == "model_unloading"
                assert pool.get("b").placing.waiting_for is None
            assert (await ar).status_code == 200
            assert pool.get("b").loader.spawn_count == 0 and pool.get("a").state is WorkerState.READY

    asyncio.run(go())


def test_never_more_than_max_loaded_under_concurrent_bursts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bursts to three models at once with max_loaded = 1: every request is answered, each
    model loads once per turn, and — replaying every state transition in the order it
    happened — never two models hold a worker at the same time."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config(1, {m: ["max_queue = 20"] for m in "abc"})) as (pool, c):
            q = pool.events.subscribe()
            rs = await asyncio.gather(*(ask(c, m) for _ in range(5) for m in "abc"))
            assert [r.status_code for r in rs] == [200] * 15
            holding: set[str] = set()
            peak = 0
            while not q.empty():
                ev = q.get_nowait()
                assert ev is not None
                if ev["event"] != "state":
                    continue
                if ev["to"] in ("loading", "ready", "draining"):
                    holding.add(ev["model"])
                else:
                    holding.discard(ev["model"])
                peak = max(peak, len(holding))
            assert peak == 1
            assert [pool.get(m).loader.spawn_count for m in "abc"] == [1, 1, 1]  # each burst loaded its model once

    asyncio.run(go())
