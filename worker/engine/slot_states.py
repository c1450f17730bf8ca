"""What the scheduler's slots hold, and KV states in and out of them: the slots' view, the idle
entries (the prefix cache), and a slot's entry saved, installed (a KV state from a file, another
worker or the disk cache) or erased — llama.cpp's slot actions. A part of
:class:`~worker.engine.scheduler.Scheduler` (its base), on the scheduler's one thread.
"""

from __future__ import annotations

import numpy as np

from .errors import EngineError
from .kv.cache import KVEntry, KVPool
from .prefix import PrefixCache
from .seqs import SlotInfo, _Slot

__all__ = ["SlotStates"]


class SlotStates:
    """The slot-state half of the scheduler (expects its ``slots``, ``pool``, ``prefix``, ``n_ctx``
    and LRU ``_clock``)."""

    slots: list[_Slot]
    pool: KVPool
    prefix: PrefixCache
    n_ctx: int
    _clock: int

    def slot_info(self) -> list[SlotInfo]:
        out = []
        for s in self.slots:
            if s.seq is not None:
                n = s.seq.entry.n_past if s.seq.entry is not None else 0
                out.append(SlotInfo(s.id, s.seq.req.id, True, n))
            else:
                e = s.last_entry
                out.append(SlotInfo(s.id, None, False, e.n_past if e is not None and e in self.pool.entries else 0))
        return out

    def idle_entries(self) -> list[KVEntry]:
        """KV entries no running sequence owns (the prefix cache), least recently used first."""
        owned = {id(s.seq.entry) for s in self.slots if s.seq is not None and s.seq.entry is not None}
        return sorted((e for e in self.pool.entries if id(e) not in owned), key=lambda e: e.last_use)

    def _slot(self, id_slot: int) -> _Slot:
        if isinstance(id_slot, bool) or not isinstance(id_slot, int) or not 0 <= id_slot < len(self.slots):
            raise EngineError("invalid_params", f"Invalid slot ID {id_slot!r} (slots 0..{len(self.slots) - 1})")
        return self.slots[id_slot]

    def slot_busy(self, id_slot: int) -> bool:
        """True while a sequence runs in slot ``id_slot`` (its state cannot be saved, restored or
        erased until it ends). Raises EngineError("invalid_params") for a bad id."""
        return self._slot(id_slot).seq is not None

    def slot_entry(self, id_slot: int) -> KVEntry | None:
        """The idle entry slot ``id_slot`` last ran (None: none, or another sequence took it over).

        Raises: EngineError("invalid_params") for a bad id or a busy slot.
        """
        sl = self._slot(id_slot)
        if sl.seq is not None:
            raise EngineError("invalid_params", f"slot {id_slot} is processing a request")
        e = sl.last_entry
        if e is None or e not in self.pool.entries or e not in self.idle_entries():
            return None
        return e

    def install(self, tokens: list[int], k: np.ndarray, v: np.ndarray, id_slot: int | None = None) -> KVEntry:
        """A new idle entry holding ``tokens`` with keys ``k`` / values ``v``
        (``[n_layer, n_kv_head, n, head_dim]``), the prefix cache's most recent; with
        ``id_slot`` it becomes that slot's entry and the entry the slot held is dropped.
        Idle entries are evicted (LRU) to make room. The caller has validated the state.

        Raises (nothing changed): EngineError("invalid_params") bad / busy slot, shapes;
            EngineError("kv_budget_exceeded") it does not fit even with every idle entry evicted.
        """
        sl = self._slot(id_slot) if id_slot is not None else None
        if sl is not None and sl.seq is not None:
            raise EngineError("invalid_params", f"slot {id_slot} is processing a request")
        n = len(tokens)
        s = self.pool.shape
        if k.shape != (s.n_layer, s.n_kv_head, n, s.head_dim_k) or v.shape != (s.n_layer, s.n_kv_head, n, s.head_dim_v):
            raise EngineError("invalid_params", f"KV arrays {k.shape}/{v.shape} do not fit this model's KV layout")
        if n > self.n_ctx:
            raise EngineError("context_length_exceeded", f"a KV state of {n} tokens exceeds n_ctx={self.n_ctx}")
        old = self.slot_entry(id_slot) if id_slot is not None else None
        cap = max(1, -(-n // 16) * 16)
        idle = [e for e in self.idle_entries() if e is not old]
        free_after = self.pool.free_tokens() + (old.capacity if old is not None else 0)
        if free_after + sum(e.capacity for e in idle) < cap:
            raise EngineError("kv_budget_exceeded", f"a KV state of {n} tokens does not fit this model's KV "
                              f"budget of {self.pool.budget_tokens} tokens")
        if old is not None:
            self.pool.drop(old)
        self.prefix.make_room(cap, None, idle)
        entry = self.pool.new(cap)
        if n:
            entry.k[:, :, :n] = k
            entry.v[:, :, :n] = v
            entry._written = n
        entry.tokens.extend(int(t) for t in tokens)
        entry.checkpoints = None  # how it was evaluated is not known: its prefix is reused as is
        entry.swa_high_water = n
        self._clock += 1
        entry.last_use = self._clock
        if sl is not None:
            sl.last_entry = entry
        return entry

    def erase(self, id_slot: int) -> int:
        """Drop slot ``id_slot``'s idle entry; the tokens it held (0: none).

        Raises: EngineError("invalid_params") for a bad id or a busy slot.
        """
        e = self.slot_entry(id_slot)
        if e is None:
            return 0
        n = e.n_past
        self.pool.drop(e)
        self.slots[id_slot].last_entry = None
        return n

    def best_prefix(self, ids: list[int]) -> int:
        """The longest prefix of ``ids`` (at most ``len(ids) - 1``) any entry holds."""
        limit = len(ids) - 1
        return max((e.common_prefix(ids, limit) for e in self.pool.entries), default=0)
