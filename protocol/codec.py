"""The one codec for router <-> worker frames: msgpack, validated on receipt.

``encode(msg) -> bytes`` and ``decode(frame) -> Message``. Decoding either
returns a fully validated message or raises :class:`ProtocolError`; it never
raises anything else and never returns a half-parsed record. Checks, in order:

1. frame size <= ``MAX_FRAME_BYTES`` (before unpacking);
2. msgpack well-formed, one object, a map with string keys (msgpack's own
   length limits bound every container);
3. ``v`` == ``PROTOCOL_VERSION``; ``type`` is a known tag; ``id`` a 1..128-char str;
4. every required field present, no unknown field, every value of its declared
   type (recursively: lists, maps, unions; bool is not an int; an int is
   accepted where a float is declared and converted; a ``TokenIds`` is a ``bin``
   whose length is a multiple of 4);
5. the values together, by the record's ``value_problem`` (e.g. LoadProgress's
   stage and counts).

No pickle, no ext types: msgpack ext frames are rejected.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

import msgpack

from protocol.frame import MAX_FRAME_BYTES, PROTOCOL_VERSION, Message
from protocol.messages import MESSAGE_TYPES
from protocol.token_ids import TokenIds

MAX_ID_LEN = 128
_ENVELOPE = ("v", "type", "id")


class ProtocolError(ValueError):
    """A frame was rejected. ``msg_id`` is the frame's id when it could be read
    (so the peer can answer an Error for that request), else None."""

    #: Longer reasons are cut (a reason quotes offending values, which may be huge).
    MAX_REASON_CHARS = 500

    def __init__(self, reason: str, msg_id: str | None = None) -> None:
        if len(reason) > self.MAX_REASON_CHARS:
            reason = reason[: self.MAX_REASON_CHARS] + "..."
        super().__init__(reason)
        self.reason = reason
        self.msg_id = msg_id


def encode(msg: Message) -> bytes:
    """Serialise ``msg`` to one msgpack frame (bytes).

    Raises ProtocolError (only) if the record does not validate (a bug on the sending
    side is caught here rather than at the peer), msgpack cannot carry a value (an
    integer outside [-2**63, 2**64-1], a string with a lone surrogate) or the frame
    exceeds MAX_FRAME_BYTES.
    """
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": msg.TYPE}
    for f in dataclasses.fields(msg):
        body[f.name] = getattr(msg, f.name)
    _validate_fields(type(msg), body, msg.id)
    try:
        frame = msgpack.packb(body, use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as e:  # e.g. an int outside [-2**63, 2**64-1]
        raise ProtocolError(f"{msg.TYPE}: cannot encode: {type(e).__name__}: {e}", msg.id) from None
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit", msg.id)
    return frame


def decode(frame: bytes) -> Message:
    """Parse and validate one frame. Raises ProtocolError (only) on any defect."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        obj = msgpack.unpackb(
            bytes(frame),
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_reject_ext,
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises a zoo of types (ExtraData, ValueError, UnicodeDecodeError...)
        raise ProtocolError(f"malformed msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame must be a map, got {type(obj).__name__}")
    msg_id = _readable_id(obj.get("id"))
    if obj.get("v") != PROTOCOL_VERSION or type(obj.get("v")) is not int:
        raise ProtocolError(f"unsupported protocol version {obj.get('v')!r} (expected {PROTOCOL_VERSION})", msg_id)
    tag = obj.get("type")
    if not isinstance(tag, str) or tag not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {tag!r}", msg_id)
    cls = MESSAGE_TYPES[tag]
    values = _validate_fields(cls, obj, msg_id)
    try:
        return cls(**values)
    except Exception as e:  # pragma: no cover - validation above should make this unreachable
        raise ProtocolError(f"cannot build {tag}: {e}", msg_id) from None


def _readable_id(ident: Any) -> str | None:
    """``ident`` if it is a valid request id (a str of 1..MAX_ID_LEN chars), else None:
    ProtocolError.msg_id must be usable as the id of an Error answer."""
    if isinstance(ident, str) and 1 <= len(ident) <= MAX_ID_LEN:
        return ident
    return None


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


