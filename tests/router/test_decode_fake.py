"""Decode by id (router.dialects.background, router.dialects.decode_api) and background Responses against fake
workers: two ids at once never mix, late readers get every event from the first, DELETE
really cancels (the worker's slot is free again), a deleted or expired id is a 404 for
good, and the store keeps its bounds under 1,000 ids."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from router.dialects.background import BackgroundStore
from tests.router.conftest import LiveRouter, router_fixture
from tests.router.inproc import FakeClock, InProc, until

CONFIG = """
[server]
models_dir = "."
background_max = 3
[models.alpha]
path = "alpha.gguf"
max_queue = 4
"""


def reply(text: str) -> str:
    return "[reply64=" + base64.b64encode(text.encode()).decode() + "]"


def sse_data(raw: str) -> list[Any]:
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


router = router_fixture(CONFIG, ggufs=("alpha.gguf",), fake={"alpha": {"max_jobs": 2, "report_slots": True}})


def _slots(router: LiveRouter) -> list[dict[str, Any]]:
    return httpx.get(router.url + "/slots", params={"model": "alpha"}, timeout=10).json()


def test_two_ids_at_once_never_mix_and_late_readers_get_everything(router: LiveRouter) -> None:
    texts = {"a": "the first answer, all of it", "b": "a second, different answer"}
    with router.http() as c, router.hold():
        ids = {}
        for k, kind_body in (("a", {"messages": [{"role": "user", "content": "[hold@2]" + reply(texts["a"])}]}),
                             ("b", {"prompt": "[hold@3]" + reply(texts["b"])})):
            r = c.post("/v1/decode", json={"model": "alpha", "max_tokens": 50, **kind_body})
            assert r.status_code == 200, r.text
            ids[k] = r.json()
            assert r.json()["status"] in ("queued", "in_progress") and r.json()["model"] == "alpha"
        assert ids["a"]["object"] == "chat.completion" and ids["b"]["object"] == "text_completion"
        assert ids["a"]["id"] != ids["b"]["id"] and ids["a"]["id"].startswith("decode_")
        router.wait_for(lambda: all(c.get(f"/v1/decode/{j['id']}", params={"stream": "false"}).json()["worker"]
                                    for j in ids.values()), what="both on the worker")
        st = c.get(f"/v1/decode/{ids['a']['id']}", params={"stream": "false"}).json()
        assert st["status"] == "in_progress" and st["result"] is None
        assert len(st["worker"]["fingerprint"]) == 64 and st["worker"]["pid"] > 0  # the worker's identity
        router.wait_for(lambda: sum(s["is_processing"] for s in _slots(router)) == 2, what="two busy slots")
        got: dict[str, list[str]] = {"a1": [], "a2": [], "b1": []}
        attached = {k: threading.Event() for k in got}

        def read(key: str, job_id: str) -> None:
            with httpx.stream("GET", f"{router.url}/v1/decode/{job_id}", timeout=30) as resp:
                got[key].append(resp.headers["content-type"])
                attached[key].set()
                got[key].append(resp.read().decode())

        readers = [threading.Thread(target=read, args=(k, ids[k[0]]["id"]), daemon=True) for k in got]
        for t in readers:
            t.start()
        assert all(e.wait(30) for e in attached.values())  # three readers attached while both run
    for t in readers:  # the hold is gone: both finish
        t.join(30)
    with router.http() as c:
        ra = c.get(f"/v1/decode/{ids['a']['id']}").json()
        rb = c.get(f"/v1/decode/{ids['b']['id']}").json()
    assert ra["status"] == rb["status"] == "completed"
    assert ra["result"]["choices"][0]["message"]["content"] == texts["a"]
    assert ra["result"]["object"] == "chat.completion" and ra["result"]["usage"]["completion_tokens"] > 0
    assert rb["result"]["choices"][0]["text"] == texts["b"]
    assert ra["worker"]["fingerprint"] == rb["worker"]["fingerprint"]
    for key, text in (("a1", texts["a"]), ("a2", texts["a"]), ("b1", texts["b"])):
        ctype, raw = got[key]
        assert ctype.startswith("text/event-stream") and raw.rstrip().endswith("data: [DONE]")
        chunks = [d for d in sse_data(raw) if d.get("choices")]
        pieces = [ch["choices"][0].get("delta", {}).get("content") or ch["choices"][0].get("text") or ""
                  for ch in chunks]
        assert "".join(pieces) == text, key  # from the first event on, though attached mid-way
    assert got["a1"] == got["a2"]  # two readers of one id: the same stream
    assert sse_data(got["a1"][1])[0]["id"] == ra["result"]["id"]


def test_delete_cancels_frees_the_slot_and_the_id_is_gone(router: LiveRouter) -> None:
    with router.http() as c, router.hold():
        job = c.post("/v1/decode", json={"model": "alpha", "prompt": "[hold@1] long", "max_tokens": 20}).json()
        router.wait_for(lambda: any(s["is_processing"] and s["id_task"] for s in _slots(router)), what="busy slot")
        r = c.delete(f"/v1/decode/{job['id']}")
        assert r.status_code == 200 and r.json() == {"id": job["id"], "object": "decode.deleted", "deleted": True,
                                                     "status": "cancelled"}
        router.wait_for(lambda: not any(s["is_processing"] for s in _slots(router)), what="the slot freed")
        assert router.fake_events("done", finish_reason="cancelled")  # the worker really stopped it
        for _ in range(2):
            assert c.get(f"/v1/decode/{job['id']}").status_code == 404
            assert c.delete(f"/v1/decode/{job['id']}").status_code == 404


def test_refusals_name_the_field(router: LiveRouter) -> None:
    with router.http() as c:
        for body, param, status in [
            ({"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "messages", 400),
            ({}, "messages", 400),
            ({"prompt": "x", "stream": True}, "stream", 400),
            ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", 400),
            ({"prompt": "x", "background": False}, "background", 400),
            ({"prompt": "x", "n": 0}, "n", 400),  # the dialect's own validation, before an id exists
            ({"model": "nope", "prompt": "x"}, "model", 404),
        ]:
            r = c.post("/v1/decode", json={"model": "alpha", **body})
            assert r.status_code == status and r.json()["error"]["param"] == param, r.text
        r = c.post("/v1/decode", json={"model": "alpha", "prompt": "x " * 300})  # too long for n_ctx=256
        job = r.json()  # admitted, then its worker refuses it: the job fails with the dialect's error
        router.wait_for(lambda: c.get(f"/v1/decode/{job['id']}", params={"stream": "false"}).json()["status"]
                        == "failed", what="failed")
        assert c.get(f"/v1/decode/{job['id']}").json()["error"]["code"] == "context_length_exceeded"
        raw = c.get(f"/v1/decode/{job['id']}", params={"stream": "true"}).text
        assert sse_data(raw)[-1]["error"]["code"] == "context_length_exceeded"


def test_background_responses(router: LiveRouter) -> None:
    client = router.client(timeout=30)
    with router.hold():
        r = client.responses.create(model="alpha", input="[hold@1] hi", background=True, max_output_tokens=5)
        assert r.status in ("queued", "in_progress") and r.background is True and r.id.startswith("resp_")
        router.wait_for(lambda: client.responses.retrieve(r.id).status == "in_progress", what="in progress")
        c = client.responses.cancel(r.id)
        assert c.status == "cancelled" and c.id == r.id
        router.wait_for(lambda: not any(s["is_processing"] for s in _slots(router)), what="the slot freed")
        assert client.responses.retrieve(r.id).status == "cancelled"
    done = client.responses.create(model="alpha", input="hi [len=3]", background=True)
    router.wait_for(lambda: client.responses.retrieve(done.id).status == "completed", what="completed")
    got = client.responses.retrieve(done.id)
    assert got.output_text == " w100 w101 w102" and got.usage is not None and got.usage.output_tokens == 3
    evs = list(client.responses.retrieve(done.id, stream=True))  # the events, replayed
    assert evs[0].type == "response.created" and evs[-1].type == "response.completed"
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    later = list(client.responses.retrieve(done.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in later] == list(range(3, len(evs)))
    nxt = client.responses.create(model="alpha", input="again [len=1]", previous_response_id=done.id)
    assert nxt.status == "completed"  # a background response continues a conversation like any stored one
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(nxt.id)  # not a background response
    client.responses.delete(done.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)
    for body, param in [({"store": False}, "store"), ({"stream": True}, "stream")]:
        resp = httpx.post(router.url + "/v1/responses", timeout=30,
                          json={"model": "alpha", "input": "x", "background": True, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


CONFIG_BOUNDS = """
[server]
models_dir = "."
background_max = 5
background_ttl_s = 60
background_max_mib = 0.02
[models.a]
path = "m.gguf"
ping_interval_s = 0
max_queue = 4
background_slots = 5  # the store's own bounds under test, not those of running work (test_hardening2_fake)
"""


def test_the_store_keeps_its_bounds_under_1000_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"a": {"token_delay_s": 0, "length": 3, "max_jobs": 5, "n_ctx": 4096}})
    clock = FakeClock()
    seen = {"n": 0, "bytes": 0, "appends": 0}
    append = BackgroundStore._append

    def checked(self: BackgroundStore, job: Any, ev: bytes) -> bool:  # the bounds hold after every event
        ok = append(self, job, ev)
        seen["n"] = max(seen["n"], len(self._jobs))
        seen["bytes"] = max(seen["bytes"], self.nbytes)
        seen["appends"] += 1
        return ok

    monkeypatch.setattr(BackgroundStore, "_append", checked)

    async def go() -> None:
        async with env.app(CONFIG_BOUNDS) as (pool, c):
            store: BackgroundStore = c._transport.app.state.background  # type: ignore[attr-defined]
            store._clock = clock
            ids: list[str] = []

            async def one(i: int) -> str:
                r = await c.post("/v1/decode", json={"model": "a", "prompt": f"p{i}", "max_tokens": 3})
                assert r.status_code == 200, r.text
                return str(r.json()["id"])

            for b in range(200):  # 1,000 ids, five at a time (background_max = 5)
                batch = await asyncio.gather(*(one(5 * b + k) for k in range(5)))
                ids += batch
                await until(lambda: all(store.get(j) is None or not store.get(j).running for j in batch), "a batch")
            assert seen["appends"] >= 1000 * 5 and seen["n"] <= 5 and seen["bytes"] <= store.max_bytes
            kept = [j.id for j in store._jobs.values()]
            assert 0 < len(kept) <= 5 and set(kept) <= set(ids[-5:])  # the oldest went first
            assert store.nbytes == sum(len(e) for j in store._jobs.values() for e in j.events)
            assert (await c.get(f"/v1/decode/{ids[0]}")).status_code == 404
            last = (await c.get(f"/v1/decode/{kept[-1]}")).json()
            assert last["status"] == "completed" and last["result"]["choices"][0]["text"] == " w100 w101 w102"
            clock.advance(61)  # past background_ttl_s: every finished job expires
            assert (await c.get(f"/v1/decode/{kept[-1]}")).status_code == 404 and len(store) == 0
            # a store full of running jobs: the next is a 503, never a dropped running job
            with env.hold():
                running = [(await c.post("/v1/decode", json={"model": "a", "prompt": "[hold]", "max_tokens": 3}))
                           .json()["id"] for _ in range(5)]
                r = await c.post("/v1/decode", json={"model": "a", "prompt": "x", "max_tokens": 3})
                assert r.status_code == 503 and r.json()["error"]["code"] == "background_store_full"
                assert "retry-after" in r.headers
                assert all(store.get(j) is not None and store.get(j).running for j in running)
                for j in running:
                    assert (await c.delete(f"/v1/decode/{j}")).status_code == 200
                await until(lambda: not pool.get("a").busy, "every slot free")
            # one result beyond background_max_mib: failed, its events dropped, the bound kept
            r = await c.post("/v1/decode", json={"model": "a", "prompt": "[len=1000]", "max_tokens": 1000})
            job = store.get(r.json()["id"])
            await until(lambda: not job.running, "the big job to end")
            assert job.status == "failed" and job.error["code"] == "background_result_too_large"
            assert store.nbytes <= store.max_bytes and job.events == []
            await until(lambda: not pool.get("a").busy, "its slot free")
            assert seen["bytes"] <= store.max_bytes

    asyncio.run(go())


CONFIG_QUEUED = """
[server]
models_dir = "."
[models.a]
path = "m.gguf"
ping_interval_s = 0
max_queue = 4
"""


async def finished(c: Any, job_id: str) -> dict[str, Any]:
    """The job's object once it has ended (a job records its end just after its slot is free)."""
    for _ in range(200):
        st: dict[str, Any] = (await c.get(f"/v1/decode/{job_id}", params={"stream": "false"})).json()
        if st["status"] not in ("queued", "in_progress"):
            return st
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} still {st['status']}")


