"""Round-trip every message type; reject every malformed kind; fuzz the decoder."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol
from protocol.kv_events import AllBlocksCleared, KvEvents, encode_batch
from protocol import (
    MAX_FRAME_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Accepted,
    ApplyTemplate,
    Assign,
    ApplyTemplateResult,
    Cancel,
    Detokenize,
    DetokenizeResult,
    Done,
    Error,
    Generate,
    Hello,
    KVAck,
    KVChunk,
    LoadProgress,
    Ping,
    Pong,
    PromptProgress,
    ProtocolError,
    Ready,
    Shutdown,
    SlotAction,
    SlotActionResult,
    Token,
    Tokenize,
    TokenIds,
    TokenizeResult,
    decode,
    encode,
)

EXAMPLES = [
    Hello(id="w1", model="smollm2", pid=123),
    LoadProgress(id="w1", stage="reading_gguf", done=0, total=1),
    LoadProgress(id="w1", stage="preparing_tensors", done=273, total=273),
    LoadProgress(id="w1", stage="loading_kernels", done=0, total=1),
    Ready(id="w1", model="smollm2", architecture="llama", gguf_path="/m/x.gguf", file_size=98362432,
          fingerprint="ab" * 32, n_ctx=8192, n_ctx_train=8192, n_vocab=49152, has_chat_template=True,
          pid=123, load_ms=812.5),
    Accepted(id="r1", prompt_tokens=12, set_aside=['Unimplemented keys: ["propertyNames"]']),
    PromptProgress(id="r1", total=12, cache=4, processed=4, time_ms=0.0),
    PromptProgress(id="r1", total=12, cache=4, processed=12, time_ms=35.5),
    Token(id="r1", text="caf", token_id=42, piece=b"caf\xc3"),
    Token(id="r1", text="é", token_id=43, piece=b"\xa9", logprob=-0.25, top_logprobs=[[43, -0.25], [7, -2.0]]),
    Done(id="r1", finish_reason="stop", stop_type="word", stopping_word="\n\n", text="tail",
         prompt_tokens=10, completion_tokens=5, prompt_n=3, prompt_ms=12.0, predicted_n=5,
         predicted_ms=99.5, cache_n=7),
    Error(id="r1", code="context_length_exceeded", message="maximum context length is 8192 tokens"),
    Pong(id="p1", busy=True, queue_len=1, running_ids=["r1"], slots=[{"id": 0, "id_task": "r1", "is_processing": True, "n_past": 5}],
         n_decode_total=7, n_busy_slots_total=9, pid=123),
    Pong(id="p2", busy=False, queue_len=0, pid=123),
    TokenizeResult.of("t1", [1, 2, 3], [b"a", b"b", b"\xff"]),
    TokenizeResult.of("t0", []),
    DetokenizeResult(id="t2", content="hello"),
    ApplyTemplateResult(id="t3", prompt="<|im_start|>user\nhi<|im_end|>\n"),
    Generate(id="r1", prompt="Once upon a time", max_tokens=16, temperature=0.0, stop=["\n"], n_probs=5,
             logit_bias=[[15, -100.0]], seed=7),
    Generate(id="r2", prompt=[1, 2, 3], max_tokens=None),
    Generate(id="r3", messages=[{"role": "user", "content": "hi"}], add_special=False),
    Cancel(id="r1"),
    Assign(id="a1", model="smollm2", gguf="/m/x.gguf", n_ctx=2048, weights="quantized", threads=1),
    Ping(id="p1"),
    Shutdown(id="s1"),
    Tokenize(id="t1", content="Hello <|im_end|>", add_special=True, parse_special=False, with_pieces=True),
    Detokenize(id="t2", tokens=TokenIds.of([1, 2, 3])),
    ApplyTemplate(id="t3", messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False),
    SlotAction(id="s1", action="save", id_slot=0, filename="conv.bin"),
    SlotActionResult(id="s1", action="save", id_slot=0, filename="conv.bin", n_tokens=1745, n_bytes=14309796,
                     ms=49.9),
    Generate(id="r4", prompt=[1, 2], max_tokens=1, stream_state=True),
    KVChunk(id="x1", seq=0, data=b"MYKVSTAT\x01\x00", last=False),
    KVChunk(id="x1", seq=7, data=bytes(range(256)) * 4, last=True),
    KVAck(id="x1", seq=3),
    KvEvents(id="w", seq=0, payload=encode_batch(1.0, [AllBlocksCleared()])),
]


def test_examples_cover_every_type() -> None:
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: f"{m.TYPE}")
def test_round_trip(msg: protocol.Message) -> None:
    frame = encode(msg)
    assert isinstance(frame, bytes)
    back = decode(frame)
    assert type(back) is type(msg)
    assert back == msg


def _raw(**fields: object) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


GOOD = {"v": PROTOCOL_VERSION, "type": "cancel", "id": "r1"}


@pytest.mark.parametrize(
    "frame, needle",
    [
        (b"", "malformed"),
        (b"\xc1", "malformed"),  # never-used msgpack byte
        (msgpack.packb([1, 2, 3]), "must be a map"),
        (msgpack.packb("hello"), "must be a map"),
        (_raw(**GOOD) + b"\x00", "malformed"),  # trailing data
        (_raw(**GOOD)[:-1], "malformed"),  # truncated
        (_raw(**{**GOOD, "v": PROTOCOL_VERSION + 1}), "version"),
        (_raw(**{**GOOD, "v": True}), "version"),
        (_raw(type="cancel", id="r1"), "version"),
        (_raw(**{**GOOD, "type": "explode"}), "unknown message type"),
        (_raw(**{**GOOD, "type": 5}), "unknown message type"),
        (_raw(**{**GOOD, "id": ""}), "'id'"),
        (_raw(**{**GOOD, "id": 17}), "'id'"),
        (_raw(**{**GOOD, "id": "x" * 129}), "'id'"),
        (_raw(**{**GOOD, "extra": 1}), "unknown field"),
        (_raw(v=PROTOCOL_VERSION, type="hello", id="w", model="m"), "missing field 'pid'"),
        (_raw(v=PROTOCOL_VERSION, type="hello", id="w", model="m", pid="12"), "field 'pid'"),
        (_raw(v=PROTOCOL_VERSION, type="hello", id="w", model="m", pid=True), "field 'pid'"),
        (_raw(v=PROTOCOL_VERSION, type="generate", id="r", prompt=[1, "2"]), "field 'prompt'"),
        (_raw(v=PROTOCOL_VERSION, type="generate", id="r", prompt=3.5), "field 'prompt'"),
        (_raw(v=PROTOCOL_VERSION, type="generate", id="r", temperature="hot"), "field 'temperature'"),
        (_raw(v=PROTOCOL_VERSION, type="generate", id="r", stop="\n"), "field 'stop'"),
        (_raw(v=PROTOCOL_VERSION, type="generate", id="r", messages=[1]), "field 'messages'"),
        (_raw(v=PROTOCOL_VERSION, type="token", id="r", text="a", token_id=1, piece="not-bytes"), "field 'piece'"),
        (_raw(v=PROTOCOL_VERSION, type="load_progress", id="w", stage="dreaming", done=0, total=1), "stage"),
        (_raw(v=PROTOCOL_VERSION, type="load_progress", id="w", stage="preparing_tensors", done=5, total=4),
         "done=5 total=4"),
        (_raw(v=PROTOCOL_VERSION, type="load_progress", id="w", stage="preparing_tensors", done=-1, total=4),
         "done=-1"),
        (_raw(v=PROTOCOL_VERSION, type="load_progress", id="w", stage="reading_gguf", done=0, total=0), "total=0"),
        (_raw(v=PROTOCOL_VERSION, type="prompt_progress", id="r", total=8, cache=5, processed=4, time_ms=1.0),
         "cache=5 processed=4"),
        (_raw(v=PROTOCOL_VERSION, type="prompt_progress", id="r", total=8, cache=0, processed=9, time_ms=1.0),
         "processed=9"),
        (_raw(v=PROTOCOL_VERSION, type="prompt_progress", id="r", total=8, cache=0, processed=4, time_ms=-1.0),
         "time_ms"),
        (msgpack.packb({1: 2}), "malformed"),  # non-string map key
        (msgpack.packb(msgpack.ExtType(1, b"x")), "ext type"),
        (b"\x00" * (MAX_FRAME_BYTES + 1), "exceeds"),
    ],
)
def test_rejects_malformed(frame: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError) as ei:
        decode(frame)
    assert needle in str(ei.value)


def test_error_carries_request_id_when_readable() -> None:
    with pytest.raises(ProtocolError) as ei:
        decode(_raw(v=PROTOCOL_VERSION, type="generate", id="req-9", temperature="hot"))
    assert ei.value.msg_id == "req-9"


def test_int_accepted_for_float_and_normalised() -> None:
    msg = decode(_raw(v=PROTOCOL_VERSION, type="generate", id="r", temperature=1))
    assert isinstance(msg, Generate) and msg.temperature == 1.0 and isinstance(msg.temperature, float)


def test_defaults_fill_optional_fields() -> None:
    msg = decode(_raw(v=PROTOCOL_VERSION, type="generate", id="r", prompt="x"))
    assert isinstance(msg, Generate)
    assert msg.stop == [] and msg.n_probs == 0 and msg.max_tokens is None


def test_encode_refuses_out_of_range_load_progress() -> None:
    with pytest.raises(ProtocolError, match="done=3 total=2"):
        encode(LoadProgress(id="w", stage="preparing_tensors", done=3, total=2))


def test_encode_refuses_invalid_record() -> None:
    with pytest.raises(ProtocolError):
        encode(Hello(id="w", model="m", pid="not-an-int"))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        encode(Cancel(id=""))


def test_encode_refuses_oversized_frame() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(DetokenizeResult(id="x", content="a" * (MAX_FRAME_BYTES + 10)))


def test_no_pickle_anywhere() -> None:
    import pathlib

    root = pathlib.Path(protocol.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "pickle." not in text, path


# ---------------------------------------------------------------- property tests

@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
_keys = st.sampled_from(["v", "type", "id", "prompt", "messages", "text", "token_id", "piece", "pid",
                         "model", "code", "message", "tokens", "content", "stop", "n_probs", "busy"])


@settings(max_examples=400, deadline=None)
@given(
    st.dictionaries(_keys, _values, max_size=8),
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.booleans(),
)
def test_fuzz_random_maps_only_protocol_error(fields: dict, tag: str, envelope: bool) -> None:
    if envelope:
        fields = {**fields, "v": PROTOCOL_VERSION, "type": tag}
    frame = msgpack.packb(fields, use_bin_type=True)
    try:
        msg = decode(frame)
    except ProtocolError:
        return
    # Anything accepted must be a complete, valid record that round-trips.
    assert decode(encode(msg)) == msg


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(EXAMPLES), st.data())
def test_fuzz_mutated_valid_frames(msg: protocol.Message, data: st.DataObject) -> None:
    frame = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    try:
        back = decode(bytes(frame))
    except ProtocolError:
        return
    assert dataclasses.is_dataclass(back)
    assert decode(encode(back)) == back


@pytest.mark.parametrize("big", [2**64, -(2**63) - 1, 10**30])
def test_encode_turns_unpackable_int_into_protocol_error(big: int) -> None:
    """An int msgpack cannot carry is a ProtocolError at the sender, never OverflowError."""
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode(Generate(id="r", prompt="x", seed=big))
    with pytest.raises(OverflowError):  # token ids are int32: TokenIds.of refuses it before any frame
        TokenIds.of([1, big])


def test_token_ids_travel_as_int32_bytes_whose_length_is_checked() -> None:
    """TokenIds is the one packed form of token-id lists: int32 little-endian, a whole number
    of 4-byte ids on encode and on decode; pieces and their ends agree with the tokens."""
    ids = [0, 1, 49151, 2**31 - 1]
    res = TokenizeResult.of("t", ids, [b"a", b"", b"\xff\xfe", b"xyz"])
    back = decode(encode(res))
    assert isinstance(back, TokenizeResult) and type(back.tokens) is TokenIds
    assert back.tokens == b"".join(i.to_bytes(4, "little") for i in ids)
    assert back.tokens.count == 4 and list(back.tokens.view()) == ids and back.tokens.tolist() == ids
    assert back.piece_slice(0, 4) == [b"a", b"", b"\xff\xfe", b"xyz"] and back.piece_slice(2, 3) == [b"\xff\xfe"]
    body = msgpack.unpackb(encode(Detokenize(id="d", tokens=TokenIds.of(ids))))
    for bad in (b"\0\0\0", b"\0" * 5, [1, 2]):
        with pytest.raises(ProtocolError, match="'tokens'"):
            decode(msgpack.packb({**body, "tokens": bad}))
        with pytest.raises(ProtocolError, match="'tokens'"):
            encode(Detokenize(id="d", tokens=bad))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="piece_ends"):
        encode(TokenizeResult(id="t", tokens=TokenIds.of([1, 2]), pieces=b"ab", piece_ends=TokenIds.of([1])))
    with pytest.raises(ProtocolError, match="piece_ends ends at 3"):
        encode(TokenizeResult(id="t", tokens=TokenIds.of([1, 2]), pieces=b"ab", piece_ends=TokenIds.of([1, 3])))
    with pytest.raises(ProtocolError, match="pieces without piece_ends"):
        encode(TokenizeResult(id="t", tokens=TokenIds.of([1]), pieces=b"a"))
