"""Placement's one owner: the loads wanted, decided over every model in one synchronous step.

A model that must load asks for room (its :class:`SlotPlacing`, which the pool's
:meth:`Placer.want` queues); the placer decides at once and
again whenever a model's facts change (:meth:`Placer.place`): load now, or evict idle
least-recently-used unpinned models first (drain-then-swap: nothing running is ever cut)
and wait, or refuse with 503 (``insufficient_memory``, ``max_loaded_reached``). Wanted loads
are placed first come, first served. The decision itself is ``router.workers.placement.decide``
(pure); this module feeds it the seats it reads in the same step, so no decision uses a
stale snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from router.http.errors import ApiError, InsufficientMemory, MaxLoadedReached
from router.workers import placement
from router.workers.lifecycle import WorkerState

if TYPE_CHECKING:
    from router.workers.pool import Pool
    from router.workers.slot import ModelSlot

log = logging.getLogger("modelyard.pool")


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
            if not slot.placing.wanted():
                slot.placing.cancel()  # nobody waits for it any more
                continue
            seats = [seat for s in self._pool.every_slot() if s is not slot and (seat := s.seat()) is not None]
            d = placement.decide(slot.model.name, slot.estimate(), seats, max_loaded=self._pool.config.server.max_loaded,
                                 available=self._pool.memory.available() + self._pool.spare_bytes())
            for name in d.evict:
                self._pool.slot_by_key(name).placing.evict(slot.model.name)
            if d.action == "load":
                self._wanting.remove(slot)
                slot.placing.granted()
            elif d.action == "refuse":
                slot.placing.refuse(d)
            else:
                slot.placing.later(d.why)
                return  # first come, first placed: the others wait behind it


class SlotPlacing:
    """One model's side of placement: the load it wants (asked once per load: a burst of first
    requests waits on the same one), who waits for it, and the placer's decisions applied to it.
    Part of the model's slot (``router.workers.slot``), which alone makes it."""

    def __init__(self, slot: ModelSlot) -> None:
        self._slot = slot
        self._future: asyncio.Future[None] | None = None  # set while waiting for a place
        self._holders = 0  # ready_worker callers waiting on it (they hold no ticket)
        self._sticky = False  # an operator asked for the load: wanted even with nobody waiting
        self.waiting_for: str | None = None  # why the wanted load has not started

    @property
    def asked(self) -> bool:
        """A load is wanted and not yet placed, refused or given up."""
        return self._future is not None

    def wanted(self) -> bool:
        """A load is wanted and someone still waits for it."""
        slot = self._slot
        return (self._future is not None and slot.state in (WorkerState.UNLOADED, WorkerState.FAILED)
                and (slot.queue_depth > 0 or self._holders > 0 or self._sticky))

    def ask(self, *, sticky: bool = False) -> None:
        """Ask the pool for a place to load in (it may start the load at once). Once per
        load: a burst of first requests waits on the same placement."""
        if sticky:
            self._sticky = True
        if self._slot.state not in (WorkerState.UNLOADED, WorkerState.FAILED) or self._future is not None:
            return
        self._future = asyncio.get_running_loop().create_future()
        self._slot.pool.want(self._slot)

    async def wait(self) -> None:
        """Wait for the place as a caller without a ticket (``ready_worker``), asking for it if the
        model is not loaded; raises what refused it. Meanwhile the model is wanted."""
        slot = self._slot
        self._holders += 1  # before asking: the placement sees someone waits
        try:
            if slot.state in (WorkerState.UNLOADED, WorkerState.FAILED):
                self.ask()
            if self._future is not None:  # waiting for room (max_loaded, memory)
                await asyncio.shield(self._future)
        finally:
            self._holders -= 1
            if self._future is not None:
                slot.pool.place()  # the last one to leave may leave nobody wanting it

    def granted(self) -> None:
        """The placer's decision: load now."""
        fut, self._future = self._future, None
        self._sticky = False
        self.waiting_for = None
        self._slot.loader.begin()
        if fut is not None and not fut.done():
            fut.set_result(None)

    def later(self, why: str) -> None:
        """The placer's decision: not yet (``why``: what it waits for)."""
        if why != self.waiting_for:
            log.info("model %s: %s", self._slot.model.name, why)
            self._slot.emit("waiting", why=why)
        self.waiting_for = why

    def refuse(self, decision: placement.Decision) -> None:
        """The placer's decision: it cannot load (503 to everyone waiting)."""
        slot = self._slot
        log.warning("model %s: %s", slot.model.name, decision.why)
        slot.emit("refused", code=decision.code, why=decision.why)
        err: ApiError = (InsufficientMemory(decision.why) if decision.code == "insufficient_memory"
                         else MaxLoadedReached(decision.why))
        slot.last_error = decision.why
        self.drop(err)
        slot.admission.refuse_waiting(err)

    def cancel(self) -> None:
        """The placer's decision: the wanted load is not needed any more (nobody waits)."""
        self.drop(None)

    def drop(self, err: ApiError | None) -> None:
        """No load is wanted any more (refused, unloaded, shutdown or nobody waits): its waiters
        get ``err`` (None: cancelled)."""
        fut, self._future = self._future, None
        self._sticky = False
        self.waiting_for = None
        self._slot.pool.unwant(self._slot)
        if fut is not None and not fut.done():
            if err is None:
                fut.cancel()
            else:
                fut.set_exception(err)
                fut.exception()  # retrieved: no one may be awaiting it

    def evict(self, for_model: str) -> None:
        """The placer's decision: this idle model makes room for ``for_model`` (drain-then-stop;
        a request that arrives meanwhile waits and loads it again)."""
        slot = self._slot
        assert slot.state is WorkerState.READY and not slot.model.pinned
        slot.metrics.evictions.labels(slot.model.name).inc()
        slot.emit("evicted", **{"for": for_model})
        slot.unloader.soft_unload(f"evicted to make room for '{for_model}'")
