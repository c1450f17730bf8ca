"""What the KV pool's entries hold, told as vLLM's KV events (``protocol.kv_events``, issue 25).

Each entry's verified tokens (``KVEntry.tokens``) are described as full blocks of ``block_size``
tokens named by chained hashes (:func:`protocol.kv_events.block_hashes`; a tail shorter than a
block is not named). A block hash is counted once per entry holding it (a prefix copied into a
second entry, or the same conversation held twice, is one block held twice); a block enters the
cache (``BlockStored``) when its count leaves 0 and leaves it (``BlockRemoved``) when it falls
back to 0. ``AllBlocksCleared`` opens the first batch (the subscriber forgets what an earlier
worker told it) and replaces the removals when the pool holds no entry any more.

:meth:`KVBlockLog.collect` compares the pool with what it last told: an entry's blocks are
re-read from its lowest length since then (``KVEntry.changed_from``, which ``truncate`` lowers),
so growing, truncating (a checkpoint restore, a taken-over entry cut back), copying, installing
(slot restore, a KV stream, the disk cache) and dropping (eviction, erase) are all seen without
any call on the token path. Between two collects the counts move all increments first, so a
block that only changed entries (a slot restore replacing an equal prefix) makes no event.
"""

from __future__ import annotations

from collections.abc import Iterable

from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, block_hashes

from .cache import KVEntry

__all__ = ["KVBlockLog"]


class KVBlockLog:
    """The block counts of one pool and what has been told of them (one thread: the engine's).

    Args:
        block_size: tokens per block (>= 1).
    Raises:
        ValueError: ``block_size < 1``.
    """

    def __init__(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.refs: dict[int, int] = {}  # block hash -> entries holding it
        self._told: dict[int, tuple[KVEntry, list[int]]] = {}  # id(entry) -> (entry, its block hashes told)
        self._cleared = True  # the next batch opens with AllBlocksCleared

    def collect(self, entries: Iterable[KVEntry]) -> list[KVEvent]:
        """The events since the last call (in order: AllBlocksCleared when due, BlockStored per
        new run of blocks, one BlockRemoved); [] when nothing changed. ``entries``: every entry of
        the pool now."""
        bs = self.block_size
        events: list[KVEvent] = [AllBlocksCleared()] if self._cleared else []
        self._cleared = False
        gone: list[int] = []
        seen: set[int] = set()
        for e in entries:
            seen.add(id(e))
            told = self._told.get(id(e))
            old = told[1] if told is not None else []
            tokens = e.tokens
            n_full = len(tokens) // bs
            keep = min(len(old), e.changed_from // bs, n_full)
            e.changed_from = len(tokens)
            if keep == len(old) == n_full:
                continue
            gone.extend(old[keep:])
            parent = old[keep - 1] if keep else None
            new = block_hashes(tokens[keep * bs:n_full * bs], bs, parent)
            self._told[id(e)] = (e, old[:keep] + new)
            events.extend(self._store(new, parent, tokens, keep * bs))
        for key in [k for k in self._told if k not in seen]:
            gone.extend(self._told.pop(key)[1])
        removed = [h for h in gone if self._release(h)]
        if removed and not seen:  # the pool is empty: everything left
            events.append(AllBlocksCleared())
        elif removed:
            events.append(BlockRemoved(removed))
        return events

    def _store(self, hashes: list[int], parent: int | None, tokens: list[int], start: int) -> list[BlockStored]:
        """Count ``hashes`` (the blocks of ``tokens`` from ``start``, chained from ``parent``) held
        once more; a BlockStored per run of blocks no entry held before."""
        bs = self.block_size
        out: list[BlockStored] = []
        run: list[int] = []
        run_parent = parent
        for i, h in enumerate(hashes):
            n = self.refs.get(h, 0)
            self.refs[h] = n + 1
            if n == 0:
                run.append(h)
                continue
            if run:
                out.append(self._stored(run, run_parent, tokens, start + (i - len(run)) * bs))
                run = []
            run_parent = h
        if run:
            out.append(self._stored(run, run_parent, tokens, start + (len(hashes) - len(run)) * bs))
        return out

    def _stored(self, run: list[int], parent: int | None, tokens: list[int], lo: int) -> BlockStored:
        return BlockStored(list(run), parent, [int(t) for t in tokens[lo:lo + len(run) * self.block_size]],
                           self.block_size)

    def _release(self, h: int) -> bool:
        """Count block ``h`` held once less; True when no entry holds it any more."""
        n = self.refs.get(h, 0) - 1
        if n > 0:
            self.refs[h] = n
            return False
        self.refs.pop(h, None)
        return True
