"""What one model's slot looks like from outside: /admin/models, /metrics' gauges, /slots.

Read-only views of a :class:`~router.workers.slot.ModelSlot`, made when asked (no state of
their own): :class:`SlotFacts`, the slot's base, answers with what its parts hold; the
functions here make the views (the slot's methods of the same names return them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from protocol import Pong, Ready
from router.metrics import Metrics, ModelGauges
from router.workers import placement
from router.workers.lifecycle import LOADED, Lifecycle, WorkerState

#: Every state a model's worker can be in (``/metrics``' ``modelyard_model_state`` label set).
STATES = tuple(s.value for s in WorkerState)

if TYPE_CHECKING:
    from router.config import ModelConfig
    from router.workers.admission import Admission
    from router.workers.backoff import CrashHistory
    from router.workers.cpu_share import ThreadShare
    from router.workers.idle import IdleTimer
    from router.workers.liveness import Liveness
    from router.workers.loading import Loader
    from router.workers.placing import SlotPlacing
    from router.workers.pool import Pool
    from router.workers.prefix_index import PrefixIndex
    from router.workers.process import WorkerProcess
    from router.workers.replicas import ReplicaSet
    from router.workers.unloading import Unloader


class SlotFacts:
    """A model's slot as its readers see it: the facts its parts hold, read-only. The base of
    ``router.workers.slot.ModelSlot``, which makes the parts declared here."""

    model: ModelConfig
    pool: Pool
    worker: WorkerProcess | None  # the ready (or unresponsive, draining) worker
    admission: Admission  # the bounded queue and the running set
    idle: IdleTimer  # idle_ttl_s / keep_alive: the idle unload
    liveness: Liveness  # the ping loop: the one judge of unresponsive
    loader: Loader  # loading, and starting again after a crash
    unloader: Unloader  # draining and stopping, config reload
    placing: SlotPlacing  # this model's side of placement: its place asked for, granted, refused
    failures: CrashHistory  # the crash backoff
    last_active: float  # the last admission, finished request or load (monotonic s)
    users: int  # requests without a ticket waiting for the worker or calling it (holding, ready_worker)
    asleep: bool  # unloaded for idleness and not woken since
    rss_peak: int | None  # the largest RSS a ready worker of this model had, bytes
    last_used: float | None  # unix time a request last finished
    last_error: str | None
    last_exit_code: int | None
    replica: int  # its number among the model's replicas (0: the first, the pool's slot of the model)
    prefix: PrefixIndex  # what its worker's KV cache holds (the cache-aware routing's index)
    _life: Lifecycle
    _threads: ThreadShare  # the CPU share last sent to the worker

    @property
    def key(self) -> str:
        """Its name among every slot of the pool: the model's name, ``NAME#N`` for replica N > 0."""
        return self.model.name if self.replica == 0 else f"{self.model.name}#{self.replica}"

    def replica_set(self) -> ReplicaSet | None:
        """Its model's replicas when it has several and this is the first (the model's slot); else None."""
        rs = self.pool.replica_set(self.model.name) if self.replica == 0 else None
        return rs if rs is not None and rs.slots[0] is self else None

    @property
    def state(self) -> WorkerState:
        return self._life.state

    @property
    def metrics(self) -> Metrics:
        return self.pool.metrics

    @property
    def sse_keepalive_s(self) -> float:
        """How long a stream of this model may be silent before it sends a keep-alive (s)."""
        return self.pool.config.server.sse_keepalive_s

    def clock(self) -> float:
        """The pool's monotonic clock (s; tests inject one)."""
        return self.pool.clock()

    # ------------------------------------------------------------------ admission

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
    def busy(self) -> bool:
        """A worker of this model is generating (it holds a running request)."""
        return self.admission.busy

    @property
    def ready_info(self) -> Ready | None:
        """What the current worker said when it became ready (n_ctx, KV budget, template, ...), or
        None while no worker is ready: the one way the layers above read the worker's Ready."""
        return self.worker.ready if self.worker is not None else None

    @property
    def worker_command(self) -> list[str]:
        """The current worker's command line (its launcher's arguments and the model's options,
        as a worker started for this model); [] when no worker is ready."""
        return list(self.worker.command) if self.worker is not None else []

    @property
    def total_slots(self) -> int:
        """The ready worker's KV slots (``Ready.max_jobs``); 0 when no worker is ready."""
        return self.worker.max_jobs if self.worker is not None and self.worker.ready is not None else 0

    # ------------------------------------------------------------------ the worker's record

    def last_pong(self) -> Pong | None:
        """The current worker's most recent Pong (None before the first, or after it left)."""
        return self.liveness.last_pong()

    @property
    def loaded_at(self) -> float | None:
        """Unix time the last worker was ready."""
        return self.loader.loaded_at

    @property
    def last_ready(self) -> Ready | None:
        """The last worker's Ready (its n_ctx, slots), kept while asleep."""
        return self.loader.last_ready

    @property
    def sleeping(self) -> bool:
        """Unloaded for idleness and not woken since (llama-server's ``is_sleeping``)."""
        return self.asleep and self.state is WorkerState.UNLOADED

    def expires_at(self) -> float | None:
        """Unix time the idle unload is due (``router.workers.idle``); None: not idle or no TTL."""
        return self.idle.expires_at(self.last_active)

    def idle_ttl(self) -> float | None:
        """The idle time-to-live in force, s (``router.workers.idle.IdleTimer.ttl``)."""
        return self.idle.ttl()

    @property
    def blas_threads(self) -> int | None:
        """The BLAS threads its worker uses: ``n_threads``, else the share last sent (None: the worker's own)."""
        if self.model.n_threads is not None:
            return self.model.n_threads
        return self._threads.of(self.worker)

    def sample_rss(self, wp: WorkerProcess | None) -> int | None:
        """``wp``'s RSS now (its launcher's figure for its pid, or the injected probe); a ready worker's
        raises :attr:`rss_peak`."""
        if wp is None:
            return None
        rss = self.pool.memory.rss(wp.pid, self.model.name)
        if rss and wp is self.worker and self.state is WorkerState.READY:
            self.rss_peak = max(self.rss_peak or 0, rss)
        return rss

    def estimate(self) -> placement.Estimate:
        """What this model will take once loaded (router.workers.placement.estimate)."""
        return placement.estimate(self.model.path, self.model.kv_budget_mib, self.rss_peak,
                                  weights=self.model.weights_mode)

    def resident_bytes(self) -> int:
        """Its memory, bytes: its worker's RSS (:meth:`describe`'s ``rss_bytes``; with replicas,
        their sum) when known, else what it will take once loaded (:meth:`estimate`)."""
        return int(self.describe().get("rss_bytes") or self.estimate().total)

    def seat(self) -> placement.Seat | None:
        """This model as placement sees it now, when it holds a worker (else None)."""
        if self.state not in (WorkerState.LOADING, *LOADED, WorkerState.DRAINING):
            return None
        return placement.Seat(name=self.key, state=self.state.value,
                              idle=(self.state is WorkerState.READY and not self.busy and self.queue_depth == 0
                                    and self.users == 0),
                              pinned=self.model.pinned, last_active=self.last_active,
                              rss=self.sample_rss(self.worker or self.loader.worker) or 0,
                              estimate=self.estimate().total)

    # ------------------------------------------------------------------ the views

    def kv_slots(self) -> list[dict[str, Any]]:
        """One entry per KV slot of the ready worker (:func:`kv_slots`); with replicas, every
        replica's (``router.workers.replicas``)."""
        rs = self.replica_set()
        return rs.kv_slots() if rs is not None else kv_slots(self)

    def own_kv_slots(self) -> list[dict[str, Any]]:
        """This slot's worker's KV slots alone (:func:`kv_slots`)."""
        return kv_slots(self)

    def gauges(self) -> ModelGauges:
        """This model's figures for ``/metrics`` (with replicas: the model as a whole)."""
        return self.all_gauges()[0]

    def all_gauges(self) -> list[ModelGauges]:
        """This model's figures; with replicas, the model's then each replica's (``replica`` set)."""
        rs = self.replica_set()
        return rs.gauges() if rs is not None else [gauges(self)]

    def own_gauges(self) -> ModelGauges:
        """This slot's figures alone (:func:`gauges`)."""
        return gauges(self)

    def describe(self) -> dict[str, Any]:
        """The admin view of this model (:func:`describe`); with replicas, the model as a whole
        and each replica (``router.workers.replicas``)."""
        rs = self.replica_set()
        return rs.describe(describe(self)) if rs is not None else describe(self)

    def condition(self) -> str:
        """The state with its history, for operators (:func:`condition`)."""
        return condition(self)


