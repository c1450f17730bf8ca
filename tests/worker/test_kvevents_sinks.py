"""The worker's KV-event sinks (worker.kvevents): one seq for the PUB socket and the router's
KvEvents frames, the same payloads, a batch too large for one payload split, a final
AllBlocksCleared at close, and a failed bind leaving the worker without the socket."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from protocol import Message
from protocol.kv_events import AllBlocksCleared, BlockStored, KvEvents, block_hashes, decode_batch
from worker import kvevents
from worker.kvevents import KvEventSinks


def test_both_sinks_share_one_seq_and_the_payloads(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[Message] = []
    sinks = KvEventSinks("m", "tcp://127.0.0.1:*", "worker-1", sent.append)
    assert sinks.pub is not None
    endpoint = sinks.pub.getsockopt_string(zmq.LAST_ENDPOINT)
    assert KvEventSinks("m", endpoint, "worker-2", None).pub is None  # the port is taken: logged, no socket
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"m")
    sub.connect(endpoint)
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(20):  # until the subscription reached the publisher
            assert time.monotonic() < deadline
            sinks.publish(time.time(), [AllBlocksCleared()])
        while sub.poll(100):
            sub.recv_multipart()
        first = sinks.seq
        ids = list(range(64))
        big = [BlockStored(block_hashes(ids[i:i + 16], 16), None, ids[i:i + 16], 16) for i in range(0, 64, 16)]
        monkeypatch.setattr(kvevents, "MAX_BATCH_BYTES", len(msgpack.packb([1.0, [big[0].to_wire()]])) * 2)
        sinks.publish(5.0, big)  # too large for one payload: split, in order
        sinks.close(1000)  # the cache goes with the worker
        got = [sub.recv_multipart() for _ in range(sinks.seq - first)]
    finally:
        sub.close(linger=0)
        ctx.term()
    assert all(t == b"m" for t, _, _ in got)
    assert [int.from_bytes(s, "big") for _, s, _ in got] == list(range(first, sinks.seq))
    events = [ev for _, _, p in got for ev in decode_batch(p)[1]]
    assert events == big + [AllBlocksCleared()] and len(got) > 2
    frames = [m for m in sent if isinstance(m, KvEvents)]
    assert [f.seq for f in frames] == list(range(sinks.seq)) and len(frames) == len(sent)
    assert [f.payload for f in frames[first:]] == [p for _, _, p in got]
    assert all(f.id == "worker-1" for f in frames)


def test_a_sink_that_told_nothing_sends_nothing_at_close() -> None:
    sent: list[Message] = []
    sinks = KvEventSinks("m", None, "w", sent.append)
    sinks.close(0)
    assert sent == [] and sinks.pub is None


def test_the_worker_flags() -> None:
    from worker.__main__ import parse_args

    base = ["--model", "m", "--gguf", "g.gguf", "--endpoint", "ipc:///tmp/x.sock"]
    a = parse_args(base)
    assert (a.kv_events_endpoint, a.kv_events_block_size, a.kv_events_to_router) == (None, 16, False)  # off
    a = parse_args(base + ["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-block-size", "32",
                           "--kv-events-to-router"])
    assert (a.kv_events_endpoint, a.kv_events_block_size, a.kv_events_to_router) == ("tcp://127.0.0.1:5557", 32, True)
    for bad in (["--kv-events-endpoint", "udp://127.0.0.1:5557"], ["--kv-events-block-size", "0"]):
        with pytest.raises(SystemExit):
            parse_args(base + bad)
