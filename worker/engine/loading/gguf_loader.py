"""GGUF reader: metadata and tensor infos parsed by hand, tensor data memory-mapped.

``gguf.GGUFReader`` builds one NumPy view per element of every array field,
which takes 10-15 s on Gemma 3's 262,144-token vocabulary. This parser reads
the same header in ~0.1-0.3 s: numeric arrays become lists through one
``np.frombuffer(...).tolist()``, string arrays through a tight
``struct.unpack_from`` loop. Only the constants of the ``gguf`` package are used
(``GGUFValueType``, ``GGMLQuantizationType``, ``GGML_QUANT_SIZES``) plus
``gguf.quants.dequantize`` for the tensor data.

File layout (GGUF v2/v3, little-endian; ggml/docs/gguf.md in llama.cpp):
``magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv | n_kv x (string key,
u32 value type, value) | n_tensors x (string name, u32 n_dims, n_dims x u64 ne,
u32 ggml type, u64 offset) | padding to general.alignment (default 32) | data``.
A string is ``u64 length`` + UTF-8 bytes; an array is ``u32 item type, u64 count,
items``.

Arrays of at least :data:`COMPACT_MIN_ITEMS` items (the vocabulary's tokens, scores, token
types and merges) are not Python lists: a list of 262,144 ``str`` / ``float`` objects costs
~22 / ~8 MiB of resident memory, the same data packed ~3.2 / ~1 MiB. They become read-only
:class:`StringArray` (one UTF-8 blob + offsets) and :class:`NumericArray` (one numpy array)
sequences that index (negative indexes too; out of range raises IndexError), slice (to a
list), iterate and compare equal like the list they replace, giving the same Python values
(``str``; ``int`` / ``float`` / ``bool``); they are not ``list`` instances and cannot be
mutated. Smaller arrays (per-layer hyperparameters) stay plain lists.
"""

from __future__ import annotations

import array
import hashlib
import json
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import EngineError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: files smaller than this are hashed on every access instead of memoised on disk
SHA256_MEMO_MIN_BYTES = 16 << 20
#: Bytes hashed per step of the background fingerprint (between two checks of close()).
HASH_CHUNK_BYTES = 16 << 20

#: ggml tensor types this engine can dequantize.
SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset({
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
})

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

_MAX_DIMS = 4                      # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 8               # nested arrays deeper than this are rejected


def _seq_eq(a: Sequence[Any], b: object) -> Any:
    """``a == b`` for a compact array ``a``: equal to any non-string sequence of equal items."""
    if isinstance(b, (str, bytes, bytearray, memoryview)) or not isinstance(b, Sequence):
        return NotImplemented
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


