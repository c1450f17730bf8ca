"""KV events in vLLM's format (protocol.kv_events): hashes, batches, the KvEvents frame."""

from __future__ import annotations

import msgpack
import pytest

from protocol import codec
from protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvents,
    block_hashes,
    decode_batch,
    encode_batch,
    seq_bytes,
)


def test_block_hashes_chain_and_cover_full_blocks_only() -> None:
    ids = list(range(100, 140))  # 40 tokens: two full blocks of 16
    hs = block_hashes(ids, 16)
    assert len(hs) == 2 and all(0 <= h < 2**63 for h in hs)
    assert block_hashes(ids[:32], 16) == hs  # the tail does not change named blocks
    assert block_hashes(ids[16:32], 16, parent=hs[0]) == hs[1:]  # chaining continues from a parent
    assert block_hashes([1] + ids[1:], 16)[1] != hs[1]  # a block's name depends on its ancestors
    assert block_hashes(ids[:15], 16) == []
    with pytest.raises(ValueError):
        block_hashes(ids, 0)


def test_batch_is_vllm_array_like_msgpack() -> None:
    hs = block_hashes(list(range(32)), 16)
    events = [BlockStored(hs, None, list(range(32)), 16), BlockRemoved(hs[1:]), AllBlocksCleared()]
    raw = msgpack.unpackb(encode_batch(12.5, events))
    assert raw == [12.5, [["BlockStored", hs, None, list(range(32)), 16, None, "CPU"],
                          ["BlockRemoved", hs[1:], "CPU"], ["AllBlocksCleared"]]]
    assert decode_batch(encode_batch(12.5, events)) == (12.5, events)
    # a trailing data_parallel_rank and vLLM's older short BlockStored decode too
    short = msgpack.packb([1, [["BlockStored", hs[:1], None, list(range(16)), 16]], 0])
    assert decode_batch(short) == (1.0, [BlockStored(hs[:1], None, list(range(16)), 16, None, "CPU")])
    assert seq_bytes(5) == b"\x00" * 7 + b"\x05"


@pytest.mark.parametrize("payload", [
    b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1, [["Nope"]]]),
    msgpack.packb([1, [["BlockStored", [1], None, [1, 2], 16, None, "CPU"]]]),  # 2 tokens for a block of 16
    msgpack.packb([1, [["BlockRemoved", ["x"], "CPU"]]]), msgpack.packb([True, []]),
])
def test_malformed_batches_are_refused(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_kv_events_frame_round_trips_and_validates_its_payload() -> None:
    msg = KvEvents(id="w", seq=3, payload=encode_batch(1.0, [AllBlocksCleared()]))
    assert codec.decode(codec.encode(msg)) == msg
    with pytest.raises(codec.ProtocolError):
        codec.encode(KvEvents(id="w", seq=0, payload=b"\x93\x01"))
