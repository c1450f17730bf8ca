"""Loading one model's worker, and starting it again after a crash: the slot's load/restart part.

A load starts when placement grants the model its place (``router.workers.placing``): the
state moves to ``loading`` in that same step, the pool hands over a new worker (or the warm
spare), and :class:`Loader` waits for its Ready (``load_timeout_s``), telling its steps as
log lines and model events (``loading``; a load still going says so every
:data:`LOAD_PROGRESS_INTERVAL_S`). Its outcome is applied in one step after the wait:
``ready`` (the waiting requests get the worker), ``failed`` (they get 503 with the crash
backoff's Retry-After), or nothing when an unload ended the load meanwhile.

Crash backoff (``router.workers.backoff``): a failed model starts again only once its
backoff has passed (else 503 ``restart_backoff`` with the remaining wait), and not
at all after ``max_crashes`` within ``crash_window_s`` until an operator loads it.

Crash with waiting requests: when a ready (or unresponsive) worker dies, its
running requests fail (an SSE error event mid-stream) but the requests that were
only waiting keep their place and run on the restarted worker, started once the
crash backoff allows (they fail only if the model gives up: ``max_crashes``).

Callers without a ticket (tokenize, props, an operator's load) wait for the worker with
:meth:`Loader.ready_worker`. Part of the model's slot (``router.workers.slot``), which
alone makes it; like the slot's methods, its own never ``await`` between reading a fact
and acting on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from protocol import Ready
from router.http.errors import (
    Conflict,
    ModelFailed,
    ModelLoadFailed,
    ModelUnloading,
    ServerShuttingDown,
    Unavailable,
    redact_paths,
)
from router.workers.backoff import Failure
from router.workers.lifecycle import LOADED, WorkerState
from router.workers.process import LoadFailed, WorkerProcess

if TYPE_CHECKING:
    from router.workers.slot import ModelSlot

log = logging.getLogger("modelyard.pool")

#: A load still going after this many seconds says so (log line and event), and again after each as many.
LOAD_PROGRESS_INTERVAL_S = 5.0


class _Progress:
    """One load's steps, told as log lines and ``loading`` events of the model (``emit``)."""

    def __init__(self, slot: ModelSlot) -> None:
        self._slot = slot
        self.t0 = time.monotonic()
        self.stage = "spawning"

    def __call__(self, what: str, fields: dict[str, Any]) -> None:
        name = self._slot.model.name
        if "total" in fields:  # the worker's own steps (LoadProgress)
            step = f"{what} {fields['done']}/{fields['total']}"
            if what != self.stage.split(" ")[0] or fields["done"] == fields["total"]:
                log.info("model %s: %s (%.1f s)", name, step.replace("_", " "), time.monotonic() - self.t0)
            self.stage = step
        else:
            self.stage = what
        if what == "connected":
            log.info("model %s: worker connected; reading the GGUF and preparing its weights", name)
        self._slot.emit("loading", stage=what, **fields)

    async def tick(self) -> None:
        """A slow load says so, with the worker's last step."""
        while True:
            await asyncio.sleep(LOAD_PROGRESS_INTERVAL_S)
            elapsed = time.monotonic() - self.t0
            log.info("model %s: still loading (%.0f s, %s)", self._slot.model.name, elapsed,
                     self.stage.replace("_", " "))
            self._slot.emit("loading", stage="still_loading", elapsed_s=round(elapsed, 1), last=self.stage)


