"""What one model's slot looks like from outside: /admin/models, /metrics' gauges, /slots.

Read-only views of a :class:`~router.workers.slot.ModelSlot`, made when asked (no state of
their own); the slot's methods of the same names return them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from router.metrics import ModelGauges
from router.workers.lifecycle import LOADED, WorkerState

#: Every state a model's worker can be in (``/metrics``' ``modelyard_model_state`` label set).
STATES = tuple(s.value for s in WorkerState)

if TYPE_CHECKING:
    from router.workers.slot import ModelSlot


def kv_slots(slot: ModelSlot) -> list[dict[str, Any]]:
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


def gauges(slot: ModelSlot) -> ModelGauges:
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


def describe(slot: ModelSlot) -> dict[str, Any]:
    """The admin view of this model (times: unix seconds; load_ms: ms)."""
    w = slot.worker or slot.loading_worker
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
        "load_ms": slot.load_ms,
        "loaded_at": slot.loaded_at,
        "last_used": slot.last_used,
        "last_error": slot.last_error,
        "unload_reason": slot.unload_reason,
        "idle_ttl_s": slot.model.idle_ttl_s,
        "keep_alive_s": slot.idle.keep_alive_s(),
        "expires_at": slot.expires_at(),
        "blas_threads": slot.blas_threads,
        "last_exit_code": slot.last_exit_code,
        "condition": condition(slot),
        "unresponsive_since": slot.unresponsive_since,
        "failures": slot.failures.describe(slot.clock()),
        "spawn_count": slot.spawn_count,
        "refused_peers": w.refused_peers if w is not None else 0,
        "host": w.host if w is not None else None,  # where its worker runs (its launcher's host)
        "from_spare": w.from_spare if w is not None else None,  # the worker was the warm spare
        "rss_bytes": slot.sample_rss(w) if w is not None and w.alive else None,
        "placement": {"pinned": slot.model.pinned, "waiting_for": slot.waiting_for,
                      "estimate": slot.estimate().describe(), "rss_after_load_bytes": slot.rss_after_load,
                      "rss_peak_bytes": slot.rss_peak},
        "n_ctx": ready.n_ctx if ready else slot.model.n_ctx,
        "architecture": ready.architecture if ready else None,
        "path": str(slot.model.path),
        "weights": slot.model.weights_mode,
    }


def condition(slot: ModelSlot) -> str:
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
    if slot.state is WorkerState.UNLOADED and slot.spawn_count == 0:
        return "never_loaded"
    return slot.state.value