def kv_slots(slot: SlotFacts) -> list[dict[str, Any]]:
    """One entry per KV slot of the ready worker (protocol names: ``id``, ``id_task``,
    ``is_processing``, ``n_past``): the worker's own list from its last Pong when it
    sends one, else made from the router's running set (request ids in admission
    order, ``n_past`` from the Pong's ``kv_tokens`` when there is one slot)."""
    n = slot.total_slots
    pong = slot.last_pong()
    if pong is not None and pong.slots:
        return [{"id": int(s.get("id", i)), "id_task": s.get("id_task"),
                 "is_processing": bool(s.get("is_processing")), "n_past": int(s.get("n_past", 0))}
                for i, s in enumerate(pong.slots)]
    running = slot.admission.running_on(slot.worker) if slot.worker is not None else []
    held = pong.kv_tokens if pong is not None and n == 1 else 0
    return [{"id": i, "id_task": running[i] if i < len(running) else None,
             "is_processing": i < len(running), "n_past": held} for i in range(n)]


def gauges(slot: SlotFacts) -> ModelGauges:
    """This model's figures for ``/metrics``."""
    pong = slot.last_pong()
    slots = kv_slots(slot)
    running, waiting = slot.admission.n_running, slot.queue_depth
    return ModelGauges(
        model=slot.model.name, state=slot.state.value, states=STATES,
        loaded=slot.state in LOADED or slot.state is WorkerState.DRAINING,
        waiting=waiting, running=running, total_slots=len(slots),
        busy_slots=sum(1 for s in slots if s["is_processing"]),
        kv_tokens=pong.kv_tokens if pong is not None else 0,
        kv_budget_tokens=(pong.kv_budget_tokens if pong is not None and pong.kv_budget_tokens
                          else slot.worker.ready.kv_budget_tokens
                          if slot.worker is not None and slot.worker.ready is not None else 0))


