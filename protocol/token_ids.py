"""Token ids packed for the wire: :class:`TokenIds`, little-endian int32 bytes (one msgpack ``bin``).

Imports neither the router nor the worker; both import it.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import ClassVar

__all__ = ["TokenIds"]


class TokenIds(bytes):
    """A list of token ids as one compact value: little-endian int32, 4 bytes per id.

    Fields that may hold millions of ids (a 7 MB text's TokenizeResult: ~2.5M) carry this
    instead of a msgpack list, so neither side packs, unpacks or type-checks millions of
    Python ints in one hold of the GIL (2.5M ids as a list: ~0.4 s of the router's event
    loop to decode). On the wire it is a msgpack ``bin``; the codec's one rule for it is
    its shape (a whole number of 4-byte ids, checked on encode and decode). What an id
    means ([0, n_vocab)) is checked where it is used (the engine).

    Build with :meth:`of`; read with :meth:`view` (no copy on little-endian hosts) or
    :meth:`tolist`. ``len()`` is the byte length; :attr:`count` the number of ids.
    """

    #: Bytes per id.
    ITEM_BYTES: ClassVar[int] = 4
    #: Ids packed per C-level step by :meth:`of` (~1 ms each).
    PACK_SLICE: ClassVar[int] = 1 << 16

    @classmethod
    def of(cls, ids: Iterable[int]) -> TokenIds:
        """Pack ``ids`` (ints in [-2**31, 2**31-1]; OverflowError outside, TypeError for a
        non-int), a list in slices of ``PACK_SLICE`` (other threads may run in between)."""
        if isinstance(ids, list) and len(ids) > cls.PACK_SLICE:
            a = array("i")
            for i in range(0, len(ids), cls.PACK_SLICE):
                a.extend(ids[i:i + cls.PACK_SLICE])
        else:
            a = array("i", ids)
        if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
            a.byteswap()
        return cls(a.tobytes())

    # deliberately replaces bytes.count (a substring count, meaningless over packed int32 ids)
    @property
    def count(self) -> int:  # type: ignore[override]
        """Number of ids."""
        return len(self) // self.ITEM_BYTES

    def view(self) -> memoryview | array[int]:
        """The ids as a read-only sequence of int (indexing, slicing, iterating; ``len`` is
        the id count): a memoryview over these bytes, or a byte-swapped copy on big-endian hosts."""
        if sys.byteorder == "little":
            return memoryview(self).cast("i")
        a = array("i")  # pragma: no cover
        a.frombytes(self)  # pragma: no cover
        a.byteswap()  # pragma: no cover
        return a  # pragma: no cover

    def tolist(self) -> list[int]:
        """The ids as a list of int (builds one Python int per id)."""
        return self.view().tolist()


assert array("i").itemsize == TokenIds.ITEM_BYTES, "TokenIds needs a 4-byte C int"
