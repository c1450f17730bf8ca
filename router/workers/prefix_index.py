"""One replica's prefix index: which token blocks its worker's KV cache holds, approximately.

The cache-aware routing (``router.serving.routing``) asks each ready replica how much of a
prompt it already holds: :meth:`PrefixIndex.match` counts the prompt's leading blocks (chained
hashes, ``protocol.kv_events.block_hashes``) found here. Two feeds keep it:

* the worker's KV events (:meth:`PrefixIndex.feed`, ``KvEvents`` frames in vLLM's format):
  ``BlockStored`` adds blocks, ``BlockRemoved`` drops them, ``AllBlocksCleared`` empties it; a
  gap in the frames' ``seq`` means events were lost, so the index is emptied (it fills again
  from the next events and requests);
* the router itself (:meth:`PrefixIndex.insert`): a prompt routed here is held by the worker
  once it has run, as SGLang's router records the requests it routes; a worker that emits no
  events still gets its conversations' next turns.

Bounded: at most ``max_blocks`` blocks (the oldest inserted go first); emptied when the
replica's worker exits. Pure Python, no state beyond a dict (block hash -> parent hash).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from protocol.kv_events import DEFAULT_BLOCK_SIZE, AllBlocksCleared, BlockRemoved, BlockStored, KvEvents, decode_batch

log = logging.getLogger("modelyard.routing")

#: The most blocks one replica's index keeps (64 Ki blocks of 16 tokens: 1 Mi tokens; ~10 MiB).
MAX_BLOCKS = 1 << 16


class PrefixIndex:
    """The blocks one replica's worker holds (block hash -> parent block hash, None for a first block).

    Args:
        block_size: tokens per block (the worker's ``kv_events_block_size``); the block size of
            the events received wins (the index is emptied when it changes).
        max_blocks: the bound; the oldest inserted blocks are dropped beyond it.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, max_blocks: int = MAX_BLOCKS) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: dict[int, int | None] = {}
        self._seq: int | None = None  # the last KvEvents seq applied
        self.cleared = 0  # times emptied for lost events (seq gap) or a bad batch

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        """Empty it (the worker exited, or its cache was cleared). The next frame's seq starts afresh."""
        self._blocks.clear()
        self._seq = None

    def match(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a prompt's chained block hashes, in order) lead the prompt here:
        the count of leading blocks held (0..len(hashes))."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int], parent: int | None = None) -> None:
        """Blocks the worker holds (or will once the request routed here has run), in chain order."""
        for h in hashes:
            self._blocks.pop(h, None)  # re-inserted: the newest (kept longest)
            self._blocks[h] = parent
            parent = h
        while len(self._blocks) > self.max_blocks:
            del self._blocks[next(iter(self._blocks))]

    def remove(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._blocks.pop(h, None)

    def feed(self, frame: KvEvents) -> None:
        """Apply one worker's KvEvents frame. A seq gap (lost frames) or an undecodable batch
        empties the index first (nothing stale is believed)."""
        if self._seq is not None and frame.seq != self._seq + 1:
            log.info("KV events seq %d after %d: events lost; the replica's prefix index starts afresh",
                     frame.seq, self._seq)
            self.clear()
            self.cleared += 1
        self._seq = frame.seq
        try:
            _ts, events = decode_batch(frame.payload)
        except ValueError as e:  # the codec checked it already: a defect, not data
            log.warning("undecodable KV events batch %d: %s", frame.seq, e)
            self.clear()
            self.cleared += 1
            return
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.block_size != self.block_size:
                    self._blocks.clear()
                    self.block_size = ev.block_size
                self.insert(ev.block_hashes, ev.parent_block_hash)
            elif isinstance(ev, BlockRemoved):
                self.remove(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self._blocks.clear()


__all__ = ["MAX_BLOCKS", "PrefixIndex"]
