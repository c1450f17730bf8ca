"""One configured model's owner: :class:`ModelSlot`, its worker's state machine and the decisions on it.

A slot's methods are the only writers of its state (worker state machine
(``router.workers.lifecycle``), the admission (``router.workers.admission``: waiting
queue, running set), current worker). All run on the event loop and never ``await``
between reading a fact and acting on it, so no decision uses a stale snapshot. Its
parts, each one concept: admission (the bounded queue: 503 + Retry-After at once when
full), liveness (``router.workers.liveness``: ping, unresponsive, hung), the idle unload
(``router.workers.idle``), placement (``router.workers.placing``, the pool's one placer),
the CPU share (``Pool.share_cores``), its views (``router.workers.views``).

Admission: one running request per worker job slot (``Ready.max_jobs``) plus at most
``max_queue`` waiting — requests waiting for the model to load count too: while it
loads, the first in line (the one that will run as soon as it is ready) counts as the
running one, so ``1 + max_queue`` requests are admitted whether the model is loaded or
not. Beyond that :meth:`ModelSlot.admit` raises QueueFull (503) at once, saying so.
Waiting is FIFO. A request's job slot is given back only when the worker has finished
with it (Done/Error, or the worker is gone), never when the client merely left, so the
worker is never handed two generations at once.

Placement: a model that must load asks the pool's placer for room; its requests wait in
its own queue meanwhile, so a burst asks once and loads once.

Crash backoff (``router.workers.backoff``): a failed model starts again only once its
backoff has passed (else 503 ``restart_backoff`` with the remaining wait), and not
at all after ``max_crashes`` within ``crash_window_s`` until an operator loads it.

Liveness: a worker judged ``unresponsive`` gets no new job (requests wait in its queue),
/admin/models, /admin/events and ``/metrics`` say so; any frame makes it ``ready`` again.

Crash with waiting requests: when a ready (or unresponsive) worker dies, its
running requests fail (an SSE error event mid-stream) but the requests that were
only waiting keep their place and run on the restarted worker, started once the
crash backoff allows (they fail only if the model gives up: ``max_crashes``).

Idle unload (``idle_ttl_s`` > 0, like Ollama's keep_alive; never for ``pinned`` models): a
request arriving while an idle unload stops the worker is not refused — it waits and
starts the model again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from protocol import Pong, Ready
from router.config import ModelConfig
from router.http.errors import (
    ApiError,
    Conflict,
    InsufficientMemory,
    MaxLoadedReached,
    ModelFailed,
    ModelLoadFailed,
    ModelUnloading,
    QueueFull,
    ServerShuttingDown,
    Unavailable,
    redact_paths,
)
from router.metrics import Metrics, ModelGauges
from router.workers import views
from router.workers.admission import Admission, Ticket
from router.workers.cpu_share import ThreadShare
from router.workers.backoff import CrashHistory, CrashPolicy, Failure, restart_refusal
from router.workers.idle import IdleTimer
from router.workers.lifecycle import LOADED, Lifecycle, WorkerState
from router.workers.liveness import Liveness
from router.workers.placement import Decision, Estimate, Seat
from router.workers import placement
from router.workers.process import LoadFailed, WorkerProcess

if TYPE_CHECKING:
    from router.workers.pool import Pool

log = logging.getLogger("modelyard.pool")

#: A load still going after this many seconds says so (log line and event), and again after each as many.
LOAD_PROGRESS_INTERVAL_S = 5.0


def _crash_policy(m: ModelConfig) -> CrashPolicy:
    return CrashPolicy(base_s=m.restart_backoff_s, max_s=m.restart_backoff_max_s, max_crashes=m.max_crashes,
                       window_s=m.crash_window_s)


class ModelSlot:
    """One configured model: its worker's state machine, queue and running requests."""

    def __init__(self, model: ModelConfig, pool: Pool) -> None:
        self.model = model
        self._pool = pool
        self._life = Lifecycle(model.name, self._on_state)  # moved only by this slot's methods
        self.worker: WorkerProcess | None = None
        self.last_error: str | None = None
        self.last_exit_code: int | None = None
        self.load_ms: float | None = None  # worker-reported model load time
        self.loaded_at: float | None = None  # unix time
        self.last_used: float | None = None  # unix time a request last finished
        self.unload_reason: str | None = None  # why the worker was last unloaded (admin, idle)
        self.spawn_count = 0
        self.admission = Admission()  # the bounded queue and the running set (moved only by this slot)
        self._load_task: asyncio.Task[None] | None = None
        self._loading_worker: WorkerProcess | None = None
        self._unload_task: asyncio.Task[None] | None = None
        self.idle = IdleTimer(self)  # idle_ttl_s / keep_alive: the idle unload
        self._last_active = time.monotonic()  # last admission / finished request / load (monotonic s)
        self._idle_unloading = False  # the current drain is an idle unload: new requests wait, then reload
        self._changed = asyncio.Event()  # set whenever running/state changes (drain waits on it)
        self._crashed = False  # the last worker died unasked: the next load is a restart
        self._reload_task: asyncio.Task[float] | None = None  # begin_load during an idle unload
        self._placement: asyncio.Future[None] | None = None  # set while waiting for a place (Pool._place)
        self._placement_holders = 0  # ready_worker callers waiting on it (they hold no ticket)
        # requests without a ticket (tokenize, props, ...) waiting for the worker or calling it
        # (ready_worker, use): like a waiting or running request, they keep the model from being
        # idle, so a later request for another model never evicts the one they wait for
        self._users = 0
        # unloaded for idleness (idle_ttl_s): llama-server's "sleeping" (--sleep-idle-seconds); the
        # next generation wakes it (loads it again), read-only routes (/props, /health) do not
        self.asleep = False
        self.last_ready: Ready | None = None  # the last worker's Ready (its n_ctx, slots), kept while asleep
        self._placement_sticky = False  # an operator asked for the load: wanted even with nobody waiting
        self.waiting_for: str | None = None  # why the wanted load has not started (placement)
        self.rss_after_load: int | None = None  # the last worker's RSS right after Ready, bytes
        self.rss_peak: int | None = None  # the largest RSS a ready worker of this model had, bytes
        self.failures = CrashHistory(_crash_policy(model))
        self._pending_model: ModelConfig | None = None  # a reload changed the config: applied once the worker stops
        self.retiring = False  # removed from the config: draining, then forgotten
        self._threads = ThreadShare(model.name)  # the CPU share last sent to the worker (router.workers.cpu_share)
        self._restart_task: asyncio.Task[None] | None = None  # restart for waiting requests after a crash
        self.liveness = Liveness(self)  # the ping loop: the one judge of unresponsive

    @property
    def sse_keepalive_s(self) -> float:
        """How long a stream of this model may be silent before it sends a keep-alive (s)."""
        return self._pool.config.server.sse_keepalive_s

    @property
    def metrics(self) -> Metrics:
        return self._pool.metrics

    @property
    def state(self) -> WorkerState:
        return self._life.state

    # ------------------------------------------------------------------ facts

    @property
    def capacity(self) -> int:
        jobs = self.worker.max_jobs if self.worker is not None else 1
        return jobs + self.model.max_queue

    @property
    def queue_depth(self) -> int:
        return self.admission.queue_depth

    def admitted_split(self) -> tuple[int, int]:
        """(running, waiting) as admission counts them (``router.workers.admission``)."""
        return self.admission.split(self.worker.max_jobs if self.worker is not None else 1)

    @property
    def running_ids(self) -> list[str]:
        return self.admission.running_ids

    @property
    def total_slots(self) -> int:
        """The ready worker's KV slots (``Ready.max_jobs``); 0 when no worker is ready."""
        return self.worker.max_jobs if self.worker is not None and self.worker.ready is not None else 0

    def last_pong(self) -> Pong | None:
        """The current worker's most recent Pong (None before the first, or after it left)."""
        return self.liveness.last_pong()

    @property
    def unresponsive_since(self) -> float | None:
        """Unix time the worker went unresponsive (None: it is not)."""
        return self.liveness.unresponsive_since

    def kv_slots(self) -> list[dict[str, Any]]:
        """One entry per KV slot of the ready worker (``router.workers.views.kv_slots``)."""
        return views.kv_slots(self)

    def gauges(self) -> ModelGauges:
        """This model's figures for ``/metrics``."""
        return views.gauges(self)

    def describe(self) -> dict[str, Any]:
        """The admin view of this model (``router.workers.views.describe``)."""
        return views.describe(self)

    @property
    def loading_worker(self) -> WorkerProcess | None:
        """The worker being started (None once it is ready, or when none is)."""
        return self._loading_worker

    def clock(self) -> float:
        """The pool's monotonic clock (s; tests inject one)."""
        return self._pool.clock()

    # ------------------------------------------------------------------ placement facts

    def expires_at(self) -> float | None:
        """Unix time the idle unload is due (``router.workers.idle``); None: not idle or no TTL."""
        return self.idle.expires_at(self._last_active)

    def idle_ttl(self) -> float | None:
        """The idle time-to-live in force, s (``router.workers.idle.IdleTimer.ttl``)."""
        return self.idle.ttl()

    @property
    def last_active(self) -> float:
        """The last admission, finished request or load (monotonic s)."""
        return self._last_active

    def set_keep_alive(self, seconds: float | None) -> None:
        """A generation request's keep_alive (s; inf: until unloaded; None: it set none, the
        config's ``idle_ttl_s`` again) decides the idle TTL from now on, as Ollama's each request
        does; 0 unloads the model once it has nothing running or waiting."""
        self.idle.set_keep_alive(seconds)

    def estimate(self) -> Estimate:
        """What this model will take once loaded (router.workers.placement.estimate)."""
        return placement.estimate(self.model.path, self.model.kv_budget_mib, self.rss_peak,
                                  weights=self.model.weights_mode)

    def sample_rss(self, wp: WorkerProcess | None) -> int | None:
        """``wp``'s RSS now (its launcher's figure for its pid, or the injected probe); a ready worker's
        raises :attr:`rss_peak`."""
        if wp is None:
            return None
        rss = self._pool.memory.rss(wp.pid, self.model.name)
        if rss and wp is self.worker and self.state is WorkerState.READY:
            self.rss_peak = max(self.rss_peak or 0, rss)
        return rss

    def seat(self) -> Seat | None:
        """This model as placement sees it now, when it holds a worker (else None)."""
        if self.state not in (WorkerState.LOADING, *LOADED, WorkerState.DRAINING):
            return None
        return Seat(name=self.model.name, state=self.state.value,
                    idle=(self.state is WorkerState.READY and not self.busy and self.queue_depth == 0
                          and self._users == 0),
                    pinned=self.model.pinned, last_active=self._last_active,
                    rss=self.sample_rss(self.worker or self._loading_worker) or 0,
                    estimate=self.estimate().total)

    def wants_place(self) -> bool:
        """A load is wanted and someone still waits for it."""
        return (self._placement is not None and self.state in (WorkerState.UNLOADED, WorkerState.FAILED)
                and (self.queue_depth > 0 or self._placement_holders > 0 or self._placement_sticky))

    def condition(self) -> str:
        """The state with its history, for operators (``router.workers.views.condition``)."""
        return views.condition(self)

    # ------------------------------------------------------------------ state machine

    def _set_state(self, new: WorkerState, error: str | None = None) -> None:
        self._life.move(new, error)

    def _on_state(self, old: WorkerState, new: WorkerState, note: str | None) -> None:
        if note is not None:
            self.last_error = note
        self._changed.set()
        self._emit("state", **{"from": old.value, "to": new.value, "reason": note, "condition": self.condition()})

    def _emit(self, event: str, **fields: Any) -> None:
        self._pool.events.emit(self.model.name, event, **fields)

    # ------------------------------------------------------------------ admission

    def admit(self, ticket: Ticket) -> None:
        """``ticket`` takes a place in this model's queue, starting its worker if needed.

        Raises ModelUnloading (503) while draining, QueueFull (503) when
        ``1 + max_queue`` requests are already admitted (loading or not: see
        :meth:`admitted_split`). During an idle unload the request is admitted and
        waits for the model to load again.
        """
        self._check_open()
        self._check_restart(operator=False)
        running, waiting = self.admitted_split()
        if running + waiting >= self.capacity:
            jobs = self.capacity - self.model.max_queue
            loading = " (to start once the model has loaded)" if self.state is WorkerState.LOADING else ""
            raise QueueFull(
                f"model '{self.model.name}' is busy: {running} running{loading} and {waiting} waiting "
                f"(at most {jobs} running + max_queue={self.model.max_queue} waiting); retry shortly")
        self.admission.enqueue(ticket)
        self._last_active = time.monotonic()
        if self.state in (WorkerState.UNLOADED, WorkerState.FAILED):
            self._want_load()
        self._pump()

    async def wait_turn(self, ticket: Ticket) -> WorkerProcess:
        """The worker this ticket runs on, once it is its turn. Raises ApiError
        (load failed, crashed, unloading) if it will never be."""
        return await ticket.granted

    def withdraw(self, ticket: Ticket) -> None:
        """A waiting request leaves (its client went away). No-op once running."""
        self.admission.withdraw(ticket)
        self._changed.set()
        self._pool.place()  # a wanted load may have nobody left to wait for it

    def release(self, ticket: Ticket) -> None:
        """The worker is done with this ticket's request (Done/Error/gone)."""
        if self.admission.release(ticket):
            self.last_used = time.time()
            self._last_active = time.monotonic()
            self.idle.wake()
            if not self.busy:
                self._pool.share_cores()
        self._changed.set()
        self._pump()
        self._pool.place()  # this model may have become idle: evictable for a waiting one

    def _pump(self) -> None:
        """Hand free job slots of a ready worker to waiting tickets, FIFO."""
        was_busy = self.busy
        if self.state is WorkerState.READY and self.worker is not None:
            self.admission.grant_free(self.worker, self.worker.max_jobs)
        if self.busy != was_busy:
            self._pool.share_cores()

    @property
    def busy(self) -> bool:
        """A worker of this model is generating (it holds a running request)."""
        return self.admission.busy

    def set_threads(self, n: int) -> None:
        """The pool's decision: the ready worker uses ``n`` BLAS threads (sent once per change;
        only for models without ``n_threads``)."""
        wp = self.worker
        if wp is None or self.state is not WorkerState.READY or self.model.n_threads is not None:
            return
        self._threads.send(wp, n)

    @property
    def blas_threads(self) -> int | None:
        """The BLAS threads its worker uses: ``n_threads``, else the share last sent (None: the worker's own)."""
        if self.model.n_threads is not None:
            return self.model.n_threads
        return self._threads.of(self.worker)

    def _refusing(self) -> bool:
        """New requests get 503: an operator unload is draining, the model was removed, or the router stops."""
        return ((self.state is WorkerState.DRAINING and not self._idle_unloading) or self.retiring
                or self._pool.closing)

    def _check_open(self) -> None:
        """Raises ServerShuttingDown (router stopping) or ModelUnloading (operator unload draining)."""
        if self._pool.closing:
            raise ServerShuttingDown()
        if self._refusing():
            raise ModelUnloading(f"model '{self.model.name}' is being unloaded; retry shortly")

    def _check_restart(self, *, operator: bool) -> None:
        """May a failed model start again now? An operator's load always may (and clears
        the crash window); otherwise raises ModelFailed (given up after max_crashes) or
        RestartBackoff (503, Retry-After: the remaining wait)."""
        if self.state is not WorkerState.FAILED:
            return
        if operator:
            self.failures.operator_reset()
            return
        refusal = restart_refusal(self.failures, self.model.name, self._pool.clock())
        if refusal is not None:
            raise refusal

    def _record_failure(self, kind: str, reason: str, exit_code: int | None) -> None:
        f = Failure(kind, reason, exit_code, time.time())
        self.failures.record(self._pool.clock(), f)
        h = self.failures
        self._emit(kind, reason=reason, exit_code=exit_code, signal=f.signal,
                   restart_in_s=None if h.given_up else round(h.remaining(self._pool.clock()), 3))
        if h.given_up:
            self._emit("failed", reason=f"{h.policy.max_crashes} failures within crash_window_s="
                       f"{h.policy.window_s:g} s; until an operator loads it")
        if h.given_up:
            log.error("model %s: %d failures within crash_window_s=%g s; failed until an operator loads it",
                      self.model.name, h.policy.max_crashes, h.policy.window_s)
        elif (left := h.remaining(self._pool.clock())) > 0:
            log.warning("model %s: restart allowed in %.1f s (crash backoff, failure %d in the window)",
                        self.model.name, left, h.in_window(self._pool.clock()))

    def _failure_retry_after(self) -> int | None:
        """Retry-After for requests refused by the failure just recorded."""
        h = self.failures
        if h.given_up:
            return None
        return h.retry_after(self._pool.clock())

    def refuse_waiting(self, err: ApiError) -> None:
        """Every waiting request fails with ``err`` now (the router is shutting down)."""
        self._drop_placement(err)
        self._fail_waiting(err)

    def abort_running(self, reason: str) -> int:
        """End every running generation now: each fails with ServerShuttingDown(``reason``)
        and its worker gets Cancel (by the run's own close). Returns how many."""
        n = 0
        for ticket in self.admission.running():
            if ticket.worker is not None:
                ticket.worker.abort_stream(ticket.id, reason)
                n += 1
        return n

    def _fail_waiting(self, err: ApiError) -> None:
        self.admission.refuse_waiting(err)

    # ------------------------------------------------------------------ placement

    def _want_load(self, *, sticky: bool = False) -> None:
        """Ask the pool for a place to load in (it may start the load at once). Once per
        load: a burst of first requests waits on the same placement."""
        if sticky:
            self._placement_sticky = True
        if self.state not in (WorkerState.UNLOADED, WorkerState.FAILED) or self._placement is not None:
            return
        self._placement = asyncio.get_running_loop().create_future()
        self._pool.want(self)

    def placed(self) -> None:
        """The pool's decision: load now."""
        fut, self._placement = self._placement, None
        self._placement_sticky = False
        self.waiting_for = None
        self._begin_load()
        if fut is not None and not fut.done():
            fut.set_result(None)

    def place_later(self, why: str) -> None:
        """The pool's decision: not yet (``why``: what it waits for)."""
        if why != self.waiting_for:
            log.info("model %s: %s", self.model.name, why)
            self._emit("waiting", why=why)
        self.waiting_for = why

    def refuse_place(self, decision: Decision) -> None:
        """The pool's decision: it cannot load (503 to everyone waiting)."""
        log.warning("model %s: %s", self.model.name, decision.why)
        self._emit("refused", code=decision.code, why=decision.why)
        err: ApiError = (InsufficientMemory(decision.why) if decision.code == "insufficient_memory"
                         else MaxLoadedReached(decision.why))
        self.last_error = decision.why
        self._drop_placement(err)
        self._fail_waiting(err)

    def cancel_placement(self) -> None:
        """The pool's decision: the wanted load is not needed any more (nobody waits)."""
        self._drop_placement(None)

    def _drop_placement(self, err: ApiError | None) -> None:
        """No load is wanted any more (refused, unloaded, shutdown or nobody waits)."""
        fut, self._placement = self._placement, None
        self._placement_sticky = False
        self.waiting_for = None
        self._pool.unwant(self)
        if fut is not None and not fut.done():
            if err is None:
                fut.cancel()
            else:
                fut.set_exception(err)
                fut.exception()  # retrieved: no one may be awaiting it

    def evict(self, for_model: str) -> None:
        """The pool's decision: this idle model makes room for ``for_model`` (drain-then-stop;
        a request that arrives meanwhile waits and loads it again)."""
        assert self.state is WorkerState.READY and not self.model.pinned
        self.metrics.evictions.labels(self.model.name).inc()
        self._emit("evicted", **{"for": for_model})
        self._soft_unload(f"evicted to make room for '{for_model}'")

    # ------------------------------------------------------------------ config reload

    def reconfigure(self, model: ModelConfig) -> None:
        """A reload changed this model's config: it applies at once when no worker runs;
        otherwise the worker drains (running requests finish, new ones wait) and the
        next load uses the new config."""
        self._pending_model = model
        if self.state in (WorkerState.UNLOADED, WorkerState.FAILED):
            self._apply_pending()
        elif self.state is WorkerState.READY:
            self._soft_unload("config changed: reloading with the new settings")
        # loading: once ready it drains at once (see _load); draining: applied when stopped

    def _apply_pending(self) -> None:
        if self._pending_model is None:
            return
        self.model, self._pending_model = self._pending_model, None
        self.failures.policy = _crash_policy(self.model)
        log.info("model %s: new config applied", self.model.name)
        self._emit("reconfigured")

    def _soft_unload(self, reason: str) -> None:
        """Drain and stop, with new requests waiting to load it again (idle unload, eviction, reload)."""
        self._idle_unloading = True
        self._unload_task = self._start_unload(drain=True, reason=reason)

    def retire(self) -> asyncio.Task[None]:
        """A reload removed this model: drain (its running requests finish; waiting ones get
        503) and stop. The pool forgets the slot once the returned task is done."""
        self.retiring = True
        self._pending_model = None
        return self.begin_unload(drain=True, reason="removed from the config")

    # ------------------------------------------------------------------ loading

    @property
    def sleeping(self) -> bool:
        """Unloaded for idleness and not woken since (llama-server's ``is_sleeping``)."""
        return self.asleep and self.state is WorkerState.UNLOADED

    def _begin_load(self) -> None:
        self.asleep = False
        if self._crashed:
            self._crashed = False
            self.metrics.restarts.labels(self.model.name).inc()
        self.metrics.loads.labels(self.model.name).inc()
        self._set_state(WorkerState.LOADING)
        # in the same step as the placement decision: a warm spare it counted on is taken now
        wp = self._pool.new_worker(self.model)
        self._loading_worker = wp
        self.spawn_count += 1
        wp.on_exit(self._on_worker_exit)
        self._load_task = asyncio.create_task(self._load(wp), name=f"load-{self.model.name}")

    async def _load(self, wp: WorkerProcess) -> None:
        t0 = time.monotonic()
        stage = ["spawning"]

        def progress(what: str, fields: dict[str, Any]) -> None:
            if "total" in fields:  # the worker's own steps (LoadProgress)
                step = f"{what} {fields['done']}/{fields['total']}"
                if what != stage[0].split(" ")[0] or fields["done"] == fields["total"]:
                    log.info("model %s: %s (%.1f s)", self.model.name, step.replace("_", " "), time.monotonic() - t0)
                stage[0] = step
            else:
                stage[0] = what
            if what == "connected":
                log.info("model %s: worker connected; reading the GGUF and preparing its weights", self.model.name)
            self._emit("loading", stage=what, **fields)

        async def ticker() -> None:  # a slow load says so, with the worker's last step
            while True:
                await asyncio.sleep(LOAD_PROGRESS_INTERVAL_S)
                elapsed = time.monotonic() - t0
                log.info("model %s: still loading (%.0f s, %s)", self.model.name, elapsed, stage[0].replace("_", " "))
                self._emit("loading", stage="still_loading", elapsed_s=round(elapsed, 1), last=stage[0])

        tick = asyncio.create_task(ticker(), name=f"load-ticker-{self.model.name}")
        try:
            try:
                ready = await wp.start(self.model.load_timeout_s, progress)
            except (OSError, ValueError, RuntimeError) as e:  # never leave the slot stuck in loading
                log.exception("starting %s's worker failed", self.model.name)
                wp.kill("start failed")
                raise LoadFailed(f"cannot start the worker: {type(e).__name__}: {e}") from None
        except LoadFailed as e:
            if self._loading_worker is wp:
                self._loading_worker = None
                self.last_exit_code = e.exit_code
                self.metrics.load_failures.labels(self.model.name).inc()
                if self.state is WorkerState.LOADING:
                    self._record_failure("load_failed", f"load failed: {e.reason}", e.exit_code)
                    self._set_state(WorkerState.FAILED, f"load failed: {e.reason}")
                    self._fail_waiting(ModelLoadFailed(  # no absolute paths for clients
                        f"model '{self.model.name}' failed to load: {redact_paths(e.reason)}",
                        retry_after_s=self._failure_retry_after()))
            await wp.stop(0)
            self._pool.place()  # its place is free
            return
        except asyncio.CancelledError:
            wp.kill("load cancelled")
            raise
        finally:
            tick.cancel()
        if self._loading_worker is not wp or self.state is not WorkerState.LOADING:
            await wp.stop(self.model.shutdown_grace_s)  # unloaded while loading
            self._pool.place()
            return
        self._loading_worker = None
        self.worker = wp
        self.metrics.load_time.labels(self.model.name).observe(time.monotonic() - t0)
        self.load_ms = ready.load_ms
        self.last_ready = ready
        self.loaded_at = time.time()
        self.unload_reason = None  # it is loaded again: the last unload's reason no longer describes it
        self.last_exit_code = None
        self._set_state(WorkerState.READY)
        self.rss_after_load = self.sample_rss(wp)
        self._emit("loading", stage="ready", load_ms=ready.load_ms, rss_bytes=self.rss_after_load)
        if self._pending_model is not None:  # the config changed while it loaded: reload at once
            self._soft_unload("config changed while loading: reloading with the new settings")
            return
        log.info("model %s ready in %.0f ms (worker load_ms %.0f, pid %s, n_ctx %d)", self.model.name,
                 (time.monotonic() - t0) * 1000, ready.load_ms, wp.pid, ready.n_ctx)
        self.liveness.watch(wp)
        self._last_active = time.monotonic()
        self.idle.watch()
        self._pool.share_cores()
        self._pump()
        self._pool.place()

    def went_silent(self, wp: WorkerProcess, silent: float) -> None:
        """The liveness judge's verdict: the ready ``wp`` sent nothing it owed for ``silent`` s."""
        log.warning("model %s: worker %s sent nothing for %.1f s (unresponsive_after_s=%g); "
                    "no new requests go to it; killed if no Pong within ping_timeout_s=%g s",
                    self.model.name, wp.pid, silent, self.model.unresponsive_after_s, self.model.ping_timeout_s)
        self._set_state(WorkerState.UNRESPONSIVE, f"worker sent nothing for {silent:.1f} s")
        self._emit("unresponsive", pid=wp.pid, silent_s=round(silent, 3))

    def answers_again(self, wp: WorkerProcess, after: float) -> None:
        """The liveness judge's verdict: the unresponsive ``wp`` answers again (after ``after`` s)."""
        log.warning("model %s: worker %s answers again after %.1f s unresponsive", self.model.name, wp.pid, after)
        self._set_state(WorkerState.READY)
        self._emit("responsive", pid=wp.pid)
        self._pump()

    async def probe(self, timeout_s: float = 2.0) -> Pong | None:
        """Ping the ready worker now (``router.workers.liveness.Liveness.probe``)."""
        return await self.liveness.probe(timeout_s)

    def idle_unload(self, reason: str) -> None:
        """The idle timer's decision, applied in the same step: drain and stop; a request
        arriving meanwhile waits and loads the model again."""
        self._idle_unloading = True
        self.asleep = True
        self._unload_task = self._start_unload(drain=True, reason=reason)

    def _cancel_watchers(self) -> None:
        self.liveness.stop()
        self.idle.stop()

    def _on_worker_exit(self, wp: WorkerProcess) -> None:
        """The process of ``wp`` exited (any reason). Runs in the event loop."""
        if wp is not self.worker:
            return  # a loading worker: start() reports it
        reason = wp.exit_description()
        self.last_exit_code = wp.exit_code
        # Its requests got WorkerGone in their queues; free their job slots now so a
        # new worker is never blocked by a dead one's bookkeeping.
        self.admission.forget_worker(wp)
        self._cancel_watchers()
        if self.state in LOADED:
            self.worker = None
            self.liveness.unresponsive_since = None
            self._crashed = True
            self.metrics.crashes.labels(self.model.name).inc()
            self._record_failure("crashed", f"worker crashed: {reason}", wp.exit_code)
            self._set_state(WorkerState.FAILED, f"worker crashed: {reason}")
            if self.failures.given_up:
                self._fail_waiting(ModelFailed(
                    f"model '{self.model.name}' worker crashed ({redact_paths(reason)}) and has failed "
                    f"{self.failures.policy.max_crashes} times within crash_window_s; it stays failed until an "
                    f"operator loads it (POST /admin/models/load)"))
            elif self.queue_depth > 0:  # those only waiting run on the restarted worker
                self._restart_task = asyncio.create_task(self._restart_for_waiting(),
                                                         name=f"restart-{self.model.name}")
            self._pool.place()  # its place is free
        else:
            self._changed.set()  # draining: the unload task finishes the job
        self._pool.share_cores()

    async def _restart_for_waiting(self) -> None:
        """After a crash: wait out the crash backoff, then load again for the requests
        still waiting (they were admitted before the crash and keep their place)."""
        left = self.failures.remaining(self._pool.clock())
        if left > 0:
            log.info("model %s: %d waiting request(s) run on the restarted worker in %.1f s (crash backoff)",
                     self.model.name, self.queue_depth, left)
            await asyncio.sleep(left)
        self._restart_task = None
        if self.state is WorkerState.FAILED and self.queue_depth > 0 and not self._pool.closing:
            self._want_load()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Within the block the model is not idle: a one-shot call to its worker (tokenize,
        apply-template, ...; it gets the worker with :meth:`ready_worker` inside) is not cut
        off by an eviction for another model while it waits for the load or for its answer."""
        self._users += 1
        try:
            yield
        finally:
            self._user_left()

    def _user_left(self) -> None:
        self._users -= 1
        if self._users == 0:
            self._pool.place()  # this model may have become idle: evictable for a waiting one

    async def ready_worker(self, *, operator: bool = False) -> WorkerProcess:
        """The ready worker, starting it and waiting for its load if needed (for
        requests that do not take a job slot: tokenize, detokenize, apply-template,
        admin load with ``operator``). While it waits the model is not idle (placement never
        evicts it for a later request: FIFO, as llama-server's router). Raises ModelUnloading
        (draining, or unloaded while the load it waited for ran), ModelLoadFailed,
        RestartBackoff / ModelFailed (crash backoff; never for an operator)."""
        self._users += 1
        try:
            return await self._ready_worker(operator)
        finally:
            self._user_left()

    async def _ready_worker(self, operator: bool) -> WorkerProcess:
        self._check_open()
        self._check_restart(operator=operator)
        self._last_active = time.monotonic()
        if self.state is WorkerState.DRAINING and self._unload_task is not None:  # an idle unload
            await asyncio.shield(self._unload_task)
            self._check_open()
        self._placement_holders += 1  # before asking: the placement sees someone waits
        try:
            if self.state in (WorkerState.UNLOADED, WorkerState.FAILED):
                self._want_load()
            if self._placement is not None:  # waiting for room (max_loaded, memory)
                await asyncio.shield(self._placement)
        finally:
            self._placement_holders -= 1
            if self._placement is not None:
                self._pool.place()  # the last one to leave may leave nobody wanting it
        if self.state is WorkerState.LOADING and self._load_task is not None:
            await asyncio.shield(self._load_task)
            # an unload ended the load (a failed one is FAILED). The ignore: mypy keeps self.state
            # narrowed to LOADING across the await, during which another task may change it
            if self.state is WorkerState.UNLOADED:  # type: ignore[comparison-overlap]
                raise ModelUnloading(f"model '{self.model.name}' was unloaded while loading")
        if self.state is WorkerState.UNRESPONSIVE:
            raise Unavailable(f"model '{self.model.name}' worker is unresponsive (no answer for "
                              f"unresponsive_after_s={self.model.unresponsive_after_s:g} s); retry shortly",
                              code="model_unresponsive")
        if self.state is not WorkerState.READY or self.worker is None:
            raise ModelLoadFailed(f"model '{self.model.name}' is not loaded: "
                                  f"{redact_paths(self.last_error or str(self.state))}")
        return self.worker

    async def load(self) -> float:
        """Admin load: start the worker if needed and wait until it is ready.
        Returns the worker's load time, ms. Raises ModelLoadFailed, Conflict (draining)."""
        if self._refusing() and not self._pool.closing:  # closing: ready_worker says so (503)
            raise Conflict(f"model '{self.model.name}' is being unloaded", code="model_unloading")
        if self.state is WorkerState.UNLOADED:
            self.idle.keep_alive = None  # an operator's load keeps the config's idle_ttl_s until a request says otherwise
        await self.ready_worker(operator=True)
        return self.load_ms or 0.0

    # ------------------------------------------------------------------ unloading

    async def unload(self, *, drain: bool = True, reason: str = "unloaded by request") -> None:
        """Stop this model's worker. With ``drain`` the running requests finish first
        (up to drain_timeout_s, then they are cancelled); waiting ones get 503 at once.
        Concurrent calls share one unload; one asked during an idle unload turns it
        into an operator unload (its waiting requests get 503). Ends in ``unloaded``."""
        await asyncio.shield(self.begin_unload(drain=drain, reason=reason))

    def begin_unload(self, *, drain: bool = True, reason: str = "unloaded by request") -> asyncio.Task[None]:
        """The synchronous start of :meth:`unload` (the state changes now); returns the
        task that finishes it, which runs whether or not anyone awaits it."""
        if self._idle_unloading and self.state is WorkerState.DRAINING:
            self._idle_unloading = False
            self.unload_reason = reason
            self._fail_waiting(ModelUnloading(f"model '{self.model.name}' is being unloaded"))
        if self._unload_task is None or self._unload_task.done():
            self._unload_task = self._start_unload(drain, reason)
        return self._unload_task

    def begin_load(self, *, operator: bool = True) -> bool:
        """Start loading without waiting (llama.cpp's ``POST /models/load``; ``operator``
        False for ``/health?model=``'s autoload, which respects the crash backoff).
        Returns False when the model is already loading or loaded. Raises Conflict while
        an operator unload drains, ServerShuttingDown when the router stops,
        RestartBackoff / ModelFailed (not an operator). During an idle unload the load
        starts once the worker has stopped."""
        if self._pool.closing:
            raise ServerShuttingDown()
        if self._refusing():
            raise Conflict(f"model '{self.model.name}' is being unloaded", code="model_unloading")
        self._check_restart(operator=operator)
        self._last_active = time.monotonic()
        if self.state in (WorkerState.UNLOADED, WorkerState.FAILED):
            if self._placement is not None:
                return False  # already asked for: loading as soon as there is room
            self._want_load(sticky=True)
            return True
        if self.state is WorkerState.DRAINING:  # an idle unload: load again once it is done
            task = asyncio.create_task(self.load(), name=f"reload-{self.model.name}")
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # failures show in the state
            self._reload_task = task
            return True
        return False

    def _start_unload(self, drain: bool, reason: str) -> asyncio.Task[None]:
        """The synchronous half of an unload: the state changes now (so no request is
        admitted between the decision and the change); returns the task that stops the worker."""

        async def nothing() -> None:
            return None

        if self.state is WorkerState.UNLOADED:
            if self._placement is not None:  # waiting for room: not any more
                self._drop_placement(ModelUnloading(f"model '{self.model.name}' was unloaded"))
                self._fail_waiting(ModelUnloading(f"model '{self.model.name}' was unloaded"))
            return asyncio.create_task(nothing())
        self.unload_reason = reason
        if self.state is WorkerState.FAILED:
            self._crashed = False
            if self._placement is not None:
                self._drop_placement(ModelUnloading(f"model '{self.model.name}' was unloaded"))
            if self._restart_task is not None:
                self._restart_task.cancel()
                self._restart_task = None
            self._fail_waiting(ModelUnloading(f"model '{self.model.name}' was unloaded"))
            self._set_state(WorkerState.UNLOADED)
            return asyncio.create_task(nothing())
        if self.state is WorkerState.LOADING:
            wp = self._loading_worker
            self._loading_worker = None
            self._set_state(WorkerState.UNLOADED)
            self._fail_waiting(ModelUnloading(f"model '{self.model.name}' was unloaded while loading"))
            return asyncio.create_task(wp.stop(self.model.shutdown_grace_s) if wp is not None else nothing(),
                                       name=f"unload-{self.model.name}")
        assert self.state in LOADED and self.worker is not None
        wp = self.worker
        if self.state is WorkerState.UNRESPONSIVE:
            drain = False  # a silent worker cannot finish its requests: stop it now
        self.liveness.unresponsive_since = None
        self._set_state(WorkerState.DRAINING)
        if not self._idle_unloading:
            self._fail_waiting(ModelUnloading(f"model '{self.model.name}' is being unloaded"))
        log.info("model %s: unloading (%s)", self.model.name, reason)
        self._emit("unloading", reason=reason)
        return asyncio.create_task(self._drain_and_stop(wp, drain), name=f"unload-{self.model.name}")

    async def _drain_and_stop(self, wp: WorkerProcess, drain: bool) -> None:
        deadline = time.monotonic() + (self.model.drain_timeout_s if drain else 0.0)
        while self.busy and wp.alive:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                break
        for tid in self.admission.running_ids:
            wp.cancel(tid)
        if drain and self.busy and wp.alive:  # drain_timeout_s: their Done(cancelled) reaches the clients
            deadline = time.monotonic() + self.model.cancel_timeout_s
            while self.busy and wp.alive and (left := deadline - time.monotonic()) > 0:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    break
        await wp.stop(self.model.shutdown_grace_s)
        self.admission.forget_running()
        self._cancel_watchers()
        self.worker = None
        self.last_exit_code = wp.exit_code
        self._set_state(WorkerState.UNLOADED, wp.kill_reason)
        reload = self._idle_unloading and not self._pool.closing and not self.retiring
        self._idle_unloading = False
        self._apply_pending()
        if reload and self.queue_depth > 0:  # requests that arrived during an idle unload / eviction start it again
            self._want_load()
        self._pool.place()  # its place is free
