"""KV state as a verified object: identity, the state file format, its incremental reader.

A *KV state* is what one KV entry holds (``worker.engine.kv.cache.KVEntry``):
the token ids and their keys and values, plus the identity of what produced
them. It can leave the engine (a slot save, caches kept across an unload or a
restart) and come back; it is never loaded into anything it does not match.

Identity (:class:`KVIdentity`): the GGUF content fingerprint, the
architecture, the shape facts the KV depends on (``n_layer``, ``n_kv_head``,
``head_dim_k``, ``head_dim_v``, the KV dtype, :data:`KV_LAYOUT_VERSION`), the
tokenizer fingerprint (``Tokenizer.fingerprint``: vocabulary, scores, merges,
special ids) and ``n_ctx``. Loading compares every field before any byte
reaches a slot; a mismatch is ``EngineError("kv_state_mismatch")`` naming every
field that differs (the first one in :attr:`KVStateError.field`).

Format (version :data:`STATE_FORMAT_VERSION`, little-endian)::

    magic        8 bytes  b"MYKVSTAT"
    version      u32      STATE_FORMAT_VERSION
    header_len   u32      <= MAX_HEADER_BYTES
    header       header_len bytes of UTF-8 JSON:
                 {"identity": {...KVIdentity fields}, "n_tokens": n}
    header_sha   32 bytes sha256(magic .. header)
    payload      tokens  int32[n]
                 K       dtype[n_layer, n_kv_head, n, head_dim_k]   (keys after RoPE)
                 V       dtype[n_layer, n_kv_head, n, head_dim_v]
    payload_sha  32 bytes sha256(payload)

The header is checked (digest, then identity, then ``n <= n_ctx``) before a
byte of payload is accepted, so a foreign state fails on its first chunk and a
header claiming more tokens than the context holds never allocates; the
payload digest is checked at the end. A truncated, extended or bit-flipped
file is ``EngineError("kv_state_invalid")``. :func:`encode_state` yields the
bytes in chunks of at most ``chunk_bytes`` and :class:`StateDecoder` takes
them in any split, so a state can be streamed in frames of bounded size as
well as written to a file. :func:`write_state_file` writes atomically (a
temporary file in the same directory, fsync, rename): a reader sees the old
file or the whole new one, never half of one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EngineError

__all__ = [
    "KV_LAYOUT_VERSION", "STATE_FORMAT_VERSION", "KVIdentity", "KVState", "KVStateError", "StateDecoder",
    "encode_state", "read_state_file", "read_state_tokens", "write_state_file",
]

#: The engine's KV layout: keys stored after RoPE, ``[n_layer, n_kv_head, position, head_dim]``
#: in the model's compute dtype. Bumped when what a stored K/V means changes.
KV_LAYOUT_VERSION = 2
#: The state file/stream format (this module's layout above).
STATE_FORMAT_VERSION = 1
MAGIC = b"MYKVSTAT"
#: A header larger than this is refused before it is read.
MAX_HEADER_BYTES = 64 * 1024
#: Default chunk of :func:`encode_state` (bytes); well under protocol.limits' frame size.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
_PREFIX = struct.Struct("<8sII")  # magic, version, header_len
_DIGEST = 32


class KVStateError(EngineError):
    """A KV state refused: ``code`` "kv_state_mismatch" (``field`` names the first identity
    field that differs) or "kv_state_invalid" (truncated, corrupt, foreign, too large)."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(code, message)
        self.field = field

    def __reduce__(self):  # picklable with its field
        return (self.__class__, (self.code, self.message, self.field))


def _invalid(msg: str) -> KVStateError:
    return KVStateError("kv_state_invalid", msg)


