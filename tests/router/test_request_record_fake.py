"""One request, one record (router.serving.record), followed through the router in process.

A streamed chat request, one cancelled while it runs and one cancelled while it waits:
each has exactly one RequestRecord, owned by its model's ModelServer from admission to
release, and the same object is the admission's ticket (the pool's running set holds it)
and the inbox the worker connection routes its frames to. Its states are asserted in order.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from router.serving.record import RecordState, RequestRecord
from router.serving.server import ModelServer, server_of
from tests.router.inproc import InProc, chat, until

CONFIG = """
[server]
models_dir = "."
[defaults]
ping_interval_s = 0
[models.m]
path = "m.gguf"
max_queue = 2
"""


def _one(server: ModelServer, rid: str | None = None) -> RequestRecord:
    recs = [r for r in server.recent if rid is None or r.id == rid]
    assert len(recs) == 1, [r.id for r in server.recent]
    return recs[0]


def _sse_chunks(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_streamed_chat_request_is_one_record_queued_running_done(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"m": {"token_delay_s": 0}})

    async def go() -> None:
        async with env.app(CONFIG) as (pool, c):
            slot = pool.get("m")
            server = server_of(slot)
            seen: list[tuple[str, bool]] = []  # (state, held by the admission's running set) while it ran
            orig_next = ModelServer.next

            async def watched(self: ModelServer, rec: RequestRecord):  # type: ignore[no-untyped-def]
                seen.append((rec.state.value, any(t is rec for t in slot.admission.running())))
                assert server.records.get(rec.id) is rec  # live: the owner holds it by id
                return await orig_next(self, rec)

            monkeypatch.setattr(ModelServer, "next", watched)
            r = await c.post("/v1/chat/completions", json=chat("m", "hello [len=3]", max_tokens=8, stream=True))
            assert r.status_code == 200, r.text
            chunks = _sse_chunks(r.text)
            rec = _one(server)
            assert rec.id == chunks[0]["id"]  # the response's id is the record's
            assert rec.states == ["queued", "running", "done"]
            assert [s for s, _, _ in rec.history] == [RecordState.QUEUED, RecordState.RUNNING, RecordState.DONE]
            times = [t for _, t, _ in rec.history]
            assert times == sorted(times)
            assert rec.state is RecordState.DONE and rec.released and rec.closed
            assert rec.outcome == "stop" and rec.n_tokens == 3  # the fake ends [len=3] with stop
            assert rec.msg is not None and rec.msg.id == rec.id and rec.msg.max_tokens == 8
            assert rec.worker is not None and rec.worker is slot.worker
            assert rec.first_token_at is not None and rec.admitted_at <= rec.started_at <= rec.first_token_at
            # while it ran: the owner's record was running and was the admission's ticket itself
            assert seen and all(s == ("running", True) for s in seen)
            assert rec.id not in server.records and not slot.admission.running_ids  # released once
            assert rec.access["completion_tokens"] == 3

    asyncio.run(go())


def test_a_cancelled_request_runs_then_is_done_once_the_worker_let_go(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"m": {"token_delay_s": 0}})

    async def go() -> None:
        async with env.app(CONFIG) as (pool, c):
            server = server_of(pool.get("m"))
            with env.hold():
                task = asyncio.create_task(c.post("/v1/chat/completions",
                                                  json=chat("m", "wait [hold]", max_tokens=8, stream=True)))
                rec = await until(lambda: next(iter(server.records.values()), None), "the record")
                assert rec.state is RecordState.QUEUED or rec.state is RecordState.RUNNING
                await until(lambda: env_generate(env, rec.id), "the worker got its Generate")
                assert rec.state is RecordState.RUNNING and rec.sent
                task.cancel()  # the client leaves
                with pytest.raises(asyncio.CancelledError):
                    await task
                # closed at once; done only once the worker has answered its Cancel
                assert rec.closed
                await until(lambda: rec.state is RecordState.DONE, "the record done")
            assert rec.states == ["queued", "running", "done"]
            assert rec.outcome == "cancelled" and rec.history[-1][2] == "cancelled"
            assert [e["id"] for e in env_events(env, "cancel")] == [rec.id]
            assert _one(server, rec.id) is rec and not server.records

    asyncio.run(go())


def test_a_request_cancelled_while_queued_never_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = InProc(tmp_path, monkeypatch)
    env.set_fake({"m": {"token_delay_s": 0}})

    async def go() -> None:
        async with env.app(CONFIG) as (pool, c):
            slot = pool.get("m")
            server = server_of(slot)
            with env.hold():
                first = asyncio.create_task(c.post("/v1/chat/completions", json=chat("m", "first [hold]")))
                await until(lambda: len(server.records) == 1 and slot.admission.running_ids, "the first runs")
                second = asyncio.create_task(c.post("/v1/chat/completions", json=chat("m", "second")))
                await until(lambda: len(server.records) == 2, "the second is admitted")
                rec = next(r for r in server.records.values() if r.state is RecordState.QUEUED)
                assert slot.queue_depth == 1 and rec.worker is None
                second.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await second
                assert rec.state is RecordState.DONE  # it left the queue at once: no worker to wait for
            r = await first
            assert r.status_code == 200, r.text
            assert rec.states == ["queued", "done"] and rec.outcome == "cancelled" and not rec.sent
            assert slot.queue_depth == 0 and not env_generate(env, rec.id)
            assert [x.states for x in server.recent] == [["queued", "done"], ["queued", "running", "done"]]

    asyncio.run(go())


def env_events(env: InProc, event: str) -> list[dict]:
    if not env.fake_log.exists():
        return []
    out = []
    for line in env.fake_log.read_text().splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if ev.get("event") == event:
            out.append(ev)
    return out


def env_generate(env: InProc, rid: str) -> bool:
    return any(e.get("id") == rid for e in env_events(env, "generate"))
