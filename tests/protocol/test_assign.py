"""Assign (protocol version 10): a warm spare is given its model. It round-trips, and every
defect is rejected at the codec boundary, on encode and on decode, naming the field."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from protocol import PROTOCOL_VERSION, Assign, Hello, ProtocolError, decode, encode


def _raw(**fields: Any) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": "assign", "id": "a1", **fields}, use_bin_type=True)


def test_assign_round_trips_with_every_field() -> None:
    full = Assign(id="assign-1-1", model="smollm2", gguf="/m/SmolLM2.gguf", n_ctx=2048, chat_template="chatml",
                  max_queue=3, parallel=4, kv_budget_mib=512.5, weights="quantized", n_ubatch=256, threads=2,
                  slot_save_path="/tmp/slots", kv_cache_dir="/tmp/kv/smollm2", kv_cache_mib=100.0)
    assert decode(encode(full)) == full
    minimal = Assign(id="a", model="m", gguf="/x.gguf")
    assert decode(encode(minimal)) == minimal
    assert decode(_raw(model="m", gguf="/x.gguf", kv_budget_mib=64)) == Assign(id="a1", model="m", gguf="/x.gguf",
                                                                                kv_budget_mib=64.0)


def test_a_spare_says_hello_without_a_model() -> None:
    h = Hello(id="worker-1", model="", pid=1, auth="s" * 64)
    assert decode(encode(h)) == h


@pytest.mark.parametrize("fields, named", [
    ({"gguf": "/x.gguf"}, "missing field 'model'"),
    ({"model": "m"}, "missing field 'gguf'"),
    ({"model": "", "gguf": "/x.gguf"}, "non-empty"),
    ({"model": "m", "gguf": "/x.gguf", "n_ctx": 0}, "n_ctx"),
    ({"model": "m", "gguf": "/x.gguf", "n_ubatch": -1}, "n_ubatch"),
    ({"model": "m", "gguf": "/x.gguf", "parallel": 0}, "parallel"),
    ({"model": "m", "gguf": "/x.gguf", "max_queue": -1}, "max_queue"),
    ({"model": "m", "gguf": "/x.gguf", "threads": -2}, "threads"),
    ({"model": "m", "gguf": "/x.gguf", "kv_budget_mib": 0}, "kv_budget_mib"),
    ({"model": "m", "gguf": "/x.gguf", "kv_cache_mib": -1.0}, "kv_cache_mib"),
    ({"model": "m", "gguf": "/x.gguf", "weights": "f16"}, "weights"),
    ({"model": "m", "gguf": "/x.gguf", "threads": "2"}, "field 'threads'"),
    ({"model": "m", "gguf": "/x.gguf", "parallel": True}, "field 'parallel'"),
    ({"model": "m", "gguf": "/x.gguf", "argv": ["--evil"]}, "unknown field"),
])
def test_a_bad_assign_is_rejected_at_decode_naming_the_field(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(_raw(**fields))
    assert named in e.value.reason and e.value.msg_id == "a1"


def test_a_bad_assign_is_not_encoded() -> None:
    with pytest.raises(ProtocolError, match="parallel"):
        encode(Assign(id="a", model="m", gguf="/x.gguf", parallel=0))


def test_an_assign_of_another_version_is_rejected() -> None:
    frame = msgpack.packb({"v": 9, "type": "assign", "id": "a1", "model": "m", "gguf": "/x"}, use_bin_type=True)
    with pytest.raises(ProtocolError, match="version"):
        decode(frame)