def describe(slot: SlotFacts) -> dict[str, Any]:
    """The admin view of this model (times: unix seconds; load_ms: ms)."""
    w = slot.worker or slot.loader.worker
    ready = slot.worker.ready if slot.worker is not None else None
    return {
        "id": slot.model.name,
        "aliases": list(slot.model.aliases),
        "state": slot.state.value,
        "pid": w.pid if w is not None and w.alive else None,
        "queue_depth": slot.queue_depth,
        "in_flight": slot.running_ids,
        "slots_total": ready.max_jobs if ready else slot.model.parallel,
        "slots_busy": len(slot.running_ids),
        "max_queue": slot.model.max_queue,
        "load_ms": slot.loader.load_ms,
        "loaded_at": slot.loaded_at,
        "last_used": slot.last_used,
        "last_error": slot.last_error,
        "unload_reason": slot.unloader.unload_reason,
        "idle_ttl_s": slot.model.idle_ttl_s,
        "keep_alive_s": slot.idle.keep_alive_s(),
        "expires_at": slot.expires_at(),
        "blas_threads": slot.blas_threads,
        "last_exit_code": slot.last_exit_code,
        "condition": condition(slot),
        "unresponsive_since": slot.liveness.unresponsive_since,
        "failures": slot.failures.describe(slot.clock()),
        "spawn_count": slot.loader.spawn_count,
        "refused_peers": w.refused_peers if w is not None else 0,
        "host": w.host if w is not None else None,  # where its worker runs (its launcher's host)
        "from_spare": w.from_spare if w is not None else None,  # the worker was the warm spare
        "rss_bytes": slot.sample_rss(w) if w is not None and w.alive else None,
        "placement": {"pinned": slot.model.pinned, "waiting_for": slot.placing.waiting_for,
                      "estimate": slot.estimate().describe(), "rss_after_load_bytes": slot.loader.rss_after_load,
                      "rss_peak_bytes": slot.rss_peak},
        "n_ctx": ready.n_ctx if ready else slot.model.n_ctx,
        "architecture": ready.architecture if ready else None,
        "path": str(slot.model.path),
        "weights": slot.model.weights_mode,
    }


def condition(slot: SlotFacts) -> str:
    """The state with its history, for operators: ``never_loaded``, ``unloaded``,
    ``loading``, ``ready``, ``unresponsive`` (silent; killed at ping_timeout_s unless it
    answers), ``draining``, ``crashed`` (a ready worker died; restarts on
    the next request after the backoff), ``load_failed`` (same, its load failed), or
    ``failed`` (``max_crashes`` within ``crash_window_s``: until an operator loads it)."""
    if slot.state is WorkerState.FAILED:
        if slot.failures.given_up:
            return "failed"
        last = slot.failures.last
        return last.kind if last is not None else "load_failed"
    if slot.state is WorkerState.UNLOADED and slot.loader.spawn_count == 0:
        return "never_loaded"
    return slot.state.value
