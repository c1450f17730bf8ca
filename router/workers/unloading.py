"""Unloading one model's worker: drain, then stop; and a config reload applied through it.

An unload changes the state at once (``draining``; a loading or failed model goes straight to
``unloaded``), so no request is admitted between the decision and the change; the task it
returns finishes the job: with ``drain`` the running requests finish (up to
``drain_timeout_s``, then they are cancelled and get up to ``cancel_timeout_s`` for their
Done), then Shutdown, ``shutdown_grace_s``, kill. An operator's unload refuses the waiting
requests (503); a soft one — the idle unload (``idle_ttl_s``, like Ollama's keep_alive;
never for ``pinned`` models), an eviction, a changed config — keeps them waiting, and they
load the model again once it has stopped.

Config reload: a changed model applies its new config at once when no worker runs,
otherwise once its worker has drained; a removed one drains and is forgotten.

Part of the model's slot (``router.workers.slot``), which alone makes it; like the slot's
methods, its own never ``await`` between reading a fact and acting on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from router.config import ModelConfig
from router.http.errors import ModelUnloading
from router.workers.backoff import crash_policy
from router.workers.lifecycle import LOADED, WorkerState

if TYPE_CHECKING:
    from router.workers.process import WorkerProcess
    from router.workers.slot import ModelSlot

log = logging.getLogger("modelyard.pool")


async def _nothing() -> None:
    return None


class Unloader:
    """One model's unload (at most one at a time), and the config change it waits to apply."""

    def __init__(self, slot: ModelSlot) -> None:
        self._slot = slot
        self.task: asyncio.Task[None] | None = None  # the unload running (or last run)
        self.soft = False  # the current drain is a soft unload: new requests wait, then reload
        self.unload_reason: str | None = None  # why the worker was last unloaded (admin, idle)
        self.pending: ModelConfig | None = None  # a reload changed the config: applied once the worker stops
        self.retiring = False  # removed from the config: draining, then forgotten

    def begin_unload(self, drain: bool, reason: str) -> asyncio.Task[None]:
        """The synchronous start of an unload (``ModelSlot.begin_unload``); returns its task."""
        slot = self._slot
        if self.soft and slot.state is WorkerState.DRAINING:
            self.soft = False
            self.unload_reason = reason
            slot.admission.refuse_waiting(ModelUnloading(f"model '{slot.model.name}' is being unloaded"))
        if self.task is None or self.task.done():
            self.task = self._start(drain, reason)
        return self.task

    def idle_unload(self, reason: str) -> None:
        """The idle timer's decision, applied in the same step: drain and stop; a request
        arriving meanwhile waits and loads the model again."""
        self.soft = True
        self._slot.asleep = True
        self.task = self._start(drain=True, reason=reason)

    def soft_unload(self, reason: str) -> None:
        """Drain and stop, with new requests waiting to load it again (idle unload, eviction, reload)."""
        self.soft = True
        self.task = self._start(drain=True, reason=reason)

    # ------------------------------------------------------------------ config reload

    def reconfigure(self, model: ModelConfig) -> None:
        """A reload changed this model's config (``ModelSlot.reconfigure``)."""
        slot = self._slot
        self.pending = model
        if slot.state in (WorkerState.UNLOADED, WorkerState.FAILED):
            self._apply_pending()
        elif slot.state is WorkerState.READY:
            self.soft_unload("config changed: reloading with the new settings")
        # loading: once ready it drains at once (router.workers.loading); draining: applied when stopped

    def _apply_pending(self) -> None:
        slot = self._slot
        if self.pending is None:
            return
        slot.model, self.pending = self.pending, None
        slot.failures.policy = crash_policy(slot.model)
        log.info("model %s: new config applied", slot.model.name)
        slot.emit("reconfigured")

    def retire(self) -> asyncio.Task[None]:
        """A reload removed this model (``ModelSlot.retire``): drain and stop."""
        self.retiring = True
        self.pending = None
        return self.begin_unload(drain=True, reason="removed from the config")

    # ------------------------------------------------------------------ the unload

    def _start(self, drain: bool, reason: str) -> asyncio.Task[None]:
        """The synchronous half of an unload: the state changes now (so no request is
        admitted between the decision and the change); returns the task that stops the worker."""
        slot = self._slot
        if slot.state is WorkerState.UNLOADED:
            if slot.placing.asked:  # waiting for room: not any more
                slot.placing.drop(ModelUnloading(f"model '{slot.model.name}' was unloaded"))
                slot.admission.refuse_waiting(ModelUnloading(f"model '{slot.model.name}' was unloaded"))
            return asyncio.create_task(_nothing())
        self.unload_reason = reason
        if slot.state is WorkerState.FAILED:
            if slot.placing.asked:
                slot.placing.drop(ModelUnloading(f"model '{slot.model.name}' was unloaded"))
            slot.loader.forget_crash()
            slot.admission.refuse_waiting(ModelUnloading(f"model '{slot.model.name}' was unloaded"))
            slot.move(WorkerState.UNLOADED)
            return asyncio.create_task(_nothing())
        if slot.state is WorkerState.LOADING:
            wp = slot.loader.abandon()
            slot.move(WorkerState.UNLOADED)
            slot.admission.refuse_waiting(ModelUnloading(f"model '{slot.model.name}' was unloaded while loading"))
            return asyncio.create_task(wp.stop(slot.model.shutdown_grace_s) if wp is not None else _nothing(),
                                       name=f"unload-{slot.model.name}")
        assert slot.state in LOADED and slot.worker is not None
        wp = slot.worker
        if slot.state is WorkerState.UNRESPONSIVE:
            drain = False  # a silent worker cannot finish its requests: stop it now
        slot.liveness.unresponsive_since = None
        slot.move(WorkerState.DRAINING)
        if not self.soft:
            slot.admission.refuse_waiting(ModelUnloading(f"model '{slot.model.name}' is being unloaded"))
        log.info("model %s: unloading (%s)", slot.model.name, reason)
        slot.emit("unloading", reason=reason)
        return asyncio.create_task(self._drain_and_stop(wp, drain), name=f"unload-{slot.model.name}")

    async def _until_idle(self, wp: WorkerProcess, timeout_s: float) -> None:
        """Wait until ``wp`` runs nothing of this model, it is gone, or ``timeout_s`` has passed."""
        slot = self._slot
        deadline = time.monotonic() + timeout_s
        while slot.busy and wp.alive and (left := deadline - time.monotonic()) > 0:
            slot.changed.clear()
            try:
                await asyncio.wait_for(slot.changed.wait(), left)
            except TimeoutError:
                break

    async def _drain_and_stop(self, wp: WorkerProcess, drain: bool) -> None:
        slot = self._slot
        await self._until_idle(wp, slot.model.drain_timeout_s if drain else 0.0)
        for tid in slot.admission.running_ids:
            wp.cancel(tid)
        if drain and slot.busy and wp.alive:  # drain_timeout_s: their Done(cancelled) reaches the clients
            await self._until_idle(wp, slot.model.cancel_timeout_s)
        await wp.stop(slot.model.shutdown_grace_s)
        slot.admission.forget_running()
        slot.stop_watchers()
        slot.worker = None
        slot.last_exit_code = wp.exit_code
        slot.move(WorkerState.UNLOADED, wp.kill_reason)
        reload = self.soft and not slot.pool.closing and not self.retiring
        self.soft = False
        self._apply_pending()
        if reload and slot.queue_depth > 0:  # requests that arrived during an idle unload / eviction start it again
            slot.placing.ask()
        slot.pool.place()  # its place is free