@dataclass(frozen=True)
class KVIdentity:
    """Everything a KV state depends on; two states are interchangeable iff these are equal.

    Field order is the order mismatches are reported in (the most telling first).
    """

    architecture: str  # general.architecture
    model_fingerprint: str  # GGUF content fingerprint (hex): another file / quantization differs
    tokenizer_fingerprint: str  # Tokenizer.fingerprint (hex)
    n_layer: int
    n_kv_head: int
    head_dim_k: int
    head_dim_v: int
    kv_dtype: str  # numpy dtype name, e.g. "float32"
    kv_layout: int  # KV_LAYOUT_VERSION of the engine that wrote it
    n_ctx: int  # context size of each sequence, tokens

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> KVIdentity:
        """Raises KVStateError("kv_state_invalid") for a missing, extra or ill-typed field."""
        if not isinstance(obj, dict):
            raise _invalid("KV state header: identity is not an object")
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        if set(obj) != set(fields):
            raise _invalid(f"KV state header: identity fields {sorted(obj)} != {sorted(fields)}")
        for name, typ in fields.items():
            v = obj[name]
            ok = isinstance(v, str) if typ == "str" else (isinstance(v, int) and not isinstance(v, bool))
            if not ok:
                raise _invalid(f"KV state header: identity field {name!r} has a bad value {v!r:.80}")
        return cls(**obj)

    def differences(self, other: KVIdentity) -> list[tuple[str, Any, Any]]:
        """``[(field, self's value, other's value)]`` for every field that differs."""
        return [(f.name, getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]

    def check(self, state: KVIdentity) -> None:
        """Refuse a state of identity ``state`` for this engine (``self``).

        Raises: KVStateError("kv_state_mismatch", field=the first differing field), the
            message naming every differing field with both values.
        """
        diff = state.differences(self)
        if diff:
            parts = "; ".join(f"{name}: {_short(theirs)} in the state, {_short(mine)} here"
                              for name, theirs, mine in diff)
            raise KVStateError("kv_state_mismatch", f"the KV state does not match this model ({parts})",
                               field=diff[0][0])

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V of one position over all layers."""
        return self.n_layer * self.n_kv_head * (self.head_dim_k + self.head_dim_v) * np.dtype(self.kv_dtype).itemsize


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 24 else s[:21] + "...'"


@dataclass
class KVState:
    """A validated state: ``tokens`` (n ids), ``k`` ``[n_layer, n_kv_head, n, head_dim_k]``,
    ``v`` ``[n_layer, n_kv_head, n, head_dim_v]`` (dtype ``identity.kv_dtype``)."""

    identity: KVIdentity
    tokens: list[int]
    k: np.ndarray
    v: np.ndarray

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def _header(identity: KVIdentity, n_tokens: int) -> bytes:
    head = json.dumps({"identity": identity.to_json(), "n_tokens": n_tokens}, sort_keys=True).encode()
    pre = _PREFIX.pack(MAGIC, STATE_FORMAT_VERSION, len(head)) + head
    return pre + hashlib.sha256(pre).digest()


def encode_state(identity: KVIdentity, tokens: Sequence[int], k: np.ndarray, v: np.ndarray,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The state's bytes (format above) in chunks of at most ``chunk_bytes`` (>= 64).

    Args:
        k: ``[n_layer, n_kv_head, n, head_dim_k]`` (a view of an entry is fine: copied a
            block at a time), ``v`` likewise; ``n == len(tokens)``.
    Raises: EngineError("invalid_params") for shapes or dtype that do not match ``identity``.
    """
    n = len(tokens)
    want_k = (identity.n_layer, identity.n_kv_head, n, identity.head_dim_k)
    want_v = (identity.n_layer, identity.n_kv_head, n, identity.head_dim_v)
    if tuple(k.shape) != want_k or tuple(v.shape) != want_v or k.dtype != np.dtype(identity.kv_dtype) \
            or v.dtype != k.dtype:
        raise EngineError("invalid_params", f"KV arrays {k.shape}/{v.shape} {k.dtype} do not match "
                          f"the identity {want_k}/{want_v} {identity.kv_dtype}")
    chunk_bytes = max(64, int(chunk_bytes))
    yield _header(identity, n)
    h = hashlib.sha256()

    def pieces(b: bytes | memoryview) -> Iterator[bytes]:
        mv = memoryview(b)
        if mv.nbytes == 0:  # an empty entry (n_tokens 0): nothing to write
            return
        mv = mv.cast("B")
        for i in range(0, len(mv), chunk_bytes):
            part = bytes(mv[i:i + chunk_bytes])
            h.update(part)
            yield part

    yield from pieces(np.asarray(tokens, dtype="<i4").tobytes())
    le = k.dtype.newbyteorder("<")
    for arr in (k, v):
        for layer in range(identity.n_layer):
            yield from pieces(np.ascontiguousarray(arr[layer], dtype=le).data)
    yield h.digest()


class StateDecoder:
    """Incremental reader of one state for an engine of identity ``expected``.

    ``feed(data)`` any number of times (any split), then ``finish()`` for the
    :class:`KVState`. Every check fails as early as the bytes allow: magic,
    version and header size on the first 16 bytes; header digest, identity
    (``expected.check``) and ``n_tokens <= expected.n_ctx`` once the header is in;
    more bytes than the header announces at once; the payload digest and any
    shortfall at ``finish``. Raises KVStateError ("kv_state_invalid" /
    "kv_state_mismatch"); after an error the decoder accepts nothing more.
    """

    def __init__(self, expected: KVIdentity) -> None:
        self.expected = expected
        self._buf = bytearray()  # prefix + header + header digest until they are complete
        self._head_len: int | None = None
        self.n_tokens: int | None = None
        self._payload: np.ndarray | None = None  # uint8 [payload bytes]
        self._filled = 0
        self._hash = hashlib.sha256()
        self._tail = bytearray()  # the payload digest
        self._failed: KVStateError | None = None
        self.n_read = 0

    def _fail(self, e: KVStateError) -> KVStateError:
        self._failed = e
        self._payload = None
        return e

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._failed is not None:
            raise self._failed
        mv = memoryview(data).cast("B")
        self.n_read += len(mv)
        try:
            if self._payload is None:
                mv = self._feed_header(mv)
                if self._payload is None:
                    return
            room = len(self._payload) - self._filled
            if room > 0 and len(mv):
                take = min(room, len(mv))
                self._payload[self._filled:self._filled + take] = np.frombuffer(mv[:take], dtype=np.uint8)
                self._hash.update(mv[:take])
                self._filled += take
                mv = mv[take:]
            if len(mv):
                if len(self._tail) + len(mv) > _DIGEST:
                    raise _invalid("the KV state is longer than its header says (trailing data)")
                self._tail += mv
        except KVStateError as e:
            raise self._fail(e) from None

    def _feed_header(self, mv: memoryview) -> memoryview:
        need = _PREFIX.size if self._head_len is None else _PREFIX.size + self._head_len + _DIGEST
        take = min(len(mv), need - len(self._buf))
        self._buf += mv[:take]
        mv = mv[take:]
        if len(self._buf) < need:
            return mv
        if self._head_len is None:
            magic, version, head_len = _PREFIX.unpack(bytes(self._buf[:_PREFIX.size]))
            if magic != MAGIC:
                raise _invalid("not a modelyard KV state (bad magic)")
            if version != STATE_FORMAT_VERSION:
                raise _invalid(f"KV state format version {version} (this engine reads {STATE_FORMAT_VERSION})")
            if head_len > MAX_HEADER_BYTES:
                raise _invalid(f"KV state header of {head_len} bytes (at most {MAX_HEADER_BYTES})")
            self._head_len = head_len
            return self._feed_header(mv)
        body = bytes(self._buf[:_PREFIX.size + self._head_len])
        if hashlib.sha256(body).digest() != bytes(self._buf[-_DIGEST:]):
            raise _invalid("KV state header checksum mismatch (corrupt)")
        try:
            head = json.loads(body[_PREFIX.size:].decode("utf-8"))
        except ValueError as e:
            raise _invalid(f"KV state header is not JSON: {e}") from None
        if not isinstance(head, dict) or set(head) != {"identity", "n_tokens"}:
            raise _invalid("KV state header must have exactly 'identity' and 'n_tokens'")
        ident = KVIdentity.from_json(head["identity"])
        self.expected.check(ident)
        n = head["n_tokens"]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.expected.n_ctx:
            raise _invalid(f"KV state n_tokens {n!r:.40} is outside [0, n_ctx={self.expected.n_ctx}]")
        self.n_tokens = n
        self._payload = np.empty(4 * n + n * ident.token_bytes, dtype=np.uint8)
        return mv

    def finish(self) -> KVState:
        """The state, once every byte is in and both digests match.

        Raises: KVStateError("kv_state_invalid") for a truncated or corrupt state.
        """
        if self._failed is not None:
            raise self._failed
        if self._payload is None or self._filled < len(self._payload) or len(self._tail) < _DIGEST:
            raise self._fail(_invalid(f"the KV state is truncated ({self.n_read} bytes read)"))
        if self._hash.digest() != bytes(self._tail):
            raise self._fail(_invalid("KV state payload checksum mismatch (corrupt)"))
        e, n, p = self.expected, self.n_tokens or 0, self._payload
        dt = np.dtype(e.kv_dtype).newbyteorder("<")
        tokens = p[:4 * n].view("<i4").tolist()
        kb = e.n_layer * e.n_kv_head * n * e.head_dim_k * dt.itemsize
        k = p[4 * n:4 * n + kb].view(dt).reshape(e.n_layer, e.n_kv_head, n, e.head_dim_k)
        v = p[4 * n + kb:].view(dt).reshape(e.n_layer, e.n_kv_head, n, e.head_dim_v)
        self._payload = None
        return KVState(e, tokens, k, v)


def write_state_file(path: str | Path, chunks: Iterator[bytes]) -> int:
    """Write ``chunks`` to ``path`` atomically (temporary file, fsync, rename); bytes written.

    Raises OSError (the temporary file is removed; ``path`` is unchanged).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    n = 0
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
                n += len(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return n


def read_state_file(path: str | Path, expected: KVIdentity, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                    ) -> tuple[KVState, int]:
    """``(state, bytes read)`` of the file at ``path``, fully validated for ``expected``.

    Raises: KVStateError ("kv_state_invalid": missing, unreadable, truncated, corrupt,
        foreign; "kv_state_mismatch": another model / quantization / n_ctx ...).
    """
    dec = StateDecoder(expected)
    try:
        with open(path, "rb") as f:
            while True:
                b = f.read(chunk_bytes)
                if not b:
                    break
                dec.feed(b)
    except OSError as e:
        raise _invalid(f"cannot read the KV state file {Path(path).name!r}: {e.strerror or e}") from None
    return dec.finish(), dec.n_read


def read_state_tokens(path: str | Path) -> tuple[KVIdentity, list[int], int]:
    """``(identity, tokens, file size)`` from the header and token block only (for an index of
    cached states; the whole file is validated when it is loaded).

    Raises: KVStateError("kv_state_invalid"), also for an unreadable file.
    """
    try:
        with open(path, "rb") as f:
            pre = f.read(_PREFIX.size)
            if len(pre) < _PREFIX.size:
                raise _invalid("truncated KV state header")
            magic, version, head_len = _PREFIX.unpack(pre)
            if magic != MAGIC or version != STATE_FORMAT_VERSION or head_len > MAX_HEADER_BYTES:
                raise _invalid("not a KV state of this format")
            body = pre + f.read(head_len)
            if hashlib.sha256(body).digest() != f.read(_DIGEST):
                raise _invalid("KV state header checksum mismatch")
            head = json.loads(body[_PREFIX.size:].decode("utf-8"))
            ident = KVIdentity.from_json(head.get("identity") if isinstance(head, dict) else None)
            n = head.get("n_tokens")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise _invalid("bad n_tokens")
            raw = f.read(4 * n)
            if len(raw) < 4 * n:
                raise _invalid("truncated KV state tokens")
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise _invalid(f"cannot read {Path(path).name!r}: {e}") from None
    except ValueError as e:
        raise _invalid(f"KV state header is not JSON: {e}") from None
    return ident, np.frombuffer(raw, dtype="<i4").tolist(), size
