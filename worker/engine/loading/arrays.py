"""Compact GGUF metadata arrays: what ``read_gguf`` gives for arrays of at least
:data:`~.gguf_metadata.COMPACT_MIN_ITEMS` items (the vocabulary's tokens, scores, token types and
merges) instead of Python lists.

A list of 262,144 ``str`` / ``float`` objects costs ~22 / ~8 MiB of resident memory, the same
data packed ~3.2 / ~1 MiB. They are read-only :class:`StringArray` (one UTF-8 blob + offsets) and
:class:`NumericArray` (one numpy array) sequences that index (negative indexes too; out of range
raises IndexError), slice (to a list), iterate and compare equal like the list they replace,
giving the same Python values (``str``; ``int`` / ``float`` / ``bool``); they are not ``list``
instances and cannot be mutated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

__all__ = ["NumericArray", "StringArray"]


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
