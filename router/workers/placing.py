"""Placement's one owner: the loads wanted, decided over every model in one synchronous step.

A model that must load asks for room (:meth:`Placer.want`); the placer decides at once and
again whenever a model's facts change (:meth:`Placer.place`): load now, or evict idle
least-recently-used unpinned models first (drain-then-swap: nothing running is ever cut)
and wait, or refuse with 503 (``insufficient_memory``, ``max_loaded_reached``). Wanted loads
are placed first come, first served. The decision itself is ``router.workers.placement.decide``
(pure); this module feeds it the seats it reads in the same step, so no decision uses a
stale snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.workers import placement

if TYPE_CHECKING:
    from router.workers.pool import Pool
    from router.workers.slot import ModelSlot


class Placer:
    """The wanted loads of one pool, first come first placed."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._wanting: list[ModelSlot] = []  # models waiting for room to load, first come first placed
        self._placing = False
        self._place_again = False

    def want(self, slot: ModelSlot) -> None:
        """``slot`` wants to load: queue it for placement and decide now."""
        if slot not in self._wanting:
            self._wanting.append(slot)
        self.place()

    def unwant(self, slot: ModelSlot) -> None:
        if slot in self._wanting:
            self._wanting.remove(slot)

    def place(self) -> None:
        """Start every wanted load that has room now, in the order they were wanted,
        evicting idle least-recently-used models first when needed (router.workers.placement).
        Synchronous: the snapshot and the actions on it are one step. Re-entrant calls
        (an action that changes state calls back) run again after the current pass."""
        if self._placing:
            self._place_again = True
            return
        self._placing = True
        try:
            while True:
                self._place_again = False
                self._place_once()
                if not self._place_again:
                    return
        finally:
            self._placing = False

    def _place_once(self) -> None:
        for slot in list(self._wanting):
            if self._pool.closing:
                return
            if not slot.wants_place():
                slot.cancel_placement()  # nobody waits for it any more
                continue
            seats = [seat for s in self._pool.slots.values() if s is not slot and (seat := s.seat()) is not None]
            d = placement.decide(slot.model.name, slot.estimate(), seats, max_loaded=self._pool.config.server.max_loaded,
                                 available=self._pool.memory.available() + self._pool.spare_bytes())
            for name in d.evict:
                self._pool.slots[name].evict(slot.model.name)
            if d.action == "load":
                self._wanting.remove(slot)
                slot.placed()
            elif d.action == "refuse":
                slot.refuse_place(d)
            else:
                slot.place_later(d.why)
                return  # first come, first placed: the others wait behind it