@typing.no_type_check
def _hints(cls: type[Message]) -> dict[str, Any]:
    cached = _HINTS.get(cls)
    if cached is None:
        all_hints = typing.get_type_hints(cls)
        cached = {f.name: all_hints[f.name] for f in dataclasses.fields(cls)}
        _HINTS[cls] = cached
    return cached


_HINTS: dict[type, dict[str, Any]] = {}


def _validate_fields(cls: type[Message], obj: dict[str, Any], msg_id: str | None) -> dict[str, Any]:
    """Check ``obj`` against ``cls``'s fields; return the constructor kwargs."""
    hints = _hints(cls)
    unknown = set(obj) - set(hints) - set(_ENVELOPE)
    if unknown:
        raise ProtocolError(f"{cls.TYPE}: unknown field(s) {sorted(unknown)}", msg_id)
    ident = obj.get("id")
    if not isinstance(ident, str) or not (1 <= len(ident) <= MAX_ID_LEN):
        raise ProtocolError(f"{cls.TYPE}: 'id' must be a string of 1..{MAX_ID_LEN} characters", None)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in obj:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                raise ProtocolError(f"{cls.TYPE}: missing field '{f.name}'", msg_id)
            continue
        try:
            out[f.name] = _check(obj[f.name], hints[f.name])
        except _TypeMismatch as e:
            raise ProtocolError(f"{cls.TYPE}: field '{f.name}': {e}", msg_id) from None
    problem = cls.value_problem(out)
    if problem is not None:
        raise ProtocolError(f"{cls.TYPE}: {problem}", msg_id)
    return out


class _TypeMismatch(Exception):
    pass


#: Item types whose lists are checked in one pass over ``type()`` (exact types; anything
#: else goes item by item through :func:`_check`, which gives the same answer).
_EXACT_ITEMS: dict[Any, frozenset[type]] = {int: frozenset({int}), str: frozenset({str}),
                                            bytes: frozenset({bytes}), float: frozenset({int, float})}


def _check(value: Any, tp: Any) -> Any:
    """Return ``value`` (floats normalised) if it matches type ``tp``, else raise _TypeMismatch."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for alt in typing.get_args(tp):
            try:
                return _check(value, alt)
            except _TypeMismatch:
                continue
        raise _TypeMismatch(f"expected {tp}, got {type(value).__name__}")
    if tp is type(None):
        if value is None:
            return None
        raise _TypeMismatch(f"expected null, got {type(value).__name__}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _TypeMismatch(f"expected bool, got {type(value).__name__}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _TypeMismatch(f"expected int, got {type(value).__name__}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _TypeMismatch(f"expected float, got {type(value).__name__}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _TypeMismatch(f"expected str, got {type(value).__name__}")
    if tp is TokenIds:  # the one rule for packed ids: whole 4-byte items
        if not isinstance(value, bytes):
            raise _TypeMismatch(f"expected token ids (bytes), got {type(value).__name__}")
        if len(value) % TokenIds.ITEM_BYTES:
            raise _TypeMismatch(f"token ids: {len(value)} bytes is not a whole number of "
                                f"{TokenIds.ITEM_BYTES}-byte ids")
        return value if type(value) is TokenIds else TokenIds(value)
    if tp is bytes:
        if isinstance(value, bytes):
            return value
        raise _TypeMismatch(f"expected bytes, got {type(value).__name__}")
    if origin is list:
        if not isinstance(value, list):
            raise _TypeMismatch(f"expected list, got {type(value).__name__}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        if item_tp is Any:
            return value
        exact = _EXACT_ITEMS.get(item_tp)
        if exact is not None:  # one C-level pass (a 2.5M-token TokenizeResult: ms, not seconds)
            kinds = set(map(type, value))
            if kinds <= exact:
                return value if item_tp is not float or int not in kinds else list(map(float, value))
        return [_check(v, item_tp) for v in value]  # the precise error, or subclasses (IntEnum, ...)
    if origin is dict:
        if not isinstance(value, dict):
            raise _TypeMismatch(f"expected map, got {type(value).__name__}")
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        return {_check(k, key_tp): _check(v, val_tp) for k, v in value.items()}
    raise _TypeMismatch(f"unsupported declared type {tp}")  # pragma: no cover
