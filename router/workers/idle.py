"""Idle unload of one model's ready worker (``idle_ttl_s``, or the last request's keep_alive).

A ready worker with nothing running or waiting for its idle time-to-live is unloaded
(drained, then stopped; never a ``pinned`` model), as Ollama's keep_alive and
llama-server's ``--sleep-idle-seconds`` do. The idle check and the switch to
``draining`` happen in one step (the slot's :meth:`~router.workers.unloading.Unloader.idle_unload`,
called with no ``await`` in between), so a request cannot slip in between.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

from router.workers.lifecycle import LOADED, WorkerState

if TYPE_CHECKING:
    from router.workers.slot import ModelSlot
    from router.workers.process import WorkerProcess


class IdleTimer:
    """The idle time-to-live in force and the loop that unloads on it."""

    def __init__(self, slot: ModelSlot) -> None:
        self._slot = slot
        self.keep_alive: float | None = None  # the last request's keep_alive (s; inf: forever); None: idle_ttl_s
        self._wake = asyncio.Event()  # the loop re-reads activity and its TTL
        self._task: asyncio.Task[None] | None = None

    def ttl(self) -> float | None:
        """The idle time-to-live in force, s: the last request's keep_alive (router.serving.keep_alive),
        else the config's ``idle_ttl_s``; None: never unloaded for idleness (pinned, a TTL of 0
        in the config, or a keep_alive of "until unloaded")."""
        model = self._slot.model
        if model.pinned:
            return None
        if self.keep_alive is not None:
            return None if math.isinf(self.keep_alive) else self.keep_alive
        return model.idle_ttl_s if model.idle_ttl_s > 0 else None

    def keep_alive_s(self) -> float | None:
        """The keep_alive in force as /admin/models shows it (-1: until unloaded)."""
        return None if self.keep_alive is None else -1 if math.isinf(self.keep_alive) else self.keep_alive

    def set_keep_alive(self, seconds: float | None) -> None:
        self.keep_alive = seconds
        self._wake.set()
        self.watch()

    def wake(self) -> None:
        """Activity changed (a request finished): the loop re-reads it."""
        self._wake.set()

    def watch(self) -> None:
        """Start the loop for the ready worker when a TTL is in force and none runs."""
        slot = self._slot
        wp = slot.worker
        if self._task is None and wp is not None and slot.state is WorkerState.READY and self.ttl() is not None:
            self._task = asyncio.create_task(self._loop(wp), name=f"idle-{slot.model.name}")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._task = None

    def expires_at(self, last_active: float) -> float | None:
        """Unix time the idle unload is due (the TTL after ``last_active``, monotonic s), while
        the model is ready and idle; None when it has no TTL, is busy or is not loaded."""
        slot = self._slot
        ttl = self.ttl()
        if ttl is None or slot.state is not WorkerState.READY or slot.busy or slot.queue_depth > 0:
            return None
        return time.time() + max(0.0, last_active + ttl - time.monotonic())

    async def _loop(self, wp: WorkerProcess) -> None:
        """Unload ``wp`` once it has had nothing running or waiting for the TTL.

        Wakes when the idle period would end: after a busy spell it re-reads the
        last activity (a finished request moves it), so the unload comes
        the TTL after the last request finished, not later.
        """
        slot = self._slot
        while slot.worker is wp and slot.state in LOADED:
            ttl = self.ttl()  # a request's keep_alive may change it
            if ttl is None:
                break
            busy = slot.busy or slot.queue_depth > 0 or slot.state is not WorkerState.READY
            left = slot.last_active + ttl - time.monotonic()
            if busy or left > 0:
                self._wake.clear()  # set by a release or a new keep_alive
                try:
                    await asyncio.wait_for(self._wake.wait(), max(ttl, 1.0) if busy else left)
                except TimeoutError:
                    pass
                continue
            # idle for ttl: check and state change in one step (no await in between)
            self._task = None
            why = "keep_alive" if self.keep_alive is not None else "idle_ttl_s"
            slot.unloader.idle_unload(f"idle for {ttl:g} s ({why})")
            return
        if self._task is asyncio.current_task():
            self._task = None