class Loader:
    """One model's worker being started, the last load's record, and the restart after a crash."""

    def __init__(self, slot: ModelSlot) -> None:
        self._slot = slot
        self.task: asyncio.Task[None] | None = None  # the load running (or last run)
        self.worker: WorkerProcess | None = None  # the worker being started (None once it is ready)
        self.spawn_count = 0  # workers started (or spares taken) for this model
        self.load_ms: float | None = None  # worker-reported model load time
        self.loaded_at: float | None = None  # unix time
        self.last_ready: Ready | None = None  # the last worker's Ready (its n_ctx, slots), kept while asleep
        self.rss_after_load: int | None = None  # the last worker's RSS right after Ready, bytes
        self._crashed = False  # the last worker died unasked: the next load is a restart
        self._restart_task: asyncio.Task[None] | None = None  # restart for waiting requests after a crash
        self._reload_task: asyncio.Task[float] | None = None  # begin_load during an idle unload

    # ------------------------------------------------------------------ waiting for the worker

    async def ready_worker(self, operator: bool) -> WorkerProcess:
        """The ready worker, starting it and waiting for its load if needed (``ModelSlot.ready_worker``)."""
        slot = self._slot
        slot.check_open()
        slot.check_restart(operator=operator)
        slot.last_active = time.monotonic()
        unloading = slot.unloader.task
        if slot.state is WorkerState.DRAINING and unloading is not None:  # an idle unload
            await asyncio.shield(unloading)
            slot.check_open()
        await slot.placing.wait()
        if slot.state is WorkerState.LOADING and self.task is not None:
            await asyncio.shield(self.task)
            # an unload ended the load (a failed one is FAILED). The ignore: mypy keeps slot.state
            # narrowed to LOADING across the await, during which another task may change it
            if slot.state is WorkerState.UNLOADED:  # type: ignore[comparison-overlap]
                raise ModelUnloading(f"model '{slot.model.name}' was unloaded while loading")
        if slot.state is WorkerState.UNRESPONSIVE:
            raise Unavailable(f"model '{slot.model.name}' worker is unresponsive (no answer for "
                              f"unresponsive_after_s={slot.model.unresponsive_after_s:g} s); retry shortly",
                              code="model_unresponsive")
        if slot.state is not WorkerState.READY or slot.worker is None:
            raise ModelLoadFailed(f"model '{slot.model.name}' is not loaded: "
                                  f"{redact_paths(slot.last_error or str(slot.state))}")
        return slot.worker

    async def load(self) -> float:
        """Admin load (``ModelSlot.load``): start the worker if needed and wait until it is ready."""
        slot = self._slot
        if slot.refusing() and not slot.pool.closing:  # closing: ready_worker says so (503)
            raise Conflict(f"model '{slot.model.name}' is being unloaded", code="model_unloading")
        if slot.state is WorkerState.UNLOADED:
            slot.idle.keep_alive = None  # an operator's load keeps the config's idle_ttl_s until a request says otherwise
        await slot.ready_worker(operator=True)
        return self.load_ms or 0.0

    def begin_load(self, operator: bool) -> bool:
        """Start loading without waiting (``ModelSlot.begin_load``). True if it starts (or will)."""
        slot = self._slot
        if slot.pool.closing:
            raise ServerShuttingDown()
        if slot.refusing():
            raise Conflict(f"model '{slot.model.name}' is being unloaded", code="model_unloading")
        slot.check_restart(operator=operator)
        slot.last_active = time.monotonic()
        if slot.state in (WorkerState.UNLOADED, WorkerState.FAILED):
            if slot.placing.asked:
                return False  # already asked for: loading as soon as there is room
            slot.placing.ask(sticky=True)
            return True
        if slot.state is WorkerState.DRAINING:  # an idle unload: load again once it is done
            task = asyncio.create_task(self.load(), name=f"reload-{slot.model.name}")
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # failures show in the state
            self._reload_task = task
            return True
        return False

    # ------------------------------------------------------------------ the load

    def begin(self) -> None:
        """Placement granted the place: the state moves to ``loading`` now and the worker starts."""
        slot = self._slot
        slot.asleep = False
        if self._crashed:
            self._crashed = False
            slot.metrics.restarts.labels(slot.model.name).inc()
        slot.metrics.loads.labels(slot.model.name).inc()
        slot.move(WorkerState.LOADING)
        # in the same step as the placement decision: a warm spare it counted on is taken now
        wp = slot.pool.new_worker(slot.model)
        self.worker = wp
        self.spawn_count += 1
        wp.on_exit(self._on_worker_exit)
        self.task = asyncio.create_task(self._load(wp), name=f"load-{slot.model.name}")

    async def _load(self, wp: WorkerProcess) -> None:
        slot = self._slot
        progress = _Progress(slot)
        tick = asyncio.create_task(progress.tick(), name=f"load-ticker-{slot.model.name}")
        try:
            try:
                ready = await wp.start(slot.model.load_timeout_s, progress)
            except (OSError, ValueError, RuntimeError) as e:  # never leave the slot stuck in loading
                log.exception("starting %s's worker failed", slot.model.name)
                wp.kill("start failed")
                raise LoadFailed(f"cannot start the worker: {type(e).__name__}: {e}") from None
        except LoadFailed as e:
            self._failed(wp, e)
            await wp.stop(0)
            slot.pool.place()  # its place is free
            return
        except asyncio.CancelledError:
            wp.kill("load cancelled")
            raise
        finally:
            tick.cancel()
        if self.worker is not wp or slot.state is not WorkerState.LOADING:
            await wp.stop(slot.model.shutdown_grace_s)  # unloaded while loading
            slot.pool.place()
            return
        self._ready(wp, ready, progress.t0)

    def abandon(self) -> WorkerProcess | None:
        """An unload ends the load: the worker being started (the caller stops it) is no longer
        this model's; the load's task then stops it too and changes nothing."""
        wp, self.worker = self.worker, None
        return wp

    def _failed(self, wp: WorkerProcess, e: LoadFailed) -> None:
        """``wp`` did not become ready: the model fails (when it is still the load of a loading model)."""
        slot = self._slot
        if self.worker is not wp:
            return
        self.worker = None
        slot.last_exit_code = e.exit_code
        slot.metrics.load_failures.labels(slot.model.name).inc()
        if slot.state is WorkerState.LOADING:
            self.record_failure("load_failed", f"load failed: {e.reason}", e.exit_code)
            slot.move(WorkerState.FAILED, f"load failed: {e.reason}")
            h = slot.failures
            slot.admission.refuse_waiting(ModelLoadFailed(  # no absolute paths for clients
                f"model '{slot.model.name}' failed to load: {redact_paths(e.reason)}",
                retry_after_s=None if h.given_up else h.retry_after(slot.pool.clock())))

    def _ready(self, wp: WorkerProcess, ready: Ready, t0: float) -> None:
        """``wp`` is ready (and still this loading model's worker): it takes the waiting requests."""
        slot = self._slot
        self.worker = None
        slot.worker = wp
        slot.metrics.load_time.labels(slot.model.name).observe(time.monotonic() - t0)
        self.load_ms = ready.load_ms
        self.last_ready = ready
        self.loaded_at = time.time()
        slot.unloader.unload_reason = None  # it is loaded again: the last unload's reason no longer describes it
        slot.last_exit_code = None
        slot.prefix.clear()  # a new worker's cache: its own events (and requests) fill the index
        wp.on_kv_events = slot.prefix.feed
        slot.move(WorkerState.READY)
        self.rss_after_load = slot.sample_rss(wp)
        slot.emit("loading", stage="ready", load_ms=ready.load_ms, rss_bytes=self.rss_after_load)
        if slot.unloader.pending is not None:  # the config changed while it loaded: reload at once
            slot.unloader.soft_unload("config changed while loading: reloading with the new settings")
            return
        log.info("model %s ready in %.0f ms (worker load_ms %.0f, pid %s, n_ctx %d)", slot.model.name,
                 (time.monotonic() - t0) * 1000, ready.load_ms, wp.pid, ready.n_ctx)
        slot.liveness.watch(wp)
        slot.last_active = time.monotonic()
        slot.idle.watch()
        slot.pool.share_cores()
        slot.pump()
        replicas = slot.pool.replica_set(slot.model.name)
        if replicas is not None:  # requests queued on the others while it loaded (router.workers.replicas)
            replicas.rebalance(slot)
        slot.pool.place()

    # ------------------------------------------------------------------ failures and the restart

    def record_failure(self, kind: str, reason: str, exit_code: int | None) -> None:
        """A crash or a failed load, in the crash history, the model's events and the log."""
        slot = self._slot
        f = Failure(kind, reason, exit_code, time.time())
        h = slot.failures
        h.record(slot.pool.clock(), f)
        slot.emit(kind, reason=reason, exit_code=exit_code, signal=f.signal,
                  restart_in_s=None if h.given_up else round(h.remaining(slot.pool.clock()), 3))
        if h.given_up:
            slot.emit("failed", reason=f"{h.policy.max_crashes} failures within crash_window_s="
                      f"{h.policy.window_s:g} s; until an operator loads it")
            log.error("model %s: %d failures within crash_window_s=%g s; failed until an operator loads it",
                      slot.model.name, h.policy.max_crashes, h.policy.window_s)
        elif (left := h.remaining(slot.pool.clock())) > 0:
            log.warning("model %s: restart allowed in %.1f s (crash backoff, failure %d in the window)",
                        slot.model.name, left, h.in_window(slot.pool.clock()))

    def _on_worker_exit(self, wp: WorkerProcess) -> None:
        """The process of ``wp`` exited (any reason). Runs in the event loop."""
        slot = self._slot
        if wp is not slot.worker:
            return  # a loading worker: start() reports it
        reason = wp.exit_description()
        slot.last_exit_code = wp.exit_code
        # Its requests got WorkerGone in their queues; free their job slots now so a
        # new worker is never blocked by a dead one's bookkeeping.
        slot.admission.forget_worker(wp)
        slot.stop_watchers()
        slot.prefix.clear()
        if slot.state in LOADED:
            slot.worker = None
            slot.liveness.unresponsive_since = None
            self._crashed = True
            slot.metrics.crashes.labels(slot.model.name).inc()
            self.record_failure("crashed", f"worker crashed: {reason}", wp.exit_code)
            slot.move(WorkerState.FAILED, f"worker crashed: {reason}")
            if slot.failures.given_up:
                slot.admission.refuse_waiting(ModelFailed(
                    f"model '{slot.model.name}' worker crashed ({redact_paths(reason)}) and has failed "
                    f"{slot.failures.policy.max_crashes} times within crash_window_s; it stays failed until an "
                    f"operator loads it (POST /admin/models/load)"))
            else:
                replicas = slot.pool.replica_set(slot.model.name)
                if replicas is not None:  # those waiting move to a ready replica (router.workers.replicas)
                    replicas.rehome(slot)
            if not slot.failures.given_up and (slot.queue_depth > 0 or slot.model.replicas > 1):
                # placed again after the backoff: for those waiting, and a lost replica anyway
                self._restart_task = asyncio.create_task(self._restart_for_waiting(),
                                                         name=f"restart-{slot.model.name}")
            slot.pool.place()  # its place is free
        else:
            slot.changed.set()  # draining: the unload task finishes the job
        slot.pool.share_cores()

    async def _restart_for_waiting(self) -> None:
        """After a crash: wait out the crash backoff, then load again for the requests
        still waiting (they were admitted before the crash and keep their place)."""
        slot = self._slot
        left = slot.failures.remaining(slot.pool.clock())
        if left > 0:
            log.info("model %s: %d waiting request(s) run on the restarted worker in %.1f s (crash backoff)",
                     slot.model.name, slot.queue_depth, left)
            await asyncio.sleep(left)
        self._restart_task = None
        if slot.state is WorkerState.FAILED and not slot.pool.closing:
            if slot.queue_depth > 0:
                slot.placing.ask()
            elif slot.model.replicas > 1:  # a replica is placed again whether or not anyone waits for it
                slot.placing.ask(sticky=True)

    def forget_crash(self) -> None:
        """The failed model is unloaded: its next load is not a restart, and no restart waits."""
        self._crashed = False
        if self._restart_task is not None:
            self._restart_task.cancel()
            self._restart_task = None
