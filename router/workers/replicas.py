"""A model's replicas (``replicas = N``): N slots, each its own worker, state machine,
admission queue and liveness; the model as a whole is what clients name.

The pool keeps the model's first slot where a one-worker model's slot is (``Pool.slots``), and
the others beside it (``Pool.extra``); :class:`ReplicaSet` is the view of all of them made when
asked (the slots are the state). What it decides:

* which replicas may take a request now (:meth:`ReplicaSet.ready`), and the load of each
  (running + waiting, as admission counts them); the choice among them is the serving layer's
  (``router.serving.routing``);
* lazy start: the first request starts the replica it is routed to; the others start at the
  same time in the background (:meth:`ReplicaSet.start_others`), so a burst soon spreads;
* a replica whose worker is lost (crashed, its host gone): its running streams fail at once
  (as any worker's), and the requests still waiting in its queue move to the least loaded other
  ready replica (:meth:`ReplicaSet.rehome`) — or wait there for its restart when none is ready;
  the lost replica is placed again after its crash backoff (``router.workers.loading``);
* a replica that becomes ready takes requests waiting on the others while that evens the load
  (:meth:`ReplicaSet.rebalance`);
* what ``/admin/models``, ``/slots`` and ``/metrics`` show: the model as a whole (state: the
  most available of its replicas' states; queue, running and slots summed) and each replica
  (``replica``, ``node``, ``state``, slots, load).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from router.config import ModelConfig
from router.config_readers import replica_endpoint
from router.http.errors import ApiError
from router.metrics import ModelGauges
from router.workers.lifecycle import WorkerState

if TYPE_CHECKING:
    from router.workers.slot import ModelSlot

log = logging.getLogger("modelyard.pool")

#: A model's state when its replicas differ: the first of these any replica is in.
_BEST_FIRST = (WorkerState.READY, WorkerState.UNRESPONSIVE, WorkerState.LOADING, WorkerState.DRAINING,
               WorkerState.FAILED, WorkerState.UNLOADED)


def replica_model(model: ModelConfig, replica: int) -> ModelConfig:
    """The config replica ``replica`` runs: the model's, with its own ``kv_cache_dir`` below the
    model's (``replica-N``) so that two workers never share one disk cache, and its own KV-events
    endpoint (``router.config_readers.replica_endpoint``)."""
    if replica == 0:
        return model
    ep = model.kv_events_endpoint
    return dataclasses.replace(model, kv_cache_dir=None if model.kv_cache_dir is None else model.kv_cache_dir / f"replica-{replica}",
                               kv_events_endpoint=None if ep is None else replica_endpoint(ep, replica))


def load_of(slot: ModelSlot) -> int:
    """A replica's load: its requests running plus waiting (admission's count)."""
    running, waiting = slot.admitted_split()
    return running + waiting


def node_of(slot: ModelSlot) -> str | None:
    """Where a replica's worker runs (its launcher's host: ``HOST/NODE-ID`` on Ray); None without a worker."""
    w = slot.worker or slot.loader.worker
    return w.host if w is not None else None


class ReplicaSet:
    """The slots of one model with ``replicas > 1``, by replica number (see the module doc)."""

    def __init__(self, slots: list[ModelSlot]) -> None:
        self.slots = slots

    @property
    def name(self) -> str:
        return self.slots[0].model.name

    def ready(self) -> list[ModelSlot]:
        """Replicas whose worker takes new jobs now (ready, open)."""
        return [s for s in self.slots if s.state is WorkerState.READY and s.worker is not None and not s.refusing()]

    def open(self) -> list[ModelSlot]:
        """Replicas that may admit a request (not draining for an operator, not removed)."""
        return [s for s in self.slots if not s.refusing()]

    def start_others(self, first: ModelSlot) -> None:
        """``first`` loads for a request: start the other unloaded replicas too (in the background;
        one in its crash backoff or refused is left to its own restart)."""
        for s in self.slots:
            if s is not first and s.state is WorkerState.UNLOADED and not s.placing.asked:
                try:
                    s.begin_load(operator=False)
                except ApiError as e:
                    log.info("model %s replica %d: not started with the others (%s)", self.name, s.replica, e)

    def rehome(self, lost: ModelSlot) -> int:
        """``lost``'s worker is gone: its waiting requests move to the least loaded other ready
        replica (each in turn). Returns how many moved (0: none ready; they wait for the restart)."""
        others = [s for s in self.ready() if s is not lost]
        if not others:
            return 0
        moved = lost.admission.take_waiting()
        for t in moved:
            to = min(others, key=load_of)
            t.replica = to
            to.admission.enqueue(t)
            to.pump()
        if moved:
            log.warning("model %s: %d waiting request(s) of lost replica %d moved to other replicas",
                        self.name, len(moved), lost.replica)
            lost.changed.set()
        return len(moved)

    def rebalance(self, fresh: ModelSlot) -> int:
        """``fresh`` has just become ready: requests waiting on the other replicas move to it while
        that evens the load (from the most loaded, newest first: the oldest keep their place), so
        that a burst queued while the replicas loaded does not stay behind the first one ready.
        Returns how many moved."""
        moved = 0
        while True:
            donors = [s for s in self.slots if s is not fresh and s.queue_depth > 0]
            donor = max(donors, key=load_of, default=None)
            if donor is None or load_of(donor) - load_of(fresh) < 2:
                break
            t = donor.admission.take_newest_waiting()
            if t is None:
                break
            t.replica = fresh
            fresh.admission.enqueue(t)
            donor.changed.set()
            moved += 1
        if moved:
            log.info("model %s: %d waiting request(s) moved to replica %d, ready now", self.name, moved, fresh.replica)
            fresh.pump()
        return moved

    # ------------------------------------------------------------------ views

    def state(self) -> WorkerState:
        """The model's state as a whole: the most available of its replicas' states."""
        states = {s.state for s in self.slots}
        return next(st for st in _BEST_FIRST if st in states)

    def replica_row(self, slot: ModelSlot) -> dict[str, Any]:
        """One replica as ``/admin/models`` and ``/models`` list it."""
        w = slot.worker or slot.loader.worker
        running, waiting = slot.admitted_split()
        alive = w is not None and w.alive
        return {"replica": slot.replica, "node": node_of(slot),
                "pid": w.pid if w is not None and alive else None,
                "rss_bytes": slot.sample_rss(w) if w is not None and alive else None, "state": slot.state.value,
                "condition": slot.condition(), "slots_total": slot.total_slots,
                "slots_busy": slot.admission.n_running, "queue_depth": slot.queue_depth,
                "load": running + waiting, "prefix_blocks": len(slot.prefix)}

    def describe(self, first: dict[str, Any]) -> dict[str, Any]:
        """The model's ``/admin/models`` row: replica 0's (``first``) with the model's state and its
        queue, requests, slots and workers' RSS summed, and ``replicas``: each replica's row."""
        rows = [self.replica_row(s) for s in self.slots]
        rss = [r["rss_bytes"] for r in rows if r["rss_bytes"] is not None]
        return {**first, "state": self.state().value, "rss_bytes": sum(rss) if rss else None,
                "queue_depth": sum(r["queue_depth"] for r in rows),
                "in_flight": [rid for s in self.slots for rid in s.running_ids],
                "slots_total": sum(r["slots_total"] for r in rows) or first["slots_total"] * len(rows),
                "slots_busy": sum(r["slots_busy"] for r in rows),
                "routing": self.slots[0].model.routing, "replicas": rows}

    def gauges(self) -> list[ModelGauges]:
        """The model's ``/metrics`` row (summed; its state: :meth:`state`) and one row per replica."""
        rows = [dataclasses.replace(s.own_gauges(), replica=s.replica, node=node_of(s) or "") for s in self.slots]
        state = self.state()
        whole = dataclasses.replace(
            rows[0], replica=None, node="", state=state.value,
            loaded=any(r.loaded for r in rows), waiting=sum(r.waiting for r in rows),
            running=sum(r.running for r in rows), total_slots=sum(r.total_slots for r in rows),
            busy_slots=sum(r.busy_slots for r in rows), kv_tokens=sum(r.kv_tokens for r in rows),
            kv_budget_tokens=sum(r.kv_budget_tokens for r in rows))
        return [whole, *rows]

    def kv_slots(self) -> list[dict[str, Any]]:
        """Every replica's KV slots (``/slots``), each with its ``replica`` and ``node``."""
        return [{**k, "replica": s.replica, "node": node_of(s)} for s in self.slots for k in s.own_kv_slots()]

    # ------------------------------------------------------------------ the operator's load / unload

    async def load(self) -> float:
        """Load every replica; the longest load time, ms. Raises the first replica's failure."""
        times = await asyncio.gather(*(s.load() for s in self.slots))
        return max(times)

    async def unload(self, *, drain: bool = True, reason: str = "unloaded by request") -> None:
        await asyncio.gather(*(s.unload(drain=drain, reason=reason) for s in self.slots))

    def begin_load(self, *, operator: bool = True) -> bool:
        """Start loading every replica (llama.cpp's ``POST /models/load``); True if any starts."""
        started = [s.begin_load(operator=operator) for s in self.slots]
        return any(started)

    def begin_unload(self, *, drain: bool = True, reason: str = "unloaded by request") -> asyncio.Task[None]:
        tasks = [s.begin_unload(drain=drain, reason=reason) for s in self.slots]

        async def every() -> None:
            await asyncio.gather(*tasks)
        return asyncio.get_running_loop().create_task(every(), name=f"unload-{self.name}")


__all__ = ["ReplicaSet", "load_of", "node_of", "replica_model"]
