"""GGUF reader: metadata and tensor infos parsed by hand, tensor data memory-mapped.

``gguf.GGUFReader`` builds one NumPy view per element of every array field,
which takes 10-15 s on Gemma 3's 262,144-token vocabulary. This parser reads
the same header in ~0.1-0.3 s (the metadata values: :mod:`.gguf_metadata`). Only the
constants of the ``gguf`` package are used (``GGUFValueType``, ``GGMLQuantizationType``,
``GGML_QUANT_SIZES``) plus ``gguf.quants`` for the tensor data (:mod:`.dequant`).

File layout (GGUF v2/v3, little-endian; ggml/docs/gguf.md in llama.cpp):
``magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv | n_kv x (string key,
u32 value type, value) | n_tensors x (string name, u32 n_dims, n_dims x u64 ne,
u32 ggml type, u64 offset) | padding to general.alignment (default 32) | data``.
A string is ``u64 length`` + UTF-8 bytes; an array is ``u32 item type, u64 count,
items``.

Arrays of at least :data:`~.gguf_metadata.COMPACT_MIN_ITEMS` items (the vocabulary's tokens,
scores, token types and merges) are not Python lists but read-only :class:`StringArray` /
:class:`NumericArray` sequences that behave like them (:mod:`.arrays`). Smaller arrays
(per-layer hyperparameters) stay plain lists.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import EngineError
from .arrays import NumericArray, StringArray
from .dequant import SUPPORTED_TENSOR_TYPES, dequantize_raw
from .gguf_metadata import COMPACT_MIN_ITEMS, Cursor, read_metadata

__all__ = ["COMPACT_MIN_ITEMS", "GGUFFile", "NumericArray", "StringArray", "SUPPORTED_TENSOR_TYPES",
           "TensorInfo", "atomic_write_bytes", "cache_root", "read_gguf"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: files smaller than this are hashed on every access instead of memoised on disk
SHA256_MEMO_MIN_BYTES = 16 << 20
#: Bytes hashed per step of the background fingerprint (between two checks of close()).
HASH_CHUNK_BYTES = 16 << 20

_MAX_DIMS = 4                      # GGML_MAX_DIMS


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
    st = _stat(spath)
    size = st.st_size
    try:
        data = np.memmap(spath, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise EngineError("invalid_gguf", f"{spath}: cannot memory-map: {e}") from None

    with open(spath, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as hdr:
        cur = Cursor(hdr, spath)
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
        metadata = read_metadata(cur, n_kv)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise cur.fail(f"general.alignment must be a positive power of two, got {alignment!r}")
        raw_infos = _read_tensor_infos(cur, n_tensors)

    data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = _map_tensors(cur, raw_infos, data_start, alignment, size)
    return GGUFFile(spath, version, metadata, tensors, size, alignment, data_start,
                    st.st_mtime_ns, st.st_ino, data)


def _stat(spath: str) -> os.stat_result:
    """``os.stat`` of a regular file of at least a header's 24 bytes (else the error to raise)."""
    try:
        st = os.stat(spath)
    except (FileNotFoundError, NotADirectoryError):
        raise EngineError("file_not_found", f"GGUF file not found: {spath}") from None
    except OSError as e:
        raise EngineError("file_not_found", f"cannot access GGUF file {spath}: {e.strerror}") from None
    if not os.path.isfile(spath):
        raise EngineError("file_not_found", f"not a regular file: {spath}")
    if st.st_size < 24:
        with open(spath, "rb") as f:
            head = f.read(4)
        if head != GGUF_MAGIC:
            raise EngineError("invalid_gguf", f"{spath}: not a GGUF file (magic {head!r})")
        raise EngineError("invalid_gguf", f"{spath}: truncated file ({st.st_size} bytes)")
    return st


def _read_tensor_infos(cur: Cursor, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """The ``n_tensors`` tensor infos at the cursor: ``(name, shape, ggml type id, offset)``."""
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
    return raw_infos


def _map_tensors(cur: Cursor, raw_infos: list[tuple[str, tuple[int, ...], int, int]], data_start: int,
                 alignment: int, size: int) -> dict[str, TensorInfo]:
    """Each tensor's :class:`TensorInfo`, checked: a supported type, whole blocks, aligned, inside
    the file's ``size`` bytes, not named twice."""
    spath = cur.path
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
    return tensors


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
