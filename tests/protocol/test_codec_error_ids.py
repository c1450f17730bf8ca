"""ProtocolError must be answerable: its msg_id is a valid request id, its reason bounded."""

from __future__ import annotations

import msgpack
import pytest

from protocol import PROTOCOL_VERSION, Error, ProtocolError, decode, encode
from protocol.codec import MAX_ID_LEN


def _raw(**kw: object) -> bytes:
    return msgpack.packb(kw, use_bin_type=True)


@pytest.mark.parametrize("bad_id", ["", "x" * (MAX_ID_LEN + 1), "y" * 100_000])
def test_msg_id_is_none_when_id_is_not_a_valid_request_id(bad_id: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        decode(_raw(v=PROTOCOL_VERSION, type="no-such-type", id=bad_id))
    assert ei.value.msg_id is None


def test_msg_id_of_a_rejected_frame_can_be_answered() -> None:
    with pytest.raises(ProtocolError) as ei:
        decode(_raw(v=PROTOCOL_VERSION, type="generate", id="r" * MAX_ID_LEN, temperature="hot"))
    assert ei.value.msg_id == "r" * MAX_ID_LEN
    answer = Error(id=ei.value.msg_id, code="protocol_error", message=ei.value.reason)
    assert decode(encode(answer)) == answer


def test_reason_quoting_a_huge_value_is_cut() -> None:
    with pytest.raises(ProtocolError) as ei:
        decode(_raw(v=PROTOCOL_VERSION, type="t" * 1_000_000, id="r"))
    assert "unknown message type" in ei.value.reason
    assert len(ei.value.reason) <= ProtocolError.MAX_REASON_CHARS + 3
    assert ei.value.msg_id == "r"
