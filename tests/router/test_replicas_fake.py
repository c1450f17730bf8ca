"""A model with ``replicas = 2`` (``router.workers.replicas``, ``router.serving.routing``), fake
workers on this host: both replicas start with the first request, /admin/models, /models,
/slots and /metrics show each replica and the model as a whole, a conversation's next turn goes
to the replica that ran its first, a lost replica's waiting requests move to the other and the
lost one is placed again, /admin load / unload and Ollama's
keep_alive 0 act on every replica."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from router.serving.server import server_of
from router.workers.lifecycle import WorkerState
from router.workers.pool import Pool
from tests.router.inproc import InProc, until

pytestmark = pytest.mark.timeout(120)


def config(replicas: int = 2, routing: str = "cache_aware", extra: str = "") -> str:
    return ('[server]\nmodels_dir = "."\n[defaults]\nping_interval_s = 0\n'
            f'[models.m]\npath = "m.gguf"\nreplicas = {replicas}\nrouting = "{routing}"\nrestart_backoff_s = 0.2\n'
            + extra)


def words(tag: str, n: int = 40) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def convo(tag: str, *turns: str) -> dict[str, Any]:
    msgs: list[dict[str, str]] = []
    for i, t in enumerate(turns):
        if i:
            msgs.append({"role": "assistant", "content": f"answer {tag}"})
        msgs.append({"role": "user", "content": t})
    return {"model": "m", "messages": msgs, "max_tokens": 2}


def served_by(pool: Pool) -> list[int]:
    """The replica number of each request the model released, oldest first."""
    return [r.replica.replica if r.replica is not None else -1 for r in server_of(pool.get("m")).recent]


def test_both_replicas_start_and_every_view_shows_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config()) as (pool, c):
            assert pool.replica_set("m") is not None and len(pool.every_slot()) == 2
            r = await c.post("/v1/chat/completions", json=convo("a", words("a")))
            assert r.status_code == 200, r.text
            rs = pool.replica_set("m")
            assert rs is not None
            await until(lambda: all(s.state is WorkerState.READY for s in rs.slots), "both replicas ready")
            row = next(m for m in (await c.get("/admin/models")).json()["data"] if m["id"] == "m")
            assert row["state"] == "ready" and row["routing"] == "cache_aware"
            assert [x["replica"] for x in row["replicas"]] == [0, 1]
            assert all(x["state"] == "ready" and x["node"] == "localhost" and x["pid"] for x in row["replicas"])
            assert row["replicas"][0]["pid"] != row["replicas"][1]["pid"]
            # each worker's memory, and the model's as the sum of its replicas'
            rss = [x["rss_bytes"] for x in row["replicas"]]
            assert all(rss) and row["rss_bytes"] == sum(rss)
            from router.cli_client import ps_rows

            ps = ps_rows((await c.get("/admin/models")).json()["data"], 0.0)
            assert ps[1][2] == f'{row["replicas"][0]["pid"]},{row["replicas"][1]["pid"]}'  # modelyard ps: both pids
            listed = next(m for m in (await c.get("/models")).json()["data"] if m["id"] == "m")
            assert [x["replica"] for x in listed["status"]["replicas"]] == [0, 1]
            slots = (await c.get("/slots", params={"model": "m"})).json()
            assert sorted({s["replica"] for s in slots}) == [0, 1]
            metrics = (await c.get("/metrics")).text
            assert 'modelyard_model_state{model="m",state="ready"} 1.0' in metrics
            assert 'modelyard_replica_state{model="m",node="localhost",replica="1",state="ready"} 1.0' in metrics
            assert metrics.count('modelyard_replica_slots_total{model="m"') == 2

    asyncio.run(go())


def by_conversation(pool: Pool) -> dict[str, list[int]]:
    """Each conversation (its first message) -> the replicas its turns ran on, in order."""
    out: dict[str, list[int]] = {}
    for r in server_of(pool.get("m")).recent:
        assert r.msg is not None and r.msg.messages and r.replica is not None
        out.setdefault(str(r.msg.messages[0]["content"]), []).append(r.replica.replica)
    return out


def test_a_conversations_next_turn_goes_where_its_first_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"*": {"max_jobs": 2}})

    async def go() -> None:
        async with env.app(config()) as (pool, c):
            assert (await c.post("/admin/models/load", json={"model": "m"})).status_code == 200
            tags = [f"c{i}" for i in range(6)]
            # first turns at once: least loaded spreads them over both replicas
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=convo(t, words(t))) for t in tags))
            assert all(r.status_code == 200 for r in rs)
            first = {k: v[0] for k, v in by_conversation(pool).items()}
            replicas = pool.replica_set("m")
            assert replicas is not None  # the workers' KV events (blocks of 4 ids, the fake's) fed the indexes
            assert all(s.prefix.block_size == 4 and len(s.prefix) > 0 for s in replicas.slots)
            assert set(first.values()) == {0, 1}, first
            for t in reversed(tags):  # second turns one by one: both replicas idle, the cache decides
                r = await c.post("/v1/chat/completions", json=convo(t, words(t), "and then?"))
                assert r.status_code == 200
            turns = by_conversation(pool)
            assert all(v == [v[0], v[0]] for v in turns.values()), turns

    asyncio.run(go())


def test_round_robin_alternates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config(routing="round_robin")) as (pool, c):
            assert (await c.post("/admin/models/load", json={"model": "m"})).status_code == 200
            for t in "abcd":
                assert (await c.post("/v1/chat/completions", json=convo(t, words(t)))).status_code == 200
            assert served_by(pool) == [0, 1, 0, 1]

    asyncio.run(go())


def test_a_lost_replicas_waiting_requests_move_and_it_is_placed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"*": {"max_jobs": 1}})

    async def go() -> None:
        async with env.app(config(routing="least_loaded", extra="max_queue = 4\n")) as (pool, c):
            assert (await c.post("/admin/models/load", json={"model": "m"})).status_code == 200
            rs = pool.replica_set("m")
            assert rs is not None
            r0, r1 = rs.slots
            with env.hold():
                # replica 0 runs a stream that will crash; replica 1 one that holds
                crash = asyncio.create_task(c.post("/v1/chat/completions", json=convo("x", "[hold@1] [crash] go")))
                await until(lambda: r0.admission.n_running == 1, "the first on replica 0")
                held = asyncio.create_task(c.post("/v1/chat/completions", json=convo("y", "[hold@1] go")))
                await until(lambda: r1.admission.n_running == 1, "the second on replica 1")
                waiting = [asyncio.create_task(c.post("/v1/chat/completions", json=convo(t, "hi"))) for t in "pq"]
                await until(lambda: r0.queue_depth + r1.queue_depth == 2, "two waiting")
                waiting_on_0 = r0.queue_depth
                assert waiting_on_0 >= 1  # least loaded: one each
            r = await crash
            assert r.status_code == 502 or "error" in r.text  # its worker crashed mid-stream: the stream fails
            answers = await asyncio.gather(held, *waiting)
            assert [a.status_code for a in answers] == [200, 200, 200]
            # the model is healthy while one replica is (replica 0 is still restarting here)
            r0_down = r0.state is not WorkerState.READY
            h = await c.get("/health", params={"model": "m", "autoload": "false"})
            assert h.status_code == 200 and r1.state is WorkerState.READY, (h.text, r0_down)
            assert pool.metrics.crashes.labels("m")._value.get() == 1
            await until(lambda: r0.state is WorkerState.READY, "replica 0 placed again", timeout=30)
            assert r0.loader.spawn_count == 2

    asyncio.run(go())


def test_admin_unload_and_load_act_on_every_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config(replicas=3)) as (pool, c):
            r = await c.post("/admin/models/load", json={"model": "m"})
            assert r.status_code == 200 and [x["state"] for x in r.json()["replicas"]] == ["ready"] * 3
            r = await c.post("/admin/models/unload", json={"model": "m"})
            assert r.status_code == 200 and r.json()["state"] == "unloaded"
            assert all(s.state is WorkerState.UNLOADED for s in pool.every_slot())

    asyncio.run(go())


def test_an_ollama_keep_alive_0_unloads_every_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ollama's empty request with ``keep_alive: 0`` unloads the model as a whole, as /admin does."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config(replicas=3)) as (pool, c):
            assert (await c.post("/admin/models/load", json={"model": "m"})).status_code == 200
            assert all(s.state is WorkerState.READY for s in pool.every_slot())
            r = await c.post("/api/generate", json={"model": "m", "prompt": "", "keep_alive": 0})
            assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
            assert [s.state for s in pool.every_slot()] == [WorkerState.UNLOADED] * 3

    asyncio.run(go())


def test_a_generations_keep_alive_0_unloads_every_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A generation's ``keep_alive: 0`` is the model's: every replica unloads once idle."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config()) as (pool, c):
            assert (await c.post("/admin/models/load", json={"model": "m"})).status_code == 200
            r = await c.post("/api/generate", json={"model": "m", "prompt": "hi", "stream": False, "keep_alive": 0})
            assert r.status_code == 200, r.text
            await until(lambda: all(s.state is WorkerState.UNLOADED for s in pool.every_slot()), "every replica unloaded")

    asyncio.run(go())


def test_one_replica_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config(replicas=1)) as (pool, c):
            assert pool.replica_set("m") is None and len(pool.every_slot()) == 1
            assert (await c.post("/v1/chat/completions", json=convo("a", "hi"))).status_code == 200
            row = next(m for m in (await c.get("/admin/models")).json()["data"] if m["id"] == "m")
            assert "replicas" not in row
            assert "modelyard_replica_state" not in (await c.get("/metrics")).text

    asyncio.run(go())


def test_replicas_config_is_validated(tmp_path: Path) -> None:
    import tomllib

    from router.config import ConfigError, parse_config
    from tests.router.conftest import dummy_gguf

    dummy_gguf(tmp_path, "m.gguf")
    for bad, key in (("replicas = 0", "models.m.replicas"), ("replicas = true", "models.m.replicas"),
                     ('routing = "random"', "models.m.routing")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            parse_config(tomllib.loads(f'[server]\nmodels_dir = "."\n[models.m]\npath = "m.gguf"\n{bad}\n'),
                         base_dir=tmp_path)
    cfg = parse_config(tomllib.loads('[server]\nmodels_dir = "."\n[defaults]\nreplicas = 2\n'
                                     '[models.m]\npath = "m.gguf"\n'), base_dir=tmp_path)
    assert cfg.models["m"].replicas == 2 and cfg.models["m"].routing == "cache_aware"


def test_a_reload_changes_the_number_of_replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tomllib

    from router.config import parse_config
    from tests.router.conftest import spare_off

    env = InProc(tmp_path, monkeypatch)

    def cfg(n: int) -> Any:
        return parse_config(tomllib.loads(spare_off(config(replicas=n))), base_dir=tmp_path)

    async def go() -> None:
        async with env.app(config(replicas=2)) as (pool, c):
            assert (await c.post("/admin/models/load", json={"model": "m"})).status_code == 200
            changes = pool.reload(cfg(3))
            assert changes["changed"] == ["m"] and len(pool.every_slot()) == 3
            assert (await c.post("/admin/models/load", json={"model": "m"})).status_code == 200
            assert [s.state for s in pool.every_slot()] == [WorkerState.READY] * 3
            assert all(s.model.replicas == 3 for s in pool.every_slot())
            leaving = pool.extra["m"][:]
            pool.reload(cfg(1))
            assert pool.replica_set("m") is None and len(pool.every_slot()) == 1
            await until(lambda: all(s.state is WorkerState.UNLOADED for s in leaving), "the extra replicas stopped")
            assert (await c.post("/v1/chat/completions", json=convo("a", "hi"))).status_code == 200
            assert "replicas" not in next(m for m in (await c.get("/admin/models")).json()["data"] if m["id"] == "m")

    asyncio.run(go())


def test_a_replica_unloaded_for_idleness_starts_again_when_requests_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"*": {"max_jobs": 1}})

    async def go() -> None:
        async with env.app(config(extra="idle_ttl_s = 0.5\n")) as (pool, c):
            assert (await c.post("/admin/models/load", json={"model": "m"})).status_code == 200
            rs = pool.replica_set("m")
            assert rs is not None
            r0, r1 = rs.slots
            with env.hold():
                running = asyncio.create_task(c.post("/v1/chat/completions", json=convo("x", "[hold@1] go")))
                await until(lambda: r0.admission.n_running == 1, "running on replica 0")
                await until(lambda: r1.state is WorkerState.UNLOADED, "replica 1 unloaded for idleness")
                assert r0.state is WorkerState.READY
                waiting = asyncio.create_task(c.post("/v1/chat/completions", json=convo("y", "hi")))
                await until(lambda: r1.state in (WorkerState.LOADING, WorkerState.READY), "replica 1 started again")
            assert [r.status_code for r in await asyncio.gather(running, waiting)] == [200, 200]

    asyncio.run(go())


def test_a_replica_that_becomes_ready_takes_requests_queued_on_the_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica 1 loads again while replica 0 serves: the burst queues on replica 0 (the only one
    ready); once replica 1 is ready, the newest waiting move to it until the loads are even."""
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"*": {"max_jobs": 1}})

    async def go() -> None:
        async with env.app(config(routing="least_loaded")) as (pool, c):
            assert (await c.post("/admin/models/load", json={"model": "m"})).status_code == 200
            rs = pool.replica_set("m")
            assert rs is not None
            r0, r1 = rs.slots
            await r1.begin_unload(reason="test")
            await until(lambda: r1.state is WorkerState.UNLOADED, "replica 1 unloaded")
            env.set_fake({"*": {"max_jobs": 1, "hold_load": True}})
            with env.hold():
                # the first runs ~5 s (2 tokens): still running on replica 0 when replica 1 is ready, however busy
                # the machine (with 0.6 s it could end first, and then only one waiting request moves)
                burst = [asyncio.create_task(c.post("/v1/chat/completions",
                                                    json=convo(t, f"[slow={2.5 if t == 'a' else 0.2}] [len=3] hi")))
                         for t in "abcd"]
                await until(lambda: r0.admission.n_running == 1 and r0.queue_depth == 3, "the burst on replica 0")
                await until(lambda: r1.state is WorkerState.LOADING, "replica 1 loading (held)")
            await until(lambda: r1.state is WorkerState.READY, "replica 1 ready")
            answers = await asyncio.gather(*burst)
            assert [a.status_code for a in answers] == [200] * 4
            served = served_by(pool)[-4:]
            assert served.count(1) == 2 and served.count(0) == 2, served  # 4 on replica 0 -> 2 + 2

    asyncio.run(go())


def test_slots_autoload_starts_every_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A llama.cpp client's ``GET /slots?model=`` (and Ollama's empty load request) loads the
    model as a whole: every replica starts, as for a generation."""
    env = InProc(tmp_path, monkeypatch)

    async def go() -> None:
        async with env.app(config()) as (pool, c):
            rs = pool.replica_set("m")
            assert rs is not None
            r = await c.get("/slots", params={"model": "m"})
            assert r.status_code == 200, r.text
            await until(lambda: all(s.state is WorkerState.READY for s in rs.slots), "both replicas ready")
            assert (await c.post("/admin/models/unload", json={"model": "m"})).status_code == 200
            r = await c.post("/api/generate", json={"model": "m"})  # Ollama: load
            assert r.status_code == 200, r.text
            await until(lambda: all(s.state is WorkerState.READY for s in rs.slots), "both replicas ready again")

    asyncio.run(go())
