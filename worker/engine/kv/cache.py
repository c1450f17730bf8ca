"""Key/value memory: one :class:`KVEntry` per sequence, within a :class:`KVPool` budget.

Layout of an entry: ``k``, ``v`` are ``[n_layer, n_kv_head, capacity,
head_dim]`` (the model's compute dtype). Position ``p`` of layer ``l`` lives at
``k[l, :, p, :]``, so the keys of positions ``a..b-1`` for one layer are the
contiguous-per-head block ``k[l, :, a:b]``. The arrays live in anonymous
``mmap`` memory (zero pages, allocated 4 KiB at a time on first write): the
capacity reserved for a sequence's future tokens costs address space, not RSS,
until they are written. (``np.zeros`` would get transparent huge pages from
numpy's allocator: measured on SmolLM2 with n_ctx 8192, writing 640 positions
made 178 MiB resident instead of 14 MiB.)

Keys are stored after RoPE (as llama.cpp's cache does); llama.cpp keeps them in
f16 by default, this cache keeps the model's compute dtype.

**What an entry holds is ``entry.tokens``, and only that**: the token ids whose
K/V are written and valid, in position order (``n_past == len(tokens)``). The
model writes positions ``n_past .. n_past+T-1`` during a forward pass; the
caller (the scheduler) appends the tokens only after the whole pass returned,
so an exception or a cancel never leaves half-written positions that a later
request trusts.

Budget: the pool counts every entry's *capacity* (positions reserved, written
or not) in tokens and refuses a reservation that would exceed
``budget_tokens``; RSS of the KV memory is therefore at most
``budget_tokens * token_bytes`` (positions given back are returned to the OS
with ``madvise(MADV_DONTNEED)``). Idle entries are shrunk to what they hold.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import EngineError

__all__ = ["Checkpoint", "KVEntry", "KVPool", "KVShape"]

#: Capacity granularity in positions (an idle entry is shrunk to a multiple of it).
KV_ROUND = 16


class KVShape:
    """The facts the KV layout depends on.

    Args:
        n_layer, n_kv_head, head_dim_k, head_dim_v: positive ints.
        dtype: element type (float32, or float64 for reference runs).
    Raises:
        EngineError("invalid_params"): a non-positive size.
    """

    def __init__(self, n_layer: int, n_kv_head: int, head_dim_k: int, head_dim_v: int,
                 dtype: np.dtype | type = np.float32) -> None:
        for name, val in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim_k", head_dim_k),
                          ("head_dim_v", head_dim_v)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val <= 0:
                raise EngineError("invalid_params", f"KV cache {name} must be a positive integer, got {val!r}")
        self.n_layer, self.n_kv_head = int(n_layer), int(n_kv_head)
        self.head_dim_k, self.head_dim_v = int(head_dim_k), int(head_dim_v)
        self.dtype = np.dtype(dtype)

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V of one position over all layers."""
        return self.n_layer * self.n_kv_head * (self.head_dim_k + self.head_dim_v) * self.dtype.itemsize


@dataclass(frozen=True)
class Checkpoint:
    """Where llama-server would hold a context checkpoint of this entry's sliding-window state.

    llama-server (``tools/server/server-context.cpp``, ``create_checkpoint``) saves the part of a
    sliding-window model's memory that cannot be rolled back, before decoding a batch that starts
    at ``n_tokens``; this entry keeps every position's K/V, so a checkpoint here is only the record
    of that moment, which decides where a later prompt's re-evaluation starts (the scheduler's
    ``PrefixCache.swa_reuse``). All fields are token counts / positions (ints):

    ``n_tokens``: tokens the memory held; ``pos_max``: its highest position (``n_tokens - 1``);
    ``pos_min``: the lowest position the sliding-window cache still held then (0 until that cache
    of ``swa_cells`` cells wrapped); ``high_water``: the entry's ``swa_high_water`` then;
    ``task``: the request id that made it (llama.cpp's eviction spares the current task's).
    """

    n_tokens: int
    pos_min: int
    pos_max: int
    high_water: int
    task: str


