"""KV-state streams between two real ``python -m worker`` processes (tiny GGUF), the test
playing the router's relay: a prefill worker streams its entry (Generate.stream_state) within
the KV_WINDOW credit; the decode worker validates chunk by chunk, installs only a complete,
valid state and then continues as if it had prefilled; a foreign, corrupt, out-of-order or
cancelled stream installs nothing; a Cancel on the prefill worker mid-stream ends it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol import (
    KV_CHUNK_BYTES,
    KV_WINDOW,
    Cancel,
    Done,
    Error,
    Generate,
    KVAck,
    KVChunk,
    Ping,
    Pong,
    SlotActionResult,
    Token,
)
from tests.worker.router_stub import RouterStub, spawn_worker
from tests.worker.tiny_gguf import write_tiny_llama
from worker.kvstream import exact_chunks

PROMPT = [10 + (i * 7) % 300 for i in range(400)]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 8 layers x 4 KV heads x (64 + 64) x 4 bytes = 16 KiB per position: 400 tokens ~ 6.3 MiB, 7 chunks
    return write_tiny_llama(tmp_path_factory.mktemp("g") / "tiny-wide.gguf", n_embd=256, n_head=4, n_head_kv=4,
                            n_layer=8, n_ff=256, n_ctx_train=1024)


Worker = tuple[RouterStub, subprocess.Popen[bytes]]


def start(gguf: Path, n_ctx: int = 1024) -> Worker:
    stub = RouterStub("tcp://127.0.0.1:*")
    proc = spawn_worker(str(gguf), stub.endpoint, "--n-ctx", str(n_ctx), "--parallel", "2")
    stub.handshake(60)
    return stub, proc


def stop(w: Worker) -> None:
    stub, proc = w
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    stub.close()


@pytest.fixture(scope="module")
def pair(gguf: Path) -> Iterator[tuple[Worker, Worker]]:
    p, d = start(gguf), start(gguf)
    yield p, d
    stop(p)
    stop(d)


def pong(stub: RouterStub, rid: str) -> Pong:
    stub.send(Ping(id=rid))
    m = stub.next_for(rid, 30)
    assert isinstance(m, Pong)
    return m


def prefill_chunks(p: RouterStub, rid: str, ack: bool = True) -> tuple[list[KVChunk], Done | Error]:
    """Generate(stream_state) on the prefill worker; every chunk acked at once (``ack``)."""
    p.send(Generate(id=rid, prompt=PROMPT, max_tokens=1, temperature=0.0, stream_state=True))
    chunks: list[KVChunk] = []
    while True:
        m = p.next_for(rid, 60)
        if isinstance(m, Token):
            continue
        if isinstance(m, KVChunk):
            chunks.append(m)
            if ack:
                p.send(KVAck(id=rid, seq=m.seq))
            continue
        assert isinstance(m, (Done, Error))
        return chunks, m


def feed(d: RouterStub, sid: str, chunks: list[KVChunk]) -> list:
    """Send ``chunks`` to the decode worker as stream ``sid``; its answers (acks, then a result/Error)."""
    out = []
    for c in chunks:
        d.send(KVChunk(id=sid, seq=c.seq, data=c.data, last=c.last))
        m = d.next_for(sid, 60)
        out.append(m)
        if isinstance(m, Error):
            return out
    if chunks and chunks[-1].last:
        out.append(d.next_for(sid, 60))
    return out


def test_exact_chunks() -> None:
    assert list(exact_chunks([b"ab", b"cde", b"f"], 2)) == [(b"ab", False), (b"cd", False), (b"ef", True)]
    assert list(exact_chunks([b"abc"], 4)) == [(b"abc", True)]
    assert list(exact_chunks([b"abcd"], 4)) == [(b"abcd", True)]
    assert list(exact_chunks([], 4)) == []


def test_stream_within_the_window_then_decode_continues_identically(pair: tuple[Worker, Worker]) -> None:
    (p, _), (d, _) = pair
    # reference: the same greedy continuation computed by one worker alone
    p.send(Generate(id="ref", prompt=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, cache_prompt=False))
    ref_toks, ref_done = p.stream("ref", 60)
    assert isinstance(ref_done, Done)

    p.send(Generate(id="s1", prompt=PROMPT, max_tokens=1, temperature=0.0, stream_state=True))
    got: list[KVChunk] = []
    while len(got) < KV_WINDOW:
        m = p.next(lambda m: m.id == "s1" and isinstance(m, (KVChunk, Done, Error)), 60)
        assert isinstance(m, KVChunk), m
        got.append(m)
    pong(p, "p-w")  # frames are sent in order: nothing beyond the window came before this Pong
    assert [c.seq for c in got] == list(range(KV_WINDOW))
    assert not any(m.id == "s1" for m in p._unread if isinstance(m, (KVChunk, Done)))  # noqa: SLF001
    assert all(len(c.data) == KV_CHUNK_BYTES and not c.last for c in got)
    answers = []
    while True:  # relay: every chunk to the decode worker, its ack back as credit
        for c in got:
            d.send(KVChunk(id="x1", seq=c.seq, data=c.data, last=c.last))
            a = d.next_for("x1", 60)
            assert isinstance(a, KVAck) and a.seq == c.seq, a
            answers.append(a)
            p.send(KVAck(id="s1", seq=a.seq))
        if got[-1].last:
            break
        got = []
        m = p.next(lambda m: m.id == "s1" and isinstance(m, (KVChunk, Done, Error)), 60)
        assert isinstance(m, KVChunk), m
        got.append(m)
    done = p.next(lambda m: m.id == "s1" and isinstance(m, (Done, Error)), 60)
    assert isinstance(done, Done) and done.finish_reason in ("stop", "length")
    res = d.next_for("x1", 60)
    assert isinstance(res, SlotActionResult) and res.n_tokens == len(PROMPT) and res.id_slot == -1, res
    assert len(answers) > KV_WINDOW + 1  # several windows
    d.send(Generate(id="g1", prompt=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True))
    toks, dd = d.stream("g1", 60)
    assert isinstance(dd, Done) and dd.cache_n == len(PROMPT) - 1 and dd.prompt_n == 1
    assert [t.token_id for t in toks] == [t.token_id for t in ref_toks]


def test_foreign_corrupt_out_of_order_and_cancelled_streams_install_nothing(pair: tuple[Worker, Worker],
                                                                          gguf: Path) -> None:
    (p, _), _ = pair
    chunks, done = prefill_chunks(p, "s2")
    assert isinstance(done, Done) and chunks[-1].last and len(chunks) > 2
    d = start(gguf)
    other = start(gguf, n_ctx=512)  # another n_ctx: the identity differs
    try:
        ds = d[0]
        before = pong(ds, "b").kv_tokens
        # another identity: refused on the very first chunk, naming the field
        ans = feed(other[0], "y1", chunks)
        assert len(ans) == 1 and isinstance(ans[0], Error) and ans[0].code == "kv_state_mismatch"
        assert "n_ctx" in ans[0].message
        # one flipped payload bit: every chunk accepted, the checksum refuses it at the end
        bad = list(chunks)
        c = bad[2]
        bad[2] = KVChunk(id=c.id, seq=c.seq, data=c.data[:100] + bytes([c.data[100] ^ 1]) + c.data[101:], last=c.last)
        ans = feed(ds, "y2", bad)
        assert isinstance(ans[-1], Error) and ans[-1].code == "kv_state_invalid", ans[-1]
        # out of order
        ans = feed(ds, "y3", [chunks[0], chunks[2]])
        assert isinstance(ans[-1], Error) and ans[-1].code == "protocol_error"
        # cancelled half-way: dropped; a later chunk of it is refused
        feed(ds, "y4", chunks[:2])
        ds.send(Cancel(id="y4"))
        ans = feed(ds, "y4", [chunks[2]])
        assert isinstance(ans[-1], Error) and ans[-1].code == "protocol_error"
        assert pong(ds, "a").kv_tokens == before  # nothing half-loaded
        # and the same stream, whole, is installed
        ans = feed(ds, "y5", chunks)
        assert isinstance(ans[-1], SlotActionResult) and ans[-1].n_tokens == len(PROMPT)
        assert pong(ds, "c").kv_tokens == before + len(PROMPT)
    finally:
        stop(d)
        stop(other)


def test_cancel_on_the_prefill_worker_mid_stream(pair: tuple[Worker, Worker]) -> None:
    (p, _), _ = pair
    p.send(Generate(id="s3", prompt=PROMPT[::-1], max_tokens=1, temperature=0.0, stream_state=True))
    m = p.next(lambda m: m.id == "s3" and isinstance(m, KVChunk), 60)
    assert isinstance(m, KVChunk)
    p.send(Cancel(id="s3"))
    m = p.next(lambda m: m.id == "s3" and isinstance(m, (Done, Error)), 60)
    assert isinstance(m, Done) and m.finish_reason == "cancelled"
    st = pong(p, "after")
    assert not st.busy and "s3" not in st.running_ids
    # the stream is gone: a late ack is ignored, the worker serves on
    p.send(KVAck(id="s3", seq=0))
    p.send(Generate(id="s4", prompt=PROMPT[:20], max_tokens=2, temperature=0.0))
    _, done = p.stream("s4", 60)
    assert isinstance(done, Done)
