"""Liveness of one model's ready worker: the ping loop, the one judge of ``unresponsive``.

Every ``ping_interval_s`` — every ``unresponsive_after_s / 2`` while it runs a request —
the worker is pinged. A worker that owes a frame (a Pong, or a Token of a running job)
and has sent none for ``unresponsive_after_s`` is judged unresponsive: the model's state
machine (``router.workers.slot.ModelSlot``, which applies the verdict) hands it no new
job; any frame makes it ready again. With no Pong within ``ping_timeout_s`` it is killed
as hung. A draining worker is not pinged (its stop is bounded by ``drain_timeout_s`` and
``shutdown_grace_s``).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from protocol import Pong
from router.workers.lifecycle import LOADED, WorkerState

if TYPE_CHECKING:
    from router.workers.slot import ModelSlot
    from router.workers.process import WorkerProcess


class Liveness:
    """The ping loop of one model's ready worker, and the last Pong it got."""

    def __init__(self, slot: ModelSlot) -> None:
        self._slot = slot
        self._task: asyncio.Task[None] | None = None
        self._pong: tuple[WorkerProcess, Pong] | None = None  # the current worker's last Pong
        self.unresponsive_since: float | None = None  # unix time the worker went unresponsive

    def watch(self, wp: WorkerProcess) -> None:
        """``wp`` is ready: judge it from now on (no-op with ``ping_interval_s`` 0)."""
        if self._slot.model.ping_interval_s > 0:
            self._task = asyncio.create_task(self._loop(wp), name=f"ping-{self._slot.model.name}")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._task = None

    def last_pong(self) -> Pong | None:
        """The current worker's most recent Pong (None before the first, or after it left)."""
        if self._pong is not None and self._pong[0] is self._slot.worker:
            return self._pong[1]
        return None

    async def probe(self, timeout_s: float = 2.0) -> Pong | None:
        """Ping the ready worker now (for /slots, /metrics): its Pong, kept as the last
        one, or None (no ready worker, or no answer within ``timeout_s``; a hung worker
        is left to the ping loop, which kills it after ping_timeout_s)."""
        wp = self._slot.worker
        if wp is None or self._slot.state is not WorkerState.READY or not wp.alive:
            return None
        return await self._ping(wp, timeout_s)

    async def _ping(self, wp: WorkerProcess, timeout_s: float) -> Pong | None:
        pong = await wp.ping(timeout_s)
        if pong is not None and wp is self._slot.worker:
            self._pong = (wp, pong)
            self._slot.sample_rss(wp)
            self._slot.metrics.count_decodes(self._slot.model.name, wp.pid, pong.n_decode_total,
                                             pong.n_busy_slots_total)
        return pong

    def _watching(self, wp: WorkerProcess) -> bool:
        """``wp`` is the slot's live worker in a state the loop judges (ready, unresponsive)."""
        return wp.alive and self._slot.worker is wp and self._slot.state in LOADED

    async def _loop(self, wp: WorkerProcess) -> None:
        """Judge ``wp`` until it is no longer the ready (or unresponsive) worker: draining, stopped, gone."""
        model = self._slot.model
        tick = max(0.01, min(model.unresponsive_after_s / 4, 0.25))
        while self._watching(wp):
            await self._interval(wp, tick)
            if not self._watching(wp):
                return
            sent = time.monotonic()
            ping = asyncio.ensure_future(self._ping(wp, model.ping_timeout_s))
            try:
                while not ping.done():
                    await asyncio.wait({ping}, timeout=tick)
                    if self._watching(wp):
                        self._judge(wp, sent)
            finally:
                ping.cancel()
            if not self._watching(wp):
                return  # draining or gone meanwhile: not a hung worker
            if ping.result() is None:
                wp.kill(f"worker hung: no Pong within ping_timeout_s={model.ping_timeout_s:g} s; killed")
                return
            self._judge(wp, None)

    async def _interval(self, wp: WorkerProcess, tick: float) -> None:
        """The time between pings; a running job owes Tokens meanwhile."""
        since = time.monotonic()
        while self._watching(wp):
            interval = self._slot.model.ping_interval_s
            if self._slot.busy:
                interval = min(interval, self._slot.model.unresponsive_after_s / 2)
            if time.monotonic() - since >= interval:
                return
            self._judge(wp, None)
            await asyncio.sleep(min(tick, interval))

    def _judge(self, wp: WorkerProcess, ping_sent: float | None) -> None:
        """The verdict on ``wp``: it owes a frame while it runs a job (since its last frame
        or the latest job's start) or while a Ping sent at ``ping_sent`` (monotonic s) is
        unanswered (since then or its last frame). The slot applies it, in the same step."""
        slot = self._slot
        now = time.monotonic()
        if slot.busy:
            silent = now - max(wp.last_frame_at, slot.admission.latest_start())
        elif ping_sent is not None:
            silent = now - max(wp.last_frame_at, ping_sent)
        else:
            silent = 0.0
        window = slot.model.unresponsive_after_s
        if slot.state is WorkerState.READY and silent > window:
            self.unresponsive_since = time.time()
            slot.went_silent(wp, silent)
        elif slot.state is WorkerState.UNRESPONSIVE and silent <= window:
            was, self.unresponsive_since = self.unresponsive_since, None
            slot.answers_again(wp, time.time() - was if was is not None else 0.0)
