"""KV-state stream frames (KVChunk / KVAck): validated at the codec boundary, within the frame limit."""

from __future__ import annotations

import msgpack
import pytest

from protocol import (
    KV_CHUNK_BYTES,
    KV_CHUNK_MAX_BYTES,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    KVAck,
    KVChunk,
    ProtocolError,
    decode,
    encode,
)


def raw(**fields: object) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def test_limits_fit_the_frame() -> None:
    assert 0 < KV_CHUNK_BYTES <= KV_CHUNK_MAX_BYTES < MAX_FRAME_BYTES - 4096
    full = KVChunk(id="x" * 128, seq=2**62, data=b"\xff" * KV_CHUNK_MAX_BYTES, last=True)
    frame = encode(full)
    assert len(frame) <= MAX_FRAME_BYTES and decode(frame) == full


@pytest.mark.parametrize("fields, why", [
    ({"seq": -1, "data": b"a"}, "seq must be >= 0"),
    ({"seq": 0, "data": b""}, "1..4194304 bytes"),
    ({"seq": 0, "data": b"a" * (KV_CHUNK_MAX_BYTES + 1)}, "1..4194304 bytes"),
    ({"seq": 0, "data": "text, not bytes"}, "field 'data'"),
    ({"seq": True, "data": b"a"}, "field 'seq'"),
    ({"seq": 0.0, "data": b"a"}, "field 'seq'"),
    ({"seq": 0, "data": b"a", "last": 1}, "field 'last'"),
    ({"data": b"a"}, "missing field 'seq'"),
    ({"seq": 0, "data": b"a", "offset": 3}, "unknown field"),
])
def test_malformed_chunks_refused_on_decode_and_encode(fields: dict, why: str) -> None:
    with pytest.raises(ProtocolError, match=why) as e:
        decode(raw(type="kv_chunk", id="x1", **fields))
    assert e.value.msg_id == "x1"  # the receiver can answer an Error for that stream
    if "field" not in why:  # well-typed but out of range: the sender refuses it too
        with pytest.raises(ProtocolError, match=why):
            encode(KVChunk(id="x1", **fields))


def test_ack_refuses_a_negative_seq() -> None:
    with pytest.raises(ProtocolError, match="seq must be >= 0"):
        decode(raw(type="kv_ack", id="x1", seq=-3))
    assert decode(encode(KVAck(id="x1", seq=0))) == KVAck(id="x1", seq=0)
