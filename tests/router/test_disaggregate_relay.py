"""The router's relay of a KV-state stream (router.serving.disaggregate, kv_transfer = "wire"), with
in-process stand-ins for the two workers: every byte relayed in order under the decode
worker's transfer id, never more than KV_WINDOW chunks in flight, acks relayed as the prefill
worker's credit; a refusal by the decode worker or a cancel mid-transfer closes the prefill
run and drops the decode worker's partial stream."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

import router.serving.disaggregate as dis
from protocol import KV_WINDOW, Cancel, Done, Error, Generate, KVAck, KVChunk, SlotActionResult, Token
from router.http.errors import ApiError


def done(rid: str) -> Done:
    return Done(id=rid, finish_reason="length", stop_type="limit", prompt_tokens=5, completion_tokens=1,
                prompt_n=5, prompt_ms=1.0, predicted_n=1, predicted_ms=1.0, cache_n=0)


class Prefill:
    """The prefill worker behind the generation: sends chunks while its credit allows (as worker.kvstream)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks, self.q, self.sent, self.credit, self.closed = chunks, asyncio.Queue(), 0, KV_WINDOW - 1, False
        self.rid = ""

    async def send(self, msg: Any) -> None:
        assert isinstance(msg, KVAck) and msg.id == self.rid
        self.credit = max(self.credit, msg.seq + KV_WINDOW)
        self.pump()

    def pump(self) -> None:
        while self.sent < len(self.chunks) and self.sent <= self.credit:
            self.q.put_nowait(KVChunk(id=self.rid, seq=self.sent, data=self.chunks[self.sent],
                                      last=self.sent == len(self.chunks) - 1))
            self.sent += 1
            if self.sent == len(self.chunks):
                self.q.put_nowait(done(self.rid))


class Decode:
    """The decode worker: acks each chunk a little later; answers the result after the last."""

    def __init__(self, pre: Prefill, refuse_at: int | None = None, stall_at: int | None = None) -> None:
        self.pre, self.refuse_at, self.stall_at = pre, refuse_at, stall_at
        self.got: list[KVChunk] = []
        self.cancelled: list[str] = []
        self.closed: list[str] = []
        self.q: asyncio.Queue[Any] = asyncio.Queue()
        self.acked = -1  # highest seq acknowledged so far
        self.max_in_flight = 0  # chunks the prefill worker had emitted beyond the last ack

    def ack(self, sid: str, seq: int) -> None:
        self.acked = max(self.acked, seq)
        self.q.put_nowait(KVAck(id=sid, seq=seq))

    def new_call_id(self, kind: str) -> str:
        return f"{kind}-1"

    def open_stream(self, sid: str) -> asyncio.Queue[Any]:
        return self.q

    def close_stream(self, sid: str) -> None:
        self.closed.append(sid)

    def cancel(self, sid: str) -> None:
        self.cancelled.append(sid)

    async def send(self, msg: Any) -> None:
        assert isinstance(msg, KVChunk) and msg.id == "xfer-1"
        self.got.append(msg)
        self.max_in_flight = max(self.max_in_flight, self.pre.sent - (self.acked + 1))
        if self.stall_at is not None and msg.seq >= self.stall_at:
            return  # never answers again
        if self.refuse_at is not None and msg.seq == self.refuse_at:
            self.q.put_nowait(Error(id=msg.id, code="kv_state_mismatch", message="n_ctx: 1024 in the state, 512 here"))
            return
        loop = asyncio.get_running_loop()
        loop.call_later(0.001, self.ack, msg.id, msg.seq)
        if msg.last:
            loop.call_later(0.002, self.q.put_nowait, SlotActionResult(id=msg.id, action="restore", id_slot=-1,
                                                                        n_tokens=5, n_bytes=0))


def setup(monkeypatch: pytest.MonkeyPatch, chunks: list[bytes], **kw: Any) -> tuple[Prefill, Decode, Any, Any]:
    pre_w = Prefill(chunks)
    dec = Decode(pre_w, **kw)

    class FakeRun:
        def __init__(self, slot: Any, rid: str) -> None:
            pre_w.rid = rid

        async def ack_state(self, seq: int) -> None:
            await pre_w.send(KVAck(id=pre_w.rid, seq=seq))

        async def start(self, msg: Generate) -> None:
            assert msg.stream_state and msg.max_tokens == 1 and not msg.save_slot_to
            pre_w.q.put_nowait(Token(id=pre_w.rid, text="x", token_id=1, piece=b"x"))
            pre_w.pump()

        async def next(self) -> Any:
            return await pre_w.q.get()

        def close(self) -> None:
            pre_w.closed = True

    monkeypatch.setattr(dis, "submit", FakeRun)  # the serving door: submit(slot, request_id)

    async def ready_worker() -> Decode:
        return dec

    slot = SimpleNamespace(model=SimpleNamespace(name="d", kv_transfer="wire"), ready_worker=ready_worker)
    pre = SimpleNamespace(model=SimpleNamespace(name="p"))
    return pre_w, dec, pre, slot


def test_relays_every_byte_within_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [bytes([i]) * (1000 + i) for i in range(23)]
    pre_w, dec, pre, slot = setup(monkeypatch, chunks)
    timings: dict[str, Any] = {}
    asyncio.run(asyncio.wait_for(dis.prefill_and_hand_over(pre, slot, Generate(id="r", prompt=[1, 2, 3]), timings),
                                 30))
    assert [c.seq for c in dec.got] == list(range(len(chunks))) and [c.data for c in dec.got] == chunks
    assert dec.got[-1].last and not any(c.last for c in dec.got[:-1])
    assert 0 < dec.max_in_flight <= KV_WINDOW
    assert timings["transfer"] == "wire" and timings["bytes"] == sum(map(len, chunks)) and timings["n_transferred"] == 5
    assert pre_w.closed and dec.cancelled == [] and dec.closed == ["xfer-1"]


def test_a_refusal_is_the_error_and_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    pre_w, dec, pre, slot = setup(monkeypatch, [b"a" * 100] * 12, refuse_at=0)
    with pytest.raises(ApiError) as e:
        asyncio.run(asyncio.wait_for(dis.prefill_and_hand_over(pre, slot, Generate(id="r", prompt=[1])), 30))
    assert e.value.status == 400 and e.value.code == "kv_state_mismatch" and "n_ctx" in e.value.message
    assert pre_w.closed and dec.cancelled == ["xfer-1"]  # the partial state is dropped on the decode worker
    assert pre_w.sent <= KV_WINDOW + 1  # the prefill worker got no credit beyond the refusal


def test_a_cancel_mid_transfer_closes_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    pre_w, dec, pre, slot = setup(monkeypatch, [b"a" * 100] * 12, stall_at=6)

    async def go() -> None:
        task = asyncio.ensure_future(dis.prefill_and_hand_over(pre, slot, Generate(id="r", prompt=[1])))
        while len(dec.got) < 7:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(go(), 30))
    assert pre_w.closed and dec.cancelled == ["xfer-1"] and len(dec.got) <= 6 + KV_WINDOW
