"""GGUF header reading: a bounds-checked cursor over the mapped header and the metadata values.

Numeric arrays become lists through one ``np.frombuffer(...).tolist()``, string arrays through a
tight ``struct.unpack_from`` loop (``gguf.GGUFReader`` builds one NumPy view per element of every
array field, which takes 10-15 s on Gemma 3's 262,144-token vocabulary). Arrays of at least
:data:`COMPACT_MIN_ITEMS` items are kept compact (:mod:`.arrays`).
"""

from __future__ import annotations

import array
import mmap
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
from gguf import GGUFValueType

from ..errors import EngineError
from .arrays import NumericArray, StringArray

# fixed-size scalar value types: struct format and numpy dtype (little-endian)
_SCALARS: dict[int, tuple[str, str]] = {
    GGUFValueType.UINT8: ("<B", "<u1"),
    GGUFValueType.INT8: ("<b", "<i1"),
    GGUFValueType.UINT16: ("<H", "<u2"),
    GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"),
    GGUFValueType.INT32: ("<i", "<i4"),
    GGUFValueType.FLOAT32: ("<f", "<f4"),
    GGUFValueType.UINT64: ("<Q", "<u8"),
    GGUFValueType.INT64: ("<q", "<i8"),
    GGUFValueType.FLOAT64: ("<d", "<f8"),
    GGUFValueType.BOOL: ("<?", "<u1"),
}

#: Metadata arrays of at least this many items are kept compact (:class:`StringArray`,
#: :class:`NumericArray`) instead of as Python lists.
COMPACT_MIN_ITEMS = 256
#: The string array whose items' ``hash()`` values are computed while reading (the tokenizer's
#: str -> id index needs them; they are free while each ``str`` exists anyway).
_HASHED_KEY = "tokenizer.ggml.tokens"

_MAX_ARRAY_DEPTH = 8               # nested arrays deeper than this are rejected


class Cursor:
    """Bounds-checked little-endian reads from a buffer; overruns -> invalid_gguf."""

    __slots__ = ("buf", "pos", "size", "path")

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def fail(self, what: str) -> EngineError:
        return EngineError("invalid_gguf", f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated file while reading {what} at byte {self.pos}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return _decode(raw)


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace")



def read_metadata(cur: Cursor, n_kv: int) -> dict[str, Any]:
    """The ``n_kv`` key/value pairs at the cursor: ``{key: value}`` in file order.

    Raises: EngineError("invalid_gguf") for a truncated or malformed value, a duplicate key."""
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        vtype = cur.u32(f"value type of {key!r}")
        value = read_value(cur, vtype, key)
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        metadata[key] = value
    return metadata


def read_value(cur: Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    """Read one metadata value of type ``vtype`` into a plain Python value (an array: a list, or
    compact from :data:`COMPACT_MIN_ITEMS` items)."""
    if vtype in _SCALARS:
        fmt, _ = _SCALARS[vtype]
        size = struct.calcsize(fmt)
        cur.need(size, f"value of {key!r}")
        (v,) = struct.unpack_from(fmt, cur.buf, cur.pos)
        cur.pos += size
        return bool(v) if vtype == GGUFValueType.BOOL else v
    if vtype == GGUFValueType.STRING:
        return cur.string(f"value of {key!r}")
    if vtype == GGUFValueType.ARRAY:
        if depth >= _MAX_ARRAY_DEPTH:
            raise cur.fail(f"arrays nested too deeply in {key!r}")
        return _read_array(cur, key, depth)
    raise cur.fail(f"unknown value type {vtype} for key {key!r}")


def _read_array(cur: Cursor, key: str, depth: int) -> Any:
    itype = cur.u32(f"array type of {key!r}")
    count = cur.u64(f"array length of {key!r}")
    if itype in _SCALARS:
        _, dt = _SCALARS[itype]
        nbytes = count * np.dtype(dt).itemsize
        cur.need(nbytes, f"array {key!r}")
        arr = np.frombuffer(cur.buf[cur.pos:cur.pos + nbytes], dtype=dt, count=count)
        cur.pos += nbytes
        if itype == GGUFValueType.BOOL:
            arr = arr.astype(bool)
        if count >= COMPACT_MIN_ITEMS:
            return NumericArray(arr)  # over the bytes copy of the slice: read-only, not copied again
        return arr.tolist()
    if itype == GGUFValueType.STRING:
        # every string needs at least its 8-byte length: reject absurd counts early
        cur.need(count * 8, f"array {key!r}")
        if count >= COMPACT_MIN_ITEMS:
            return _string_array(cur, count, key)
        return [t for t, _ in _strings(cur, count, key)]
    if itype == GGUFValueType.ARRAY:
        return [read_value(cur, GGUFValueType.ARRAY, key, depth + 1) for _ in range(count)]
    raise cur.fail(f"unknown array item type {itype} for key {key!r}")


def _strings(cur: Cursor, count: int, key: str) -> Iterator[tuple[str, bytes]]:
    """The ``count`` strings of array ``key`` at the cursor, each as its text and its UTF-8 bytes
    (re-encoded where invalid UTF-8 was replaced); the cursor moves past them once all are read."""
    buf, unpack, limit = cur.buf, struct.unpack_from, cur.size
    p = cur.pos
    try:
        for _ in range(count):
            (n,) = unpack("<Q", buf, p)
            p += 8
            if p + n > limit:
                raise cur.fail(f"truncated file in string array {key!r}")
            s = buf[p:p + n]  # bytes (buf is an mmap)
            p += n
            try:
                t = s.decode("utf-8")
            except UnicodeDecodeError:
                t = s.decode("utf-8", errors="replace")
                s = t.encode("utf-8")
            yield t, s
    except struct.error:
        raise cur.fail(f"truncated file in string array {key!r}") from None
    cur.pos = p


def _string_array(cur: Cursor, count: int, key: str) -> StringArray:
    # the items' bytes straight into one buffer, offsets and hashes into arrays: no Python object
    # per item outlives its step (262,144 live bytes/int objects, freed after the load, would
    # leave their heap pages resident: the engine loads on a thread, see text.vocab.VocabIndex)
    blob = bytearray()
    offs = array.array("q", [0])
    hashes = array.array("q")
    oappend, happend = offs.append, hashes.append if key == _HASHED_KEY else None
    for t, s in _strings(cur, count, key):
        blob += s
        oappend(len(blob))
        if happend is not None:
            happend(hash(t))
    return StringArray(bytes(blob), np.frombuffer(offs, dtype=np.int64),
                       np.frombuffer(hashes, dtype=np.int64) if happend is not None else None)