class KVEntry:
    """One sequence's keys and values for positions ``0 .. n_past-1`` (``n_past = len(tokens)``).

    ``capacity`` is what the entry has reserved (what the pool's budget counts);
    the arrays behind it may be larger (``allocated``, a power of two of at least
    256 positions and 1.25x the capacity, at most ``max_positions``): address space only, so growing
    within it costs no copy, and resident memory is what has been written.
    Positions given back (truncate, shrink) are returned to the OS.

    Args:
        shape: the model's :class:`KVShape`.
        capacity: positions reserved (>= 0).
        max_positions: largest capacity this entry will ever need (the model's
            n_ctx); None -> no cap.
    """

    def __init__(self, shape: KVShape, capacity: int, max_positions: int | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
            raise EngineError("invalid_params", f"KV capacity must be a non-negative integer, got {capacity!r}")
        self.shape = shape
        self.tokens: list[int] = []
        self.last_use = 0  # scheduler step counter at the last use (LRU)
        #: the fewest tokens held since the KV-event log last read this entry (``kv.blocks``)
        self.changed_from = 0
        #: sliding-window models only (the scheduler keeps them): llama-server's context
        #: checkpoints of this entry, oldest first; None when unknown (a state installed from
        #: outside, e.g. a KV state file)
        self.checkpoints: list[Checkpoint] | None = []
        #: most positions this entry's history ever held (llama.cpp's sliding-window cache of
        #: ``swa_cells`` cells has wrapped once it passed that many)
        self.swa_high_water = 0
        self.max_positions = max_positions
        self._written = 0  # highest position written + 1 (pages possibly resident)
        self._bufs: tuple[mmap.mmap | None, mmap.mmap | None] = (None, None)
        self.allocated = 0
        self.capacity = 0
        self.k: np.ndarray  # [L, n_kv, allocated, hd_k], set by _alloc
        self.v: np.ndarray  # [L, n_kv, allocated, hd_v]
        self._alloc(self._alloc_size(int(capacity)), 0)
        self.capacity = int(capacity)

    def _alloc_size(self, capacity: int) -> int:
        # a power of two with a quarter to spare: the next turn of a conversation (its prompt = this
        # one + the reply + a little) usually still fits, so taking the entry over costs no copy
        want = capacity + capacity // 4
        size = max(256, 1 << max(0, want - 1).bit_length())
        if self.max_positions is not None:
            size = min(size, max(self.max_positions, capacity))
        return max(size, capacity)

    def _alloc(self, allocated: int, keep: int) -> None:
        s = self.shape
        k, kb = _lazy_zeros((s.n_layer, s.n_kv_head, allocated, s.head_dim_k), s.dtype)  # [L, n_kv, alloc, hd_k]
        v, vb = _lazy_zeros((s.n_layer, s.n_kv_head, allocated, s.head_dim_v), s.dtype)  # [L, n_kv, alloc, hd_v]
        if keep:
            k[:, :, :keep] = self.k[:, :, :keep]
            v[:, :, :keep] = self.v[:, :, :keep]
        self.k, self.v = k, v
        self._bufs = (kb, vb)
        self.allocated = allocated
        self._written = keep

    @property
    def n_past(self) -> int:
        """Valid positions (== ``len(tokens)``)."""
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Bytes of address space behind the two arrays."""
        return int(self.k.nbytes + self.v.nbytes)

    def resize(self, capacity: int) -> None:
        """Reserve ``capacity`` positions (>= n_past), keeping the valid ones. Grows without a
        copy within ``allocated``; beyond it the arrays are reallocated (a copy of n_past
        positions). Shrinking gives the written positions beyond n_past back to the OS."""
        if capacity < self.n_past:
            raise EngineError("invalid_params", f"KV capacity {capacity} < n_past {self.n_past}")
        if capacity > self.allocated:
            self._alloc(self._alloc_size(capacity), self.n_past)
        elif capacity < self.capacity:
            self._release(self.n_past)
        self.capacity = capacity

    def store(self, layer: int, pos0: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write keys/values of ``T`` positions ``pos0 .. pos0+T-1`` for one layer.

        Args:
            k: ``[T, n_kv_head, head_dim_k]`` (after RoPE).
            v: ``[T, n_kv_head, head_dim_v]``.
        Raises:
            EngineError("context_length_exceeded"): beyond the capacity.
        Does not change ``tokens`` (the caller appends them once the pass returned).
        """
        t = k.shape[0]
        self.claim(pos0, t)
        self.k[layer, :, pos0:pos0 + t] = k.transpose(1, 0, 2)  # [n_kv, T, hd_k]
        self.v[layer, :, pos0:pos0 + t] = v.transpose(1, 0, 2)  # [n_kv, T, hd_v]

    def claim(self, pos0: int, t: int) -> None:
        """Check that positions ``pos0 .. pos0+t-1`` fit the capacity and count them as written:
        :meth:`store`'s bookkeeping, for a kernel that writes ``k`` / ``v[layer, :, pos0:pos0+t]`` itself.

        Raises: EngineError("context_length_exceeded"): beyond the capacity.
        """
        if pos0 + t > self.capacity:
            raise EngineError("context_length_exceeded",
                              f"KV entry holds {self.capacity} positions; cannot write {t} at {pos0}")
        self._written = max(self._written, pos0 + t)

    def keys(self, layer: int, start: int, end: int) -> np.ndarray:
        """View ``[n_kv_head, end-start, head_dim_k]`` of positions ``start .. end-1``."""
        return self.k[layer, :, start:end]

    def values(self, layer: int, start: int, end: int) -> np.ndarray:
        """View ``[n_kv_head, end-start, head_dim_v]`` of positions ``start .. end-1``."""
        return self.v[layer, :, start:end]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (0 <= n <= n_past); the rest go back to the OS.

        Raises: EngineError("invalid_params") for n outside ``[0, n_past]``.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self.n_past:
            raise EngineError("invalid_params", f"truncate({n!r}) needs an integer in [0, n_past={self.n_past}]")
        del self.tokens[int(n):]
        self.changed_from = min(self.changed_from, int(n))
        self._release(int(n))

    def _release(self, start: int) -> None:
        """Return the pages of positions ``start .. written-1`` to the OS (they read as zeros)."""
        end = self._written
        if end <= start:
            return
        for arr, buf, hd in ((self.k, self._bufs[0], self.shape.head_dim_k), (self.v, self._bufs[1],
                                                                            self.shape.head_dim_v)):
            if buf is None:
                continue
            row = hd * arr.itemsize               # bytes per position
            block = self.allocated * row          # bytes per (layer, head)
            for b in range(self.shape.n_layer * self.shape.n_kv_head):
                lo = b * block + start * row
                hi = b * block + end * row
                lo = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the range only
                hi = hi // mmap.PAGESIZE * mmap.PAGESIZE
                if hi > lo:
                    buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        self._written = start

    def common_prefix(self, ids: Sequence[int], limit: int) -> int:
        """Length of the common prefix of ``tokens`` and ``ids``, at most ``limit``."""
        n, held = 0, self.tokens
        limit = min(limit, len(held), len(ids))
        while n < limit and held[n] == ids[n]:
            n += 1
        return n


class KVPool:
    """Every KV entry of one model, within a budget of ``budget_tokens`` positions.

    Args:
        shape: the model's :class:`KVShape`.
        budget_tokens: positions (capacity) all entries may reserve together (> 0).
    """

    def __init__(self, shape: KVShape, budget_tokens: int, max_positions: int | None = None) -> None:
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens <= 0:
            raise EngineError("invalid_params", f"KV budget must be a positive number of tokens, got {budget_tokens!r}")
        self.shape = shape
        self.budget_tokens = budget_tokens
        self.max_positions = max_positions
        self.entries: list[KVEntry] = []

    @property
    def reserved_tokens(self) -> int:
        """Positions reserved by every entry (the budget's use)."""
        return sum(e.capacity for e in self.entries)

    @property
    def held_tokens(self) -> int:
        """Positions holding valid K/V over every entry."""
        return sum(e.n_past for e in self.entries)

    def free_tokens(self) -> int:
        return self.budget_tokens - self.reserved_tokens

    def new(self, capacity: int) -> KVEntry:
        """A new empty entry of ``capacity`` positions.

        Raises: EngineError("kv_budget_exceeded") when it does not fit the budget.
        """
        if capacity > self.free_tokens():
            raise EngineError("kv_budget_exceeded", f"KV budget full: {capacity} positions asked, "
                              f"{self.free_tokens()} of {self.budget_tokens} free")
        e = KVEntry(self.shape, capacity, self.max_positions)
        self.entries.append(e)
        return e

    def resize(self, entry: KVEntry, capacity: int) -> None:
        """Grow or shrink ``entry`` to ``capacity`` positions.

        Raises: EngineError("kv_budget_exceeded") when growing does not fit the budget.
        """
        if capacity - entry.capacity > self.free_tokens():
            raise EngineError("kv_budget_exceeded", f"KV budget full: {capacity - entry.capacity} more positions "
                              f"asked, {self.free_tokens()} of {self.budget_tokens} free")
        entry.resize(capacity)

    def shrink(self, entry: KVEntry) -> None:
        """Give back ``entry``'s reserved but unwritten positions (rounded up to KV_ROUND)."""
        cap = -(-entry.n_past // KV_ROUND) * KV_ROUND
        if cap < entry.capacity:
            entry.resize(cap)

    def drop(self, entry: KVEntry) -> None:
        """Forget ``entry`` and free its memory."""
        try:
            self.entries.remove(entry)
        except ValueError:
            pass
        entry.tokens.clear()
        entry.k = entry.v = np.zeros((0,), entry.shape.dtype)  # the mmaps go with the last reference
        entry._bufs = (None, None)
        entry.allocated = entry.capacity = entry._written = 0


def _lazy_zeros(shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, mmap.mmap | None]:
    """Zero-filled writable array backed by an anonymous mmap (pages allocated on first touch,
    address space not charged against overcommit), and the mmap."""
    n = int(np.prod(shape)) * dtype.itemsize
    if n == 0:
        return np.zeros(shape, dtype=dtype), None
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
    return np.frombuffer(buf, dtype=dtype).reshape(shape), buf