class NumericArray(Sequence):  # type: ignore[type-arg]
    """A read-only numeric GGUF array that behaves like the list of Python numbers it replaces.

    Attributes:
        array: the values, a read-only 1-D numpy array in native byte order, of the item type's
            dtype (uint8 ... float64; ``bool`` for GGUF BOOL arrays).

    ``a[i]`` is a Python ``int`` / ``float`` / ``bool`` (a float32 item converted exactly, as
    ``ndarray.tolist`` does); negative indexes count from the end; an index outside
    ``[-len, len)`` raises IndexError; a slice gives a list. Iteration yields Python values;
    ``a == other`` compares item by item with any non-string sequence. 8 bytes or fewer per
    item instead of a list's 8-byte pointer plus a 24-32-byte number object.
    """

    __slots__ = ("array", "_mv")

    def __init__(self, array: np.ndarray) -> None:
        a = np.asarray(array)
        if a.ndim != 1:
            raise ValueError("NumericArray needs a 1-D array")
        if not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        if a.flags.writeable or not a.flags.c_contiguous:
            a = np.array(a, copy=True)
            a.flags.writeable = False
        self.array = a
        self._mv = memoryview(a)  # type: ignore[arg-type]  # numpy types ndarray's buffer protocol for Python >= 3.12 only

    def __len__(self) -> int:
        return len(self._mv)

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return self._mv[i].tolist()
        return self._mv[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._mv)

    def tolist(self) -> list[Any]:
        """The items as a new list of Python values."""
        return self._mv.tolist()

    def __eq__(self, other: object) -> Any:
        if isinstance(other, list):
            return self._mv.tolist() == other
        return _seq_eq(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return (NumericArray, (self.array,))

    def __repr__(self) -> str:
        return f"NumericArray({self.array.dtype}, len={len(self)})"


class StringArray(Sequence):  # type: ignore[type-arg]
    """A read-only array of strings stored as one UTF-8 blob, behaving like the list of ``str``.

    Attributes:
        blob: every item's UTF-8 bytes (``str.encode("utf-8", "surrogatepass")``), concatenated.
        offsets: read-only uint32 (uint64 past 4 GiB) numpy array ``[len + 1]``: item ``i`` is
            ``blob[offsets[i]:offsets[i + 1]]``.

    ``a[i]`` decodes item ``i`` to a new ``str`` (negative indexes count from the end, an index
    outside ``[-len, len)`` raises IndexError, a slice gives a list); :meth:`item_bytes` gives
    its bytes without decoding. Iteration yields ``str``; ``a == other`` compares item by item
    with any non-string sequence. ~1 byte per ASCII character plus 4 per item, where a list of
    ``str`` costs 8 + 49-80 bytes per item plus the characters.
    """

    __slots__ = ("blob", "offsets", "_off", "_hashes")

    def __init__(self, blob: bytes, offsets: np.ndarray, hashes: np.ndarray | None = None) -> None:
        off = np.asarray(offsets)
        if off.ndim != 1 or len(off) < 1 or off[0] != 0 or int(off[-1]) != len(blob) or np.any(np.diff(off.astype(np.int64)) < 0):
            raise ValueError("StringArray offsets must rise from 0 to len(blob)")
        off = np.array(off, dtype=np.uint32 if len(blob) < 2**32 else np.uint64)
        off.flags.writeable = False
        self.blob = bytes(blob)
        self.offsets = off
        self._off = memoryview(off)  # type: ignore[arg-type]  # numpy types ndarray's buffer protocol for Python >= 3.12 only
        if hashes is not None:
            hashes = np.array(hashes, dtype=np.int64)
            if hashes.shape != (len(off) - 1,):
                raise ValueError("StringArray hashes must have one value per item")
            hashes.flags.writeable = False
        self._hashes = hashes

    @classmethod
    def from_strs(cls, items: Iterable[str]) -> StringArray:
        """Pack ``items`` (each a ``str``; lone surrogates kept through ``surrogatepass``).

        Raises: TypeError if an item is not a ``str``."""
        parts = [str.encode(s, "utf-8", "surrogatepass") for s in items]
        lens = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        return cls(b"".join(parts), np.concatenate(([0], np.cumsum(lens))))

    def __len__(self) -> int:
        return len(self._off) - 1

    def _index(self, i: int) -> int:
        n = len(self._off) - 1
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("StringArray index out of range")
        return i

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = self._index(i.__index__())
        off = self._off
        return self.blob[off[i]:off[i + 1]].decode("utf-8", "surrogatepass")

    def item_bytes(self, i: int) -> bytes:
        """Item ``i``'s UTF-8 bytes (as stored). Raises IndexError like indexing."""
        i = self._index(i.__index__())
        return self.blob[self._off[i]:self._off[i + 1]]

    def byte_lengths(self) -> np.ndarray:
        """int64 ``[len]``: each item's length in UTF-8 bytes."""
        return np.diff(self.offsets.astype(np.int64))

    def __iter__(self) -> Iterator[str]:
        blob, off = self.blob, self._off
        for i in range(len(off) - 1):
            yield blob[off[i]:off[i + 1]].decode("utf-8", "surrogatepass")

    def iter_bytes(self) -> Iterator[bytes]:
        """Each item's UTF-8 bytes, in order."""
        blob, off = self.blob, self._off
        for i in range(len(off) - 1):
            yield blob[off[i]:off[i + 1]]

    def hashes(self) -> np.ndarray:
        """int64 ``[len]``: ``hash(self[i])`` of each item, in this process (Python salts str
        hashes per process: never store them). Computed once (``read_gguf`` computes them for
        ``tokenizer.ggml.tokens`` while reading); read-only."""
        if self._hashes is None:
            h = np.fromiter(map(hash, self), dtype=np.int64, count=len(self))
            h.flags.writeable = False
            self._hashes = h
        return self._hashes

    def drop_hashes(self) -> None:
        """Forget the cached :meth:`hashes` (8 bytes per item; recomputed if asked again)."""
        self._hashes = None

    def __eq__(self, other: object) -> Any:
        if isinstance(other, StringArray):
            return self.blob == other.blob and np.array_equal(self.offsets, other.offsets)
        return _seq_eq(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return (StringArray, (self.blob, self.offsets))

    def __repr__(self) -> str:
        return f"StringArray(len={len(self)}, {len(self.blob)} bytes)"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry.

    Attributes:
        name: tensor name, e.g. ``"blk.0.attn_q.weight"``.
        shape: dimensions as GGUF stores them, ``ne[0]`` first (``ne[0]`` is the
            contiguous row length). numpy shape is ``tuple(reversed(shape))``.
        type: ggml element/block type.
        offset: byte offset of the data relative to the start of the data section.
        data_offset: absolute byte offset of the data in the file.
        n_elements: product of ``shape``.
        n_bytes: size of the stored data in bytes.
    """

    name: str
    shape: tuple[int, ...]
    type: GGMLQuantizationType
    offset: int
    data_offset: int
    n_elements: int
    n_bytes: int

    @property
    def np_shape(self) -> tuple[int, ...]:
        """numpy-style shape (rows = ``ne[1]``, cols = ``ne[0]``)."""
        return tuple(reversed(self.shape))


class _Cursor:
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


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    """Read one metadata value of type ``vtype`` into a plain Python value."""
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
            buf, out = cur.buf, list[Any]()
            append, unpack, limit = out.append, struct.unpack_from, cur.size
            p = cur.pos
            if count >= COMPACT_MIN_ITEMS:
                # the items' bytes (re-encoded where invalid UTF-8 was replaced) straight into one
                # buffer, offsets and hashes into arrays: no Python object per item outlives its
                # step (262,144 live bytes/int objects, freed after the load, would leave their
                # heap pages resident: the engine loads on a thread, see text.vocab.VocabIndex)
                blob = bytearray()
                offs = array.array("q", [0])
                hashes = array.array("q")
                oappend, happend = offs.append, hashes.append if key == _HASHED_KEY else None
                try:
                    for _ in range(count):
                        (n,) = unpack("<Q", buf, p)
                        p += 8
                        if p + n > limit:
                            raise cur.fail(f"truncated file in string array {key!r}")
                        s = buf[p:p + n]
                        p += n
                        try:
                            t = s.decode("utf-8")
                        except UnicodeDecodeError:
                            t = s.decode("utf-8", errors="replace")
                            s = t.encode("utf-8")
                        blob += s
                        oappend(len(blob))
                        if happend is not None:
                            happend(hash(t))
                except struct.error:
                    raise cur.fail(f"truncated file in string array {key!r}") from None
                cur.pos = p
                return StringArray(bytes(blob), np.frombuffer(offs, dtype=np.int64),
                                   np.frombuffer(hashes, dtype=np.int64) if happend is not None else None)
            try:
                for _ in range(count):
                    (n,) = unpack("<Q", buf, p)
                    p += 8
                    if p + n > limit:
                        raise cur.fail(f"truncated file in string array {key!r}")
                    s = buf[p:p + n]  # bytes (buf is an mmap)
                    p += n
                    try:
                        append(s.decode("utf-8"))
                    except UnicodeDecodeError:
                        append(s.decode("utf-8", errors="replace"))
            except struct.error:
                raise cur.fail(f"truncated file in string array {key!r}") from None
            cur.pos = p
            return out
        if itype == GGUFValueType.ARRAY:
            return [_read_value(cur, GGUFValueType.ARRAY, key, depth + 1) for _ in range(count)]
        raise cur.fail(f"unknown array item type {itype} for key {key!r}")
    raise cur.fail(f"unknown value type {vtype} for key {key!r}")


class GGUFFile:
    """A parsed GGUF file: metadata, tensor infos, memory-mapped tensor data.

    Attributes:
        path: the file path (as given).
        version: GGUF version (2 or 3).
        metadata: ``{key: value}``; values are str, int, float, bool or arrays
            of those: a list below :data:`COMPACT_MIN_ITEMS` items, else a read-only
            :class:`StringArray` / :class:`NumericArray` that indexes, iterates and compares
            like that list (see the module docstring). Nested arrays are lists.
        tensors: ``{name: TensorInfo}`` in file order.
        file_size: file size in bytes.
        alignment: data alignment in bytes (``general.alignment``, default 32).
        data_start: absolute byte offset of the tensor data section.
        header_size: bytes of the header (== ``data_start``).
    """

    def __init__(self, path: str, version: int, metadata: dict[str, Any], tensors: dict[str, TensorInfo],
                 file_size: int, alignment: int, data_start: int, mtime_ns: int, inode: int,
                 data: np.memmap) -> None:
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.file_size = file_size
        self.alignment = alignment
        self.data_start = data_start
        self.header_size = data_start
        self._mtime_ns = mtime_ns
        self._inode = inode
        self._data = data
        self._fp: Future[str] | None = None
        self._fp_lock = threading.Lock()
        self._fp_thread: threading.Thread | None = None
        self._closing = False

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, arch={self.metadata.get('general.architecture')!r}, "
                f"tensors={len(self.tensors)}, size={self.file_size})")

    @property
    def architecture(self) -> str:
        """``general.architecture``; raises EngineError("invalid_gguf") if absent."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise EngineError("invalid_gguf", f"{self.path}: missing general.architecture")
        return arch

    @property
    def fingerprint(self) -> str:
        """Full SHA-256 hex digest of the file's bytes — the file's identity.

        Identity rule: the fingerprint equals ``sha256sum FILE`` (every byte, header and
        tensor data), so two files share it only if they are the same bytes; the weight cache
        and the KV-state identity (``kv_state.KVIdentity.model_fingerprint``) rely on that.
        It is computed lazily: :meth:`start_fingerprint` (called by ``Engine.load`` right
        after opening the file) hashes on a background thread while the model is built —
        hashlib releases the GIL, so on a second core it costs the load nothing — and this
        property waits for that thread (or hashes here if it was never started). Only what
        needs the identity waits (KV-state save/restore, the weight-cache write, the worker's
        ``Ready``/``/props`` fingerprint, which is sent again once known); the first token
        does not. The digest is memoised on disk under
        ``$XDG_CACHE_HOME/modelyard/sha256/`` keyed by (real path, size, mtime_ns, inode), so
        a file seen before is known at once (one small JSON read). A file modified in place
        gets a new mtime and is hashed again. Files under ``SHA256_MEMO_MIN_BYTES`` (16 MiB)
        are simply hashed (no memo file, no thread).

        Raises: EngineError("invalid_gguf") if the file was closed before the hash finished.
        """
        return self.start_fingerprint().result()

    def fingerprint_nowait(self) -> str | None:
        """The fingerprint if already known (memo, small file, or the background hash done), else None."""
        fut = self.start_fingerprint()
        return fut.result() if fut.done() else None

    def start_fingerprint(self) -> Future[str]:
        """Start computing :attr:`fingerprint` (no-op once started); its Future. A memoised or
        small file's Future is already done; otherwise a daemon thread hashes the file."""
        with self._fp_lock:
            if self._fp is not None:
                return self._fp
            fut: Future[str] = Future()
            self._fp = fut
            if self.file_size < SHA256_MEMO_MIN_BYTES:
                fut.set_result(hashlib.sha256(self._data).hexdigest())  # type: ignore[arg-type]  # numpy types ndarray's buffer protocol for Python >= 3.12 only
                return fut
            key = f"{os.path.realpath(self.path)}|{self.file_size}|{self._mtime_ns}|{self._inode}"
            memo = cache_root() / "sha256" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
            try:
                rec = json.loads(memo.read_text())
                if rec.get("key") == key and isinstance(rec.get("sha256"), str) and len(rec["sha256"]) == 64:
                    fut.set_result(rec["sha256"])
                    return fut
            except (OSError, ValueError):
                pass
            self._fp_thread = threading.Thread(target=self._hash, args=(fut, key, memo), daemon=True,
                                               name="modelyard-gguf-sha256")
            self._fp_thread.start()
            return fut

    def _hash(self, fut: Future[str], key: str, memo: Path) -> None:
        # read through the file, not the mapping: the mapping's pages would stay in this process's
        # resident set (the whole file, on top of the prepared weights); the opened file must be
        # the one mapped (same inode and size), else the hash would name another file
        h = hashlib.sha256()
        buf = memoryview(bytearray(HASH_CHUNK_BYTES))
        try:
            with open(self.path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size != self.file_size:
                    raise OSError(f"{self.path} was replaced after it was opened")
                while True:
                    if self._closing:
                        fut.set_exception(EngineError("invalid_gguf",
                                                      f"{self.path}: closed before its fingerprint was computed"))
                        return
                    n = f.readinto(buf)
                    if not n:
                        break
                    h.update(buf[:n])
        except OSError as e:
            fut.set_exception(EngineError("invalid_gguf", f"{self.path}: cannot hash it: {e}"))
            return
        digest = h.hexdigest()
        try:
            atomic_write_bytes(memo, json.dumps({"key": key, "sha256": digest}).encode())
        except OSError:
            pass  # read-only cache dir: just recompute next time
        fut.set_result(digest)

    def raw(self, name: str) -> np.ndarray:
        """Stored bytes of a tensor, memory-mapped (no copy).

        Returns: uint8 ``[n_rows, bytes_per_row]`` where ``n_rows`` is the product
        of ``ne[1:]`` (for 1-D tensors ``[1, bytes]``).
        Raises: EngineError("invalid_gguf") if no such tensor.
        """
        info = self._info(name)
        n_cols = info.shape[0]
        n_rows = info.n_elements // n_cols if n_cols else 0
        block, tsize = GGML_QUANT_SIZES[info.type]
        row_bytes = n_cols // block * tsize
        return self._data[info.data_offset:info.data_offset + info.n_bytes].reshape(n_rows, row_bytes)

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized float32 copy of a tensor, numpy-shaped.

        Returns: float32 array of shape ``tuple(reversed(info.shape))``, e.g.
        ``[n_vocab, n_embd]`` for ``token_embd.weight`` (rows = ``ne[1]``,
        cols = ``ne[0]``). Always a fresh in-memory array (never the memmap).
        Dequantization: :func:`dequantize_raw` (bit-identical to
        ``gguf.quants.dequantize``, the numpy port of ggml-quants.c
        ``dequantize_row_*``; tested).
        Raises: EngineError("invalid_gguf") if no such tensor.
        """
        info = self._info(name)
        return dequantize_raw(self.raw(name), info.type).reshape(info.np_shape)

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise EngineError("invalid_gguf", f"{self.path}: no tensor named {name!r}") from None

    def release_pages(self) -> None:
        """Drop this process's resident pages of the mapping (``MADV_DONTNEED`` on a read-only
        file mapping: the data stays valid, a later read faults it in again from the page
        cache). For after the weights are built from it (they are copies)."""
        mm = getattr(self._data, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Drop the memory map (tensors already returned stay valid). A background hash still
        running stops (its fingerprint then raises)."""
        self._closing = True
        if self._fp_thread is not None and self._fp_thread is not threading.current_thread():
            self._fp_thread.join()
        mm = getattr(self._data, "_mmap", None)
        self._data = None  # type: ignore[assignment]
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass  # still referenced by a view; freed with it


_DEQUANT_CHUNK_BLOCKS = 4096  # blocks per numpy pass: temporaries stay cache-sized (measured best)


def dequantize_raw(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Dequantize stored rows to float32.

    Args:
        raw: uint8 ``[n_rows, bytes_per_row]`` (see :meth:`GGUFFile.raw`).
        qtype: one of :data:`SUPPORTED_TENSOR_TYPES`.
    Returns:
        float32 ``[n_rows, n_cols]``, C-contiguous, bit-identical to
        ``gguf.quants.dequantize(raw, qtype)``.

    F32/F16/BF16 are plain casts. Q8_0 (``d * int8``, ggml-quants.c
    ``dequantize_row_q8_0``) is computed here directly, ~10x faster than the
    package, which works in groups of 16 rows (1.5 s -> 0.12 s for Gemma's
    262144 x 640 embedding). The other block types call the package's own
    ``dequantize_blocks`` on chunks of 4096 blocks (Q4_1: 0.55 s -> 0.16 s on SmolLM2).
    """
    n_rows = raw.shape[0]
    if qtype == GGMLQuantizationType.F32:
        return np.array(raw.view("<f4"), dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        return raw.view("<f2").astype(np.float32)
    if qtype == GGMLQuantizationType.BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    block, tsize = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, tsize)                       # [n_blocks, type_size] uint8
    n_blocks = blocks.shape[0]
    out = np.empty((n_blocks, block), dtype=np.float32)   # [n_blocks, block_size]
    step = _DEQUANT_CHUNK_BLOCKS
    if qtype == GGMLQuantizationType.Q8_0:
        for i in range(0, n_blocks, step):
            b = blocks[i:i + step]
            d = np.ascontiguousarray(b[:, :2]).view("<f2").astype(np.float32)  # [n, 1] scale
            np.multiply(b[:, 2:].view(np.int8), d, out=out[i:i + step], dtype=np.float32)
    else:
        from gguf.quants import _type_traits  # the package's per-type classes

        deq = _type_traits[qtype].dequantize_blocks
        for i in range(0, n_blocks, step):
            out[i:i + step] = deq(blocks[i:i + step])
    return out.reshape(n_rows, -1)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's header and memory-map its data.

    Args:
        path: path of a ``.gguf`` file.
    Returns:
        :class:`GGUFFile`.
    Raises:
        EngineError("file_not_found"): no such file (or not a regular file).
        EngineError("invalid_gguf"): bad magic, unsupported version, big-endian
            file, truncated header or data, malformed value, duplicate key or
            tensor, tensor data outside the file.
        EngineError("unsupported_tensor_type"): a tensor's ggml type is not one of
            F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (names
            the tensor and the type).
    """
    spath = os.fspath(path)
    try:
        st = os.stat(spath)
    except (FileNotFoundError, NotADirectoryError):
        raise EngineError("file_not_found", f"GGUF file not found: {spath}") from None
    except OSError as e:
        raise EngineError("file_not_found", f"cannot access GGUF file {spath}: {e.strerror}") from None
    if not os.path.isfile(spath):
        raise EngineError("file_not_found", f"not a regular file: {spath}")
    size = st.st_size
    if size < 24:
        with open(spath, "rb") as f:
            head = f.read(4)
        if head != GGUF_MAGIC:
            raise EngineError("invalid_gguf", f"{spath}: not a GGUF file (magic {head!r})")
        raise EngineError("invalid_gguf", f"{spath}: truncated file ({size} bytes)")
    try:
        data = np.memmap(spath, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise EngineError("invalid_gguf", f"{spath}: cannot memory-map: {e}") from None

    with open(spath, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as hdr:
        cur = _Cursor(hdr, spath)
        if bytes(data[:4]) != GGUF_MAGIC:
            raise EngineError("invalid_gguf", f"{spath}: not a GGUF file (magic {bytes(data[:4])!r})")
        cur.pos = 4
        version = cur.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                raise EngineError("invalid_gguf", f"{spath}: big-endian GGUF files are not supported")
            raise EngineError("invalid_gguf", f"{spath}: unsupported GGUF version {version} "
                              f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        # each kv needs >= 8+4 bytes, each tensor info >= 8+4+4+8 bytes: reject absurd counts
        if n_kv * 12 > size or n_tensors * 24 > size:
            raise cur.fail(f"implausible counts (n_kv={n_kv}, n_tensors={n_tensors}) for a {size}-byte file")

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            vtype = cur.u32(f"value type of {key!r}")
            value = _read_value(cur, vtype, key)
            if key in metadata:
                raise cur.fail(f"duplicate metadata key {key!r}")
            metadata[key] = value

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment must be a positive power of two, got {alignment!r}")

        raw_infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            n_dims = cur.u32(f"dimension count of tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1..{_MAX_DIMS} allowed)")
            cur.need(8 * n_dims, f"shape of tensor {name!r}")
            shape = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos)
            cur.pos += 8 * n_dims
            ttype = cur.u32(f"type of tensor {name!r}")
            offset = cur.u64(f"offset of tensor {name!r}")
            raw_infos.append((name, tuple(int(d) for d in shape), ttype, offset))

    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ttype, offset in raw_infos:
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise EngineError("unsupported_tensor_type",
                              f"{spath}: tensor {name!r} has unknown ggml type id {ttype}") from None
        if qtype not in SUPPORTED_TENSOR_TYPES:
            raise EngineError("unsupported_tensor_type",
                              f"{spath}: tensor {name!r} has type {qtype.name}, not supported "
                              f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))})")
        if name in tensors:
            raise cur.fail(f"duplicate tensor {name!r}")
        block, tsize = GGML_QUANT_SIZES[qtype]
        if shape[0] % block:
            raise cur.fail(f"tensor {name!r}: row length {shape[0]} is not a multiple of the "
                           f"{qtype.name} block size {block}")
        n_el = 1
        for d in shape:
            n_el *= d
        n_bytes = n_el // block * tsize
        if offset % alignment:
            raise cur.fail(f"tensor {name!r}: offset {offset} not aligned to {alignment}")
        start = data_start + offset
        if start + n_bytes > size:
            raise cur.fail(f"truncated file: tensor {name!r} needs bytes {start}..{start + n_bytes} "
                           f"but the file has {size}")
        tensors[name] = TensorInfo(name, shape, qtype, offset, start, n_el, n_bytes)

    return GGUFFile(spath, version, metadata, tensors, size, alignment, data_start,
                    st.st_mtime_ns, st.st_ino, data)


# ---------------------------------------------------------------- cache helpers

def cache_root() -> Path:
    """``$XDG_CACHE_HOME/modelyard`` (default ``~/.cache/modelyard``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "modelyard"


def atomic_write_bytes(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` atomically (temp file in the same dir + rename).

    Concurrent writers of the same content are harmless; readers never see a
    partial file. Raises OSError on failure (temp file removed).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