def test_queued_while_loading_then_runs_and_a_queued_delete_leaves_the_queue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"a": {"hold_load": True, "token_delay_s": 0}})

    async def go() -> None:
        async with env.app(CONFIG_QUEUED) as (pool, c):
            with env.hold():  # the model's load is held: the POST is answered anyway, queued
                first = (await c.post("/v1/decode", json={"model": "a", "prompt": "one", "max_tokens": 3})).json()
                assert first["status"] == "queued" and first["worker"] is None
                st = (await c.get(f"/v1/decode/{first['id']}", params={"stream": "false"})).json()
                assert st["status"] == "queued" and st["worker"] is None
            await until(lambda: not pool.get("a").busy and pool.get("a").worker is not None, "first done")
            done = await finished(c, first["id"])
            assert done["status"] == "completed" and done["worker"]["fingerprint"] == "f" * 64
            assert done["result"]["choices"][0]["text"] == " w100 w101 w102"
            with env.hold():  # one slot: a held generation runs, the next one waits in the queue
                running = (await c.post("/v1/decode", json={"model": "a", "prompt": "[hold] two",
                                                           "max_tokens": 3})).json()
                queued = (await c.post("/v1/decode", json={"model": "a", "prompt": "three", "max_tokens": 3})).json()
                assert running["status"] == "in_progress" and queued["status"] == "queued"
                assert pool.get("a").queue_depth == 1
                assert (await c.delete(f"/v1/decode/{queued['id']}")).json()["status"] == "cancelled"
                await until(lambda: pool.get("a").queue_depth == 0, "the queue emptied")
                assert pool.get("a").busy  # the other one goes on
            await until(lambda: not pool.get("a").busy, "the held one finished")
            assert (await finished(c, running["id"]))["status"] == "completed"
            assert (await c.get(f"/v1/decode/{queued['id']}")).status_code == 404
            log = [json.loads(line) for line in env.fake_log.read_text().splitlines()]
            assert sum(e["event"] == "generate" for e in log) == 2  # the deleted one never reached the worker

    asyncio.run(go())
