"""KV events of a real ``python -m worker`` process (tiny GGUF), read as an outside router reads
them: a plain ZeroMQ SUB socket on ``--kv-events-endpoint``, each message ``[topic, seq, payload]``
decoded with plain msgpack as vLLM's format describes (``vllm/distributed/kv_events.py``:
``KVEventBatch`` = ``[ts, events]``, each event an array tagged by its class name); the same
payloads reach the router as KvEvents frames with ``--kv-events-to-router``."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from protocol import Done, Generate, Shutdown, Tokenize, TokenizeResult
from protocol.kv_events import KvEvents, block_hashes
from tests.worker.router_stub import RouterStub, spawn_worker
from tests.worker.tiny_gguf import write_tiny_llama

BS = 16
PROMPT = ("The cat sat on the mat while the dog barked at nothing in particular under the bridge near the "
          "market square, and the bird sang a song about the river and the old mill by the hill.")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("g") / "tiny.gguf", n_ctx_train=512)


def recv(sub: zmq.Socket[bytes], timeout_s: float = 30.0) -> tuple[bytes, int, list[Any]]:
    """One published batch: (topic, seq, [ts, events]) decoded with nothing but msgpack."""
    assert sub.poll(int(timeout_s * 1000)), "no KV-events batch published"
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and isinstance(batch[0], float) and isinstance(batch[1], list)
    return topic, int.from_bytes(seq, "big"), batch


def test_a_plain_sub_socket_reads_a_requests_blocks_and_the_unload(gguf: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)  # before the worker binds: ZeroMQ connects once it does
    stub = RouterStub("tcp://127.0.0.1:*")
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = spawn_worker(str(gguf), stub.endpoint, "--n-ctx", "512", "--parallel", "1",
                            "--kv-events-endpoint", endpoint, "--kv-events-to-router", model="tiny")
        stub.handshake(60)
        topic, seq, (_, events) = recv(sub)
        assert (topic, seq, events) == (b"tiny", 0, [["AllBlocksCleared"]])  # the first batch after a load

        stub.send(Tokenize(id="tk", content=PROMPT, add_special=True))
        res = stub.next_for("tk")
        assert isinstance(res, TokenizeResult)
        ids = res.tokens.tolist()
        n_full = len(ids) // BS
        assert n_full >= 2
        stub.send(Generate(id="g", prompt=PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True))
        _, done = stub.stream("g", 60)
        assert isinstance(done, Done) and done.prompt_tokens == len(ids)

        stored: list[list[Any]] = []
        last = 0
        while sum(len(e[1]) for e in stored) < n_full:
            topic, seq, (_, events) = recv(sub)
            assert topic == b"tiny" and seq == last + 1  # no gap
            last = seq
            for ev in events:
                assert ev[0] == "BlockStored", ev  # nothing was removed
                stored.append(ev)
        # ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
        hashes = [h for ev in stored for h in ev[1]]
        tokens = [t for ev in stored for t in ev[3]]
        assert tokens[:n_full * BS] == ids[:n_full * BS]  # the prompt's full blocks, as the worker tokenized it
        assert hashes == block_hashes(tokens, BS)
        for ev in stored:
            assert ev[4] == BS and ev[5] is None and ev[6] == "CPU" and len(ev[3]) == BS * len(ev[1])
        assert stored[0][2] is None and all(ev[2] == hashes[hashes.index(ev[1][0]) - 1] for ev in stored[1:])

        # the router got the same batches, numbered alike
        frames = [m for _, m in stub.received if isinstance(m, KvEvents)]
        assert [f.seq for f in frames] == list(range(last + 1))
        assert msgpack.unpackb(frames[0].payload)[1] == [["AllBlocksCleared"]]

        stub.send(Shutdown(id="bye"))  # the model unloads: its cache is gone
        topic, seq, (_, events) = recv(sub)
        assert (topic, seq, events) == (b"tiny", last + 1, [["AllBlocksCleared"]])
        assert proc.wait(30) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        stub.close()
        sub.close()
        ctx.term()
